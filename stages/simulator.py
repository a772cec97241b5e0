"""Run every stage's instruction list together, without processes, and check it.

The model is the one the stage executor implements:

* Compute (`Forward`, `Backward`) takes `forward_cost` / `backward_cost` time,
  `ReduceGrads` ``reduce_cost`` (the part of the gradient reduction not
  hidden behind the last backward); loads, communication and `OptimizerStep`
  take none. A split backward's `BackwardWeight` takes ``weight_cost`` (half
  the backward unless given) and its `BackwardInput` the rest — except on the
  model's first chunk, whose input needs no gradient: there I is empty and W
  is the whole backward, as the executor runs it. A stage's data-parallel replicas
  run the same program in step, so one pipeline stands for all of them.
* Between neighbouring model chunks there are two FIFO channels
  (activations c -> c+1, gradients c+1 -> c), matched in order as
  torch.distributed point-to-point messages are; chunk c sits on the stage
  `evtrain.stages.schedules.chunk_place` says (a hand-off between two chunks
  of one stage, zbv's turn, is a channel like the others). A send is
  buffered: it never blocks (the executor posts it and waits on it later).
  A receive blocks until the matching send was issued;
  it then completes at the later of the two times. With
  ``rendezvous_sends=True`` a send also blocks until the peer's receive
  takes it (what waiting on each send at once amounts to).

Because every channel has one sender and one receiver and receives block,
the result does not depend on which stage the simulator advances first.

It raises `DeadlockError` when no stage can move and some are unfinished,
and `ScheduleError` for anything else that would break a real run: a receive
that would get another microbatch's tensor, a forward without its input or
targets, a backward before its forward or without its gradient, a microbatch
computed twice or never, an unreceived send, an `OptimizerStep` before all
backwards, and the cross-stage orderings (forward of m on s ends before it
starts on s+1; backward of m on s+1 ends before it starts on s).

The bubble fraction reported is ``1 - sum(busy) / (P * makespan)``: the idle
share of all stage-time in the step. `SimulationResult.stage_idle_fraction`
gives the per-stage ``idle / makespan`` as well.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from evtrain.errors import UsageError
from evtrain.schedule_names import Schedule, check_positive, check_virtual_stages, parse_schedule
from evtrain.stages.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    LoadMicrobatch,
    MicrobatchInstruction,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
)
from evtrain.stages.schedules import build_schedule, chunk_place, model_chunk

__all__ = [
    "DeadlockError",
    "ScheduleError",
    "SimulationResult",
    "Span",
    "bubble_fraction",
    "simulate",
    "simulate_programs",
]


class ScheduleError(Exception):
    """The instruction lists would fail or compute the wrong thing if run."""


class DeadlockError(ScheduleError):
    """No stage can make progress; `stuck` maps each unfinished stage to the
    instruction it waits at."""

    def __init__(self, stuck: dict[int, Instruction], positions: dict[int, int]) -> None:
        self.stuck = stuck
        where = "; ".join(
            f"stage {s} waits at {ins} (instruction {positions[s]})" for s, ins in stuck.items()
        )
        super().__init__(f"deadlock: {where}")


class Span(NamedTuple):
    """One interval on a stage's timeline: a microbatch's compute, or the step's
    gradient reduction (``"reduce"``, microbatch -1; not counted as busy). A
    split backward draws its I as ``"backward"`` and its W as ``"weight"``."""

    start: float
    end: float
    kind: Literal["forward", "backward", "weight", "reduce"]
    microbatch: int
    chunk: int = 0
    """The process's model chunk (virtual stage), 0..V-1."""


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """What one simulated step did.

    `timelines[s]` lists stage s's compute spans in execution order;
    `peak_in_flight[s]` is the most activations stage s held at once
    (forwards done whose backward, or W, was not yet done); `busy[s]` its compute
    time; `makespan` the time the last stage finished; `bubble_fraction`
    ``1 - sum(busy) / (P * makespan)`` (0 when the makespan is 0).
    """

    num_stages: int
    num_microbatches: int
    timelines: tuple[tuple[Span, ...], ...]
    peak_in_flight: tuple[int, ...]
    busy: tuple[float, ...]
    makespan: float
    bubble_fraction: float

    @property
    def stage_idle_fraction(self) -> tuple[float, ...]:
        """Per stage, ``(makespan - busy) / makespan`` (0 when the makespan is 0)."""
        if self.makespan == 0:
            return tuple(0.0 for _ in self.busy)
        return tuple((self.makespan - b) / self.makespan for b in self.busy)


