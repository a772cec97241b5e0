"""Pipeline schedules as pure functions of (schedule, stage, P, M[, V]).

`build_schedule` returns the instruction list one stage runs for one training
step. Each microbatch m appears on every stage as a forward block and a
backward block:

    forward block   [L m] [RA m] F m [SA m]
    backward block  [RG m] B m [SG m]

where `L` (LoadMicrobatch) is on the first stage (inputs) and on the last
stage (targets for the loss) — both when P=1 —, `RA` on every stage but the
first, `SA`/`RG` on every stage but the last, and `SG` on every stage but the
first. A step ends with one `OptimizerStep`. With ``reduce_grads=True`` (what
the stage runtime asks for) a `ReduceGrads` comes just before it, after the
stage's last backward: the point where the stage's gradients are final —
averaged over its data-parallel replicas and summed over the stages of its
tied weights (DeepSpeed's ReduceTiedGrads and ReduceGrads).

The schedules differ in how the blocks interleave:

* GPipe: all M forward blocks, then all M backward blocks in the order
  0..M-1 on every stage (as torch.distributed.pipelining's ScheduleGPipe).
  Every stage handles the microbatches in the same order, so each receive
  has its send issued earlier by the neighbour and the point-to-point
  channels match in FIFO order: no deadlock. Peak memory: M activations.
* 1F1B (PipeDream-Flush, Megatron's non-interleaved schedule): stage r runs
  ``w = min(P - r - 1, M)`` warm-up forwards, then M - w pairs
  (forward w+i, backward i), then the w cool-down backwards. At most
  ``min(P - r, M)`` activations are alive at once.

* Zero bubble ("zb", ZB-H1 of Qi et al., "Zero Bubble Pipeline
  Parallelism", arXiv 2401.10241; torch's ScheduleInterleavedZeroBubble with
  one stage per rank builds the same order): the backward is split into
  `BackwardInput` (I: the input gradient, sent upstream at once) and
  `BackwardWeight` (W: the weight gradients). Stage r runs 1F1B's warm-up,
  then (F, I) pairs and cool-down I's as 1F1B runs (F, B), but its W's
  trail its I's by r microbatches: the last stage defers the most, so the
  gradient chain back to stage 0 costs I's only, and the deferred W's fill
  the cool-down bubble. With F = I = W per stage the idle time per stage
  drops from 1F1B's (P-1)(F+I+W) to (P-1)(F+I-W), a third. Every stage
  holds at most ``min(P, M)`` activations (a microbatch's activations live
  until its W): 1F1B's peak, which 1F1B reaches on stage 0 only.

* Interleaved 1F1B ("interleaved", Narayanan et al., arXiv 2104.04473;
  Megatron's and torch's ScheduleInterleaved1F1B): the model is split into
  P x V chunks and stage s holds chunks s, s+P, ..., s+(V-1)P — every
  instruction names its local chunk v. Microbatches go through the chunks in
  rounds of ``M / r`` (``r = max(1, M // P)`` rounds, so M must be a multiple
  of r): stage s warms up with ``(V-1) M/r + 2(P-1-s)`` forwards, cycling
  through its chunks round by round (depth first), then alternates one
  forward and one backward, the backwards visiting the chunks in reverse.
  The idle time is 1F1B's divided by V; the price is V times the
  point-to-point messages and more chunk activations held (each 1/V of a
  stage's). The chunks' messages travel around a ring: the last stage's
  chunk v feeds the first stage's chunk v+1.

* V-shaped zero bubble ("zbv", ZB-V of the same paper; torch's
  ScheduleZBVZeroBubble builds the same order): the model is split into 2P
  chunks placed in a V, two per stage, and the backward is split as in zb.
  Stage s holds chunk ``P-1-s`` (local chunk 0) and chunk ``P+s`` (local
  chunk 1): a microbatch enters on stage P-1, runs down the stages through
  their chunk 0, turns on stage 0 (whose chunk 0 hands its output to its own
  chunk 1 without leaving the process) and runs back up through chunk 1 to
  the loss on stage P-1, which therefore reads both the inputs and the
  targets. Every stage then has work at both ends of a step: with a
  backward twice a forward and I = W, the idle time per stage is ``P-1``
  chunk forwards, ``(P-1)F/2``, a sixth of 1F1B's ``(P-1)(F+B)``, once M >=
  2P - 1. Every stage holds up to 2P chunk activations, each half a
  stage's: 1F1B's peak, P. The order is fixed (``lookahead`` does not
  apply) and ``virtual_stages`` must be 2.

GPipe and 1F1B have the bubble fraction (P-1)/(M+P-1) when forward and
backward costs are equal per stage. M < P is fine: 1F1B then degenerates to
warm-up and cool-down only on the early stages.

Receives are meant to block and sends not to (buffered/posted, waited on
later). With sends that block until the peer receives, the plain 1F1B list
deadlocks — an executor must then pair a send with the following receive
(`batch_isend_irecv`), as the simulator's ``rendezvous_sends`` mode shows.
"""