class _Message:
    """A tensor in a channel: which microbatch, when it was sent, and (for
    rendezvous sends) when a receive took it."""

    __slots__ = ("microbatch", "sent_at", "taken_at")

    def __init__(self, microbatch: int, sent_at: float) -> None:
        self.microbatch = microbatch
        self.sent_at = sent_at
        self.taken_at: float | None = None


_ACT, _GRAD = "activation", "gradient"


class _Stage:
    """Mutable per-stage state while simulating."""

    def __init__(self, program: Sequence[Instruction]) -> None:
        self.program = program
        self.pc = 0
        self.clock = 0.0
        # Every set holds (chunk, microbatch) pairs.
        self.loaded: set[tuple[int, int]] = set()
        self.received: dict[str, set[tuple[int, int]]] = {_ACT: set(), _GRAD: set()}
        self.forwarded: set[tuple[int, int]] = set()
        self.input_grads: set[tuple[int, int]] = set()
        """Microbatches whose input gradient is computed (B or I)."""
        self.backwarded: set[tuple[int, int]] = set()
        """Microbatches whose backward is complete (B or W)."""
        self.optimizer_steps = 0
        self.reduced = False
        self.in_flight = 0
        self.peak = 0
        self.busy = 0.0
        self.spans: list[Span] = []
        self.pending_send: _Message | None = None  # rendezvous mode only


def simulate(
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    forward_cost: float = 1.0,
    backward_cost: float = 1.0,
    *,
    rendezvous_sends: bool = False,
    reduce_grads: bool = False,
    reduce_cost: float = 0.0,
    weight_cost: float | None = None,
    lookahead: int = 0,
    virtual_stages: int = 1,
) -> SimulationResult:
    """Build every stage's program for `schedule` (with `virtual_stages` chunks per
    stage) and simulate one step; see `simulate_programs`."""
    programs = [
        build_schedule(
            schedule,
            s,
            num_stages,
            num_microbatches,
            reduce_grads=reduce_grads,
            lookahead=lookahead,
            virtual_stages=virtual_stages,
        )
        for s in range(num_stages)
    ]
    return simulate_programs(
        programs,
        num_microbatches,
        forward_cost,
        backward_cost,
        rendezvous_sends=rendezvous_sends,
        reduce_cost=reduce_cost,
        weight_cost=weight_cost,
        schedule=schedule,
    )