from __future__ import annotations

from collections.abc import Callable

from evtrain.errors import UsageError
from evtrain.schedule_names import (
    Schedule,
    check_positive,
    check_virtual_stages,
    interleaved_rounds,
    parse_schedule,
)
from evtrain.stages.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    LoadMicrobatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
)

__all__ = [
    "backward_block",
    "build_schedule",
    "chunk_place",
    "forward_block",
    "max_in_flight",
    "model_chunk",
]


def _check_shape(stage: int, num_stages: int, num_microbatches: int) -> None:
    check_positive("num_stages", num_stages)
    check_positive("num_microbatches", num_microbatches)
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < num_stages:
        raise UsageError(f"stage must be in 0..{num_stages - 1}, got {stage!r}")


def model_chunk(schedule: str | Schedule, stage: int, num_stages: int, chunk: int) -> int:
    """The model chunk that ``stage`` holds as its local chunk ``chunk``.

    ``chunk * P + stage`` (one chunk per stage: the stage itself; interleaved:
    the ring), and for zbv the V: ``P - 1 - stage`` for chunk 0, ``P + stage``
    for chunk 1.
    """
    if parse_schedule(schedule) is Schedule.ZBV:
        return num_stages - 1 - stage if chunk == 0 else num_stages + stage
    return chunk * num_stages + stage


def chunk_place(schedule: str | Schedule, num_stages: int, chunk: int) -> tuple[int, int]:
    """``(stage, local chunk)`` holding model chunk ``chunk``: the inverse of `model_chunk`."""
    P = num_stages
    if parse_schedule(schedule) is Schedule.ZBV:
        return (P - 1 - chunk, 0) if chunk < P else (chunk - P, 1)
    return chunk % P, chunk // P


def _ends(
    kind: Schedule, stage: int, num_stages: int, chunk: int, virtual_stages: int
) -> tuple[bool, bool]:
    """Whether the stage's local chunk ``chunk`` is the model's first and its last."""
    c = model_chunk(kind, stage, num_stages, chunk)
    return c == 0, c == num_stages * virtual_stages - 1


def forward_block(
    stage: int,
    num_stages: int,
    microbatch: int,
    chunk: int = 0,
    virtual_stages: int = 1,
    *,
    schedule: str | Schedule = Schedule.ONE_F_ONE_B,
) -> list[Instruction]:
    """The instructions around microbatch `microbatch`'s forward on `stage`
    (on its local chunk `chunk` of `virtual_stages`, placed as `schedule` places
    chunks: `model_chunk`)."""
    first, last = _ends(parse_schedule(schedule), stage, num_stages, chunk, virtual_stages)
    m, v = microbatch, chunk
    block: list[Instruction] = []
    if first or last:
        block.append(LoadMicrobatch(m, v))
    if not first:
        block.append(RecvActivation(m, v))
    block.append(Forward(m, v))
    if not last:
        block.append(SendActivation(m, v))
    return block


def backward_block(
    stage: int,
    num_stages: int,
    microbatch: int,
    chunk: int = 0,
    virtual_stages: int = 1,
    *,
    split: bool = False,
    schedule: str | Schedule = Schedule.ONE_F_ONE_B,
) -> list[Instruction]:
    """The instructions around microbatch `microbatch`'s backward on `stage`
    (on its local chunk `chunk`); with ``split`` only its input half
    (`BackwardInput`), the `BackwardWeight` being placed by the schedule."""
    first, last = _ends(parse_schedule(schedule), stage, num_stages, chunk, virtual_stages)
    m, v = microbatch, chunk
    block: list[Instruction] = []
    if not last:
        block.append(RecvGrad(m, v))
    block.append(BackwardInput(m, v) if split else Backward(m, v))
    if not first:
        block.append(SendGrad(m, v))
    return block


def build_schedule(
    schedule: str | Schedule,
    stage: int,
    num_stages: int,
    num_microbatches: int,
    *,
    forward_only: bool = False,
    lookahead: int = 0,
    reduce_grads: bool = False,
    virtual_stages: int = 1,
) -> list[Instruction]:
    """The instruction list stage `stage` of `num_stages` runs for one step.

    ``virtual_stages`` (V: >= 2 for interleaved, 2 for zbv, 1 otherwise) is
    the number of model chunks each stage holds, placed as `model_chunk`
    says (see the module docstring).

    `forward_only=True` gives the evaluation program: the forward blocks in
    order 0..M-1 (the same for both schedules), with no backward and no
    `OptimizerStep`. Raises `UsageError` for an unknown schedule name, a count
    below 1 or a stage outside 0..P-1.

    `lookahead` (1F1B and zb) adds that many warm-up forwards on every stage
    but the last: ``w = min(P - stage - 1 + lookahead, M)``. With unit costs
    the makespan is unchanged, but each activation is sent one (or more)
    microbatch earlier, so the next stage's receive no longer waits for a
    gradient round trip in the steady state; the price is ``lookahead``
    more stored activations on those stages. 0 is textbook PipeDream-Flush.
    The stage runtime uses 1 (see `evtrain.stages.executor`).

    ``reduce_grads`` puts `ReduceGrads` between the last backward and the
    `OptimizerStep` (see the module docstring).
    """
    kind = parse_schedule(schedule)
    _check_shape(stage, num_stages, num_microbatches)
    if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
        raise UsageError(f"lookahead must be an integer >= 0, got {lookahead!r}")
    check_virtual_stages(kind, num_stages, num_microbatches, virtual_stages)
    P, M, V = num_stages, num_microbatches, virtual_stages

    def fwd(m: int, v: int = 0) -> list[Instruction]:
        return forward_block(stage, P, m, v, V, schedule=kind)

    def bwd(m: int, v: int = 0) -> list[Instruction]:
        return backward_block(stage, P, m, v, V, split=kind.splits_backward, schedule=kind)

    program: list[Instruction] = []
    if forward_only:
        # Chunk by chunk: each chunk's input comes from an earlier chunk, so
        # every receive has its send issued before it (no deadlock).
        for v in range(V):
            for m in range(M):
                program += fwd(m, v)
        return program

    if kind is Schedule.INTERLEAVED:
        program += _interleaved(stage, P, M, V, lookahead, fwd, bwd)
    elif kind is Schedule.ZBV:
        program += _zbv(stage, P, M, fwd, bwd)
    elif kind is Schedule.GPIPE:
        for m in range(M):
            program += fwd(m)
        for m in range(M):
            program += bwd(m)
    else:
        extra = lookahead if stage < P - 1 else 0
        warmup = min(P - stage - 1 + extra, M)
        # Zero bubble: the W of microbatch m comes after the I of m + stage.
        lag = stage
        weights = 0

        def after_backward(m: int) -> None:
            nonlocal weights
            if kind.splits_backward and m >= lag:
                program.append(BackwardWeight(weights))
                weights += 1

        for m in range(warmup):
            program += fwd(m)
        # Steady state: the forward goes first so the activation it sends
        # downstream is in flight while this stage waits for the gradient.
        for i in range(M - warmup):
            program += fwd(warmup + i)
            program += bwd(i)
            after_backward(i)
        for m in range(M - warmup, M):
            program += bwd(m)
            after_backward(m)
        if kind.splits_backward:
            program += [BackwardWeight(m) for m in range(weights, M)]
    if reduce_grads:
        program.append(ReduceGrads())
    program.append(OptimizerStep())
    return program