# One event loop over every stage's program, and one interpreter of all instruction
# kinds: splitting either would scatter the timing model it states in one place.
def simulate_programs(  # noqa: C901, PLR0915
    programs: Sequence[Sequence[Instruction]],
    num_microbatches: int,
    forward_cost: float = 1.0,
    backward_cost: float = 1.0,
    *,
    rendezvous_sends: bool = False,
    reduce_cost: float = 0.0,
    weight_cost: float | None = None,
    schedule: str | Schedule = Schedule.ONE_F_ONE_B,
) -> SimulationResult:
    """Simulate one step of arbitrary per-stage programs (`programs[s]` for
    stage s) over `num_microbatches` microbatches, their chunks placed as
    `schedule` places them (`evtrain.stages.schedules.model_chunk`).

    A program without any backward is a forward-only (evaluation) program;
    otherwise every microbatch must be backwarded once — by `Backward`, or by
    `BackwardInput` then `BackwardWeight` — and the program must end the step
    with exactly one `OptimizerStep`. Raises `DeadlockError` or
    `ScheduleError` as described in the module docstring.
    """
    if weight_cost is None:
        weight_cost = backward_cost / 2
    for name, cost in (
        ("forward_cost", forward_cost),
        ("backward_cost", backward_cost),
        ("reduce_cost", reduce_cost),
        ("weight_cost", weight_cost),
    ):
        if not math.isfinite(cost) or cost < 0:
            raise UsageError(f"{name} must be a finite number >= 0, got {cost!r}")
    if weight_cost > backward_cost:
        raise UsageError(
            f"weight_cost ({weight_cost!r}) is a part of backward_cost ({backward_cost!r})"
        )
    if not programs:
        raise UsageError("programs must hold at least one stage's program")
    if num_microbatches < 1:
        raise UsageError(f"num_microbatches must be >= 1, got {num_microbatches!r}")

    P, M = len(programs), num_microbatches
    kind = parse_schedule(schedule)
    # Virtual stages: stage s holds local chunks v = 0..V-1 (model_chunk places them).
    V = 1 + max((getattr(i, "chunk", 0) for p in programs for i in p), default=0)
    C = P * V
    stages = [_Stage(p) for p in programs]
    # channels[(kind, src chunk, dst chunk)]: FIFO of messages sent but not yet received.
    channels: dict[tuple[str, int, int], deque[_Message]] = {}

    def fail(s: int, ins: Instruction, why: str) -> ScheduleError:
        return ScheduleError(f"stage {s} at {ins} (instruction {stages[s].pc}): {why}")

    def send(s: int, ins: MicrobatchInstruction, kind: str, src: int, dst: int) -> bool:
        st = stages[s]
        if st.pending_send is None:
            msg = _Message(ins.microbatch, st.clock)
            channels.setdefault((kind, src, dst), deque()).append(msg)
            if not rendezvous_sends:
                return True
            st.pending_send = msg
        if st.pending_send.taken_at is None:
            return False
        st.clock = max(st.clock, st.pending_send.taken_at)
        st.pending_send = None
        return True

    def recv(s: int, ins: MicrobatchInstruction, kind: str, src: int, dst: int) -> bool:
        st = stages[s]
        queue = channels.get((kind, src, dst))
        if not queue:
            return False
        msg = queue.popleft()
        if msg.microbatch != ins.microbatch:
            raise fail(s, ins, f"would receive the {kind} of microbatch {msg.microbatch}")
        st.clock = msg.taken_at = max(st.clock, msg.sent_at)
        st.received[kind].add((ins.chunk, ins.microbatch))
        return True

    def compute(s: int, ins: MicrobatchInstruction, cost: float) -> None:
        st = stages[s]
        kind: Literal["forward", "backward", "weight"] = (
            "forward"
            if isinstance(ins, Forward)
            else "weight"
            if isinstance(ins, BackwardWeight)
            else "backward"
        )
        st.spans.append(Span(st.clock, st.clock + cost, kind, ins.microbatch, ins.chunk))
        st.clock += cost
        st.busy += cost

    def step(s: int, ins: Instruction) -> bool:  # noqa: C901
        """Execute `ins` on stage s; False when it must wait."""
        st = stages[s]
        m = getattr(ins, "microbatch", 0)
        v = getattr(ins, "chunk", 0)
        if not 0 <= m < M:
            raise fail(s, ins, f"microbatch outside 0..{M - 1}")
        if v < 0:
            raise fail(s, ins, "negative chunk")
        c = model_chunk(kind, s, P, v)
        first, last = c == 0, c == C - 1
        k = (v, m)
        match ins:
            case LoadMicrobatch():
                st.loaded.add(k)
            case RecvActivation():
                if first:
                    raise fail(s, ins, "the first stage has no previous stage")
                return recv(s, ins, _ACT, c - 1, c)
            case RecvGrad():
                if last:
                    raise fail(s, ins, "the last stage has no next stage")
                return recv(s, ins, _GRAD, c + 1, c)
            case SendActivation():
                if last:
                    raise fail(s, ins, "the last stage has no next stage")
                if k not in st.forwarded:
                    raise fail(s, ins, "sends an activation before its forward")
                return send(s, ins, _ACT, c, c + 1)
            case SendGrad():
                if first:
                    raise fail(s, ins, "the first stage has no previous stage")
                if k not in st.input_grads:
                    raise fail(s, ins, "sends a gradient before its backward")
                return send(s, ins, _GRAD, c, c - 1)
            case Forward():
                if k in st.forwarded:
                    raise fail(s, ins, "forwards the microbatch twice")
                if (first or last) and k not in st.loaded:
                    raise fail(s, ins, "forward before LoadMicrobatch (inputs/targets)")
                if not first and k not in st.received[_ACT]:
                    raise fail(s, ins, "forward before its activation was received")
                compute(s, ins, forward_cost)
                st.forwarded.add(k)
                st.in_flight += 1
                st.peak = max(st.peak, st.in_flight)
            case Backward() | BackwardInput():
                if k in st.input_grads:
                    raise fail(s, ins, "backwards the microbatch twice")
                if k not in st.forwarded:
                    raise fail(s, ins, "backward before its forward")
                if not last and k not in st.received[_GRAD]:
                    raise fail(s, ins, "backward before its gradient was received")
                st.input_grads.add(k)
                if isinstance(ins, Backward):
                    compute(s, ins, backward_cost)
                    st.backwarded.add(k)
                    st.in_flight -= 1
                else:
                    compute(s, ins, 0.0 if first else backward_cost - weight_cost)
            case BackwardWeight():
                if k in st.backwarded:
                    raise fail(s, ins, "backwards the microbatch twice")
                if k not in st.input_grads:
                    raise fail(s, ins, "weight gradients before the input gradient")
                compute(s, ins, backward_cost if first else weight_cost)
                st.backwarded.add(k)
                st.in_flight -= 1
            case ReduceGrads():
                if len(st.backwarded) != M * V or st.reduced:
                    raise fail(s, ins, "gradients must be reduced once, after all M backwards")
                if reduce_cost:
                    st.spans.append(Span(st.clock, st.clock + reduce_cost, "reduce", -1))
                st.clock += reduce_cost
                st.reduced = True
            case OptimizerStep():
                if len(st.backwarded) != M * V or st.optimizer_steps:
                    raise fail(s, ins, "optimizer step must come once, after all M backwards")
                st.optimizer_steps += 1
            case _:
                raise fail(s, ins, f"unknown instruction {ins!r}")
        return True

    # Advance every stage as far as it can go until none can; in a Kahn-style
    # network like this one the visiting order does not change any time.
    moved = True
    while moved:
        moved = False
        for s, st in enumerate(stages):
            while st.pc < len(st.program) and step(s, st.program[st.pc]):
                st.pc += 1
                moved = True
    stuck = {s: st.program[st.pc] for s, st in enumerate(stages) if st.pc < len(st.program)}
    if stuck:
        raise DeadlockError(stuck, {s: stages[s].pc for s in stuck})

    _check_complete(stages, channels, M, V, kind)
    _check_cross_stage_order(stages, V, kind)
    makespan = max(st.clock for st in stages)
    busy = tuple(st.busy for st in stages)
    return SimulationResult(
        num_stages=P,
        num_microbatches=M,
        timelines=tuple(tuple(st.spans) for st in stages),
        peak_in_flight=tuple(st.peak for st in stages),
        busy=busy,
        makespan=makespan,
        bubble_fraction=1 - sum(busy) / (P * makespan) if makespan else 0.0,
    )