def _interleaved(
    stage: int,
    P: int,
    M: int,
    V: int,
    lookahead: int,
    fwd: Callable[[int, int], list[Instruction]],
    bwd: Callable[[int, int], list[Instruction]],
) -> list[Instruction]:
    """Interleaved 1F1B's order for ``stage`` (see the module docstring)."""
    per_round = M // interleaved_rounds(P, M)
    total = M * V
    warmup = _interleaved_warmup(stage, P, M, V, lookahead)
    forwards, backwards = [0] * V, [0] * V
    program: list[Instruction] = []
    for op in range(total + warmup):
        if op < total:
            v = (op // per_round) % V
            program += fwd(forwards[v], v)
            forwards[v] += 1
        if op >= warmup:
            v = V - 1 - ((op - warmup) // per_round) % V
            program += bwd(backwards[v], v)
            backwards[v] += 1
    return program


def _zbv(
    stage: int,
    P: int,
    M: int,
    fwd: Callable[[int, int], list[Instruction]],
    bwd: Callable[[int, int], list[Instruction]],
) -> list[Instruction]:
    """ZB-V's order for ``stage``: torch's ScheduleZBVZeroBubble, whose rank r is
    stage ``P - 1 - r`` here (torch puts the V's two ends on rank 0, evtrain on
    the last stage, where the loss always is)."""
    rank = P - 1 - stage
    # Planned as if there were at least 2P - 1 microbatches (what fills the
    # V); the ones beyond M are then left out, as torch does.
    n = max(2 * P - 1, M)
    order: list[tuple[str, int, int]] = []  # (F, I or W; local chunk; microbatch)
    forwards, inputs, weights = [0, 0], [0, 0], [0, 0]

    def forward(v: int) -> None:
        order.append(("F", v, forwards[v]))
        forwards[v] += 1

    def input_half(v: int) -> None:
        order.append(("I", v, inputs[v]))
        inputs[v] += 1

    def weight_half(v: int) -> None:
        order.append(("W", v, weights[v]))
        weights[v] += 1

    def backward(v: int) -> None:
        # The next I, then the oldest W still owed: the same microbatch's until
        # the cool-down defers some.
        input_half(v)
        weight_half(v)

    # Warm-up: chunk 0's forwards, then chunk 1's interleaved, then whole backwards.
    for _ in range(2 * (P - rank) - 1):
        forward(0)
    for _ in range(rank):
        forward(1)
        forward(0)
    for _ in range(P - rank):
        forward(1)
        backward(1)
    # Steady state: one forward and one backward per chunk.
    while forwards[1] < forwards[0] or forwards[0] < n:
        if forwards[0] < n:
            forward(0)
        backward(0)
        forward(1)
        backward(1)
    # Cool-down: the I's first, then the W's that fill the drain.
    for _ in range(rank):
        input_half(0)
        input_half(1)
    for _ in range(P - rank):
        backward(0)
    for v in (1, 0):
        while weights[v] < inputs[v]:
            weight_half(v)

    program: list[Instruction] = []
    for kind, v, m in order:
        if m >= M:
            continue
        if kind == "F":
            program += fwd(m, v)
        elif kind == "I":
            program += bwd(m, v)
        else:
            program.append(BackwardWeight(m, v))
    return program


def _interleaved_warmup(stage: int, P: int, M: int, V: int, lookahead: int) -> int:
    extra = lookahead if stage < P - 1 else 0
    return min((V - 1) * (M // interleaved_rounds(P, M)) + 2 * (P - 1 - stage) + extra, M * V)


def max_in_flight(
    schedule: str | Schedule,
    stage: int,
    num_stages: int,
    num_microbatches: int,
    *,
    lookahead: int = 0,
    virtual_stages: int = 1,
) -> int:
    """Theoretical peak of activations stored on `stage` (forwards whose
    backward, or `BackwardWeight`, has not run), over all its chunks:
    ``min(P - stage, M)`` for 1F1B, ``min(P, M)`` for zero bubble (both plus
    `lookahead` on every stage but the last), ``M`` for GPipe, one more than
    its warm-up forwards for interleaved: ``min((V-1)·M/r + 2(P-1-stage) + 1,
    V·M)`` with ``r = max(1, M // P)`` rounds, plus `lookahead`; for zbv,
    counted on its program (chunk activations: ``min(2P, 2M)`` once M >= 2P - 1)."""
    kind = parse_schedule(schedule)
    _check_shape(stage, num_stages, num_microbatches)
    check_virtual_stages(kind, num_stages, num_microbatches, virtual_stages)
    if kind is Schedule.ZBV:
        held = peak = 0
        for ins in build_schedule(kind, stage, num_stages, num_microbatches, virtual_stages=2):
            held += isinstance(ins, Forward) - isinstance(ins, BackwardWeight)
            peak = max(peak, held)
        return peak
    if kind is Schedule.INTERLEAVED:
        warmup = _interleaved_warmup(stage, num_stages, num_microbatches, virtual_stages, lookahead)
        return min(warmup + 1, num_microbatches * virtual_stages)
    if kind is Schedule.GPIPE:
        return num_microbatches
    extra = lookahead if stage < num_stages - 1 else 0
    held = num_stages if kind is Schedule.ZERO_BUBBLE else num_stages - stage
    return min(held + extra, num_microbatches)