def _check_complete(
    stages: list[_Stage],
    channels: dict[tuple[str, int, int], deque[_Message]],
    M: int,
    V: int,
    kind: Schedule,
) -> None:
    """Every microbatch forwarded once per stage (and chunk), backwarded once
    (training) or never (forward-only), one optimizer step per training
    program, and no message left unreceived."""
    everything = {(v, m) for v in range(V) for m in range(M)}
    training = any(st.input_grads for st in stages)

    def named(items: set[tuple[int, int]]) -> set[int] | set[str]:
        if V == 1:
            return {m for _, m in items}
        return {f"{m}@{v}" for v, m in items}

    for s, st in enumerate(stages):
        if st.forwarded != everything:
            missing = named(everything - st.forwarded)
            raise ScheduleError(f"stage {s} never forwards microbatches {missing}")
        if training and st.backwarded != everything:
            missing = named(everything - st.backwarded)
            raise ScheduleError(f"stage {s} never backwards microbatches {missing}")
        if training and st.optimizer_steps != 1:
            raise ScheduleError(f"stage {s} has no OptimizerStep")
    P = len(stages)
    for (what, src, dst), queue in channels.items():
        if queue:
            mbs = [msg.microbatch for msg in queue]
            where, whence = _where(dst, P, V, kind), _where(src, P, V, kind)
            raise ScheduleError(f"{where} never receives the {what}s {mbs} sent by {whence}")


def _check_cross_stage_order(stages: list[_Stage], V: int, schedule: Schedule) -> None:
    """Forward of m ends on model chunk c before it starts on c+1; backward of m
    ends on c+1 before it starts on c (with one chunk per stage, the stages).
    Implied by the receives when the program has them; checked on the
    timelines so a schedule cannot skip them."""
    P = len(stages)
    spans = {
        (sp.kind, model_chunk(schedule, s, P, sp.chunk), sp.microbatch): sp
        for s, st in enumerate(stages)
        for sp in st.spans
    }
    for (kind, c, m), here in spans.items():
        there = spans.get((kind, c + 1, m))
        if there is None:
            continue
        if kind == "forward" and here.end > there.start:
            raise ScheduleError(
                f"forward of microbatch {m} starts on {_where(c + 1, P, V, schedule)} too early"
            )
        if kind == "backward" and there.end > here.start:
            raise ScheduleError(
                f"backward of microbatch {m} starts on {_where(c, P, V, schedule)} too early"
            )


def _where(chunk: int, P: int, V: int, kind: Schedule) -> str:
    return f"stage {chunk}" if V == 1 else f"stage {chunk_place(kind, P, chunk)[0]} (chunk {chunk})"


def bubble_fraction(
    num_stages: int,
    num_microbatches: int,
    schedule: str | Schedule = Schedule.ONE_F_ONE_B,
    virtual_stages: int = 1,
) -> float:
    """Idle share of a step with equal per-stage costs: ``(P - 1) / (M + P - 1)``
    for GPipe and 1F1B; for zero bubble at M >= P, with I = W = half a
    backward and a backward twice a forward, ``(P - 1) / (3M + P - 1)``: a
    third of 1F1B's idle time per stage, over a step that much shorter; for
    interleaved with V chunks per stage and M a multiple of P,
    ``(P - 1) / (V·M + P - 1)``: 1F1B's idle time divided by V; for zbv at
    M >= 2P - 1 (same costs), ``(P - 1) / (6M + P - 1)``; below that the
    order has no closed form and the figure is simulated."""
    kind = parse_schedule(schedule)
    check_positive("num_stages", num_stages)
    check_positive("num_microbatches", num_microbatches)
    P, M = num_stages, num_microbatches
    if kind is Schedule.ZBV:
        if M >= 2 * P - 1:
            return (P - 1) / (6 * M + P - 1)
        return simulate(kind, P, M, 0.5, 1.0, virtual_stages=2).bubble_fraction
    if kind is Schedule.ZERO_BUBBLE:
        return (P - 1) / (3 * M + P - 1)
    if kind is Schedule.INTERLEAVED:
        check_virtual_stages(kind, P, M, virtual_stages)
        return (P - 1) / (virtual_stages * M + P - 1)
    return (P - 1) / (M + P - 1)
