"""The event and command schema of the evtrain bus.

Every message on the bus is one msgspec Struct from the tagged union `Message`:
events that stages and hooks publish (stages -> hooks) and commands that hooks
send (hooks -> stages). A message travels as two ZeroMQ frames, ``[topic,
payload]``: the topic is the type's tag (``step.ended``, ``checkpoint.committed``,
``cmd.stop``...), hierarchical by dots so that a subscriber filters by prefix
(``step.`` gets every step event), and the payload is msgpack.

Every message carries the envelope fields: schema version ``v``, ``run_id``,
``source`` (``stage/2``, ``hook/checkpoint``...), a sequence number ``seq``
counted per source and topic (subscribers detect lost messages from gaps, also
when they filter by topic) and a wall-clock ``ts``.
The publisher stamps them; constructors only fill in the payload fields.

`decode` is the only way bytes become messages, and it raises `DecodeError` and
nothing else for bytes that are not a valid message of this schema version.

Valid means in range, too. msgspec checks these bounds when it decodes (never
when a message is constructed, so publishing costs nothing extra); a value
outside them makes the whole message malformed:

* integers (sequence numbers, steps, counts, sizes, pids) lie in
  ``0..MAX_INT``: exact as floats, so JSON readers and Prometheus see them
  unchanged, and the sum of two never overflows an int64;
* stage indices lie in ``0..MAX_STAGES-1``, ``num_stages`` in
  ``1..MAX_STAGES``; ``num_microbatches`` is at least 1; a span's
  ``microbatch`` is -1 for a wait outside any microbatch;
* durations (``*_s``) are finite seconds in ``0..MAX_SECONDS``;
* wall-clock times (``ts``, span ``start``/``end``) are finite seconds since
  the epoch in ``0..MAX_TIMESTAMP``;
* ``loss``, ``grad_norm``, ``lr``, reported and eval metric values and a
  checkpoint's ``metric`` may be anything a float holds, NaN and infinities
  included: a diverging run really produces them, a loss guard must see them,
  and the step they belong to still happened.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

import msgspec

SCHEMA_VERSION = 1

MAX_INT = 2**53 - 1
"""Largest value of any integer field."""
MAX_STAGES = 1024
"""More pipeline stages than any model is split into."""
MAX_REPLICAS = 1024
"""More data-parallel replicas of one pipeline than any run has."""
MAX_TENSOR_RANKS = 1024
"""More tensor-parallel ranks of one stage replica than any run has."""
MAX_SECONDS = 1_000_000.0
"""Longest duration a field may hold (11.6 days: no step, save or evaluation takes that)."""
MAX_TIMESTAMP = 16_725_225_600.0
"""Latest wall-clock time a field may hold (2500-01-01 UTC)."""

Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
StageIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_STAGES)]
NumStages = Annotated[int, msgspec.Meta(ge=1, le=MAX_STAGES)]
ReplicaIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_REPLICAS)]
"""A stage's data-parallel replica (0 without data parallelism)."""
NumReplicas = Annotated[int, msgspec.Meta(ge=1, le=MAX_REPLICAS)]
TensorRankIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TENSOR_RANKS)]
"""A stage replica's tensor-parallel rank (0 without tensor parallelism)."""
NumTensorRanks = Annotated[int, msgspec.Meta(ge=1, le=MAX_TENSOR_RANKS)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]
Timestamp = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TIMESTAMP)]


class DecodeError(ValueError):
    """Bytes that are not a valid evtrain message (garbage, truncated, wrong version).

    ``kind`` names the problem without the offending values (``"undecodable"``,
    ``"step.ended: invalid $.duration_s"``...), so consumers count and log
    malformed input per kind: a bounded set, whatever an attacker sends.
    """

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind


class Message(msgspec.Struct, kw_only=True, tag_field="type"):
    """Base of every event and command; holds the envelope."""

    v: int = SCHEMA_VERSION
    run_id: str = ""
    source: str = ""
    seq: Count = 0
    ts: Timestamp = 0.0

    topic: ClassVar[bytes]


class Event(Message, kw_only=True):
    """Something that happened (stages -> hooks)."""


class Command(Message, kw_only=True):
    """A request a hook sends to the stages (delivery, boundaries, acks: `evtrain.bus.commands`).

    ``command_id`` makes retries idempotent: stages apply one id once.
    ``at_step`` names the boundary to apply at (steps completed there); None
    means the next boundary the stages reach.
    """

    command_id: str
    at_step: Count | None = None


# --- run and stage lifecycle -------------------------------------------------------


class RunStarted(Event, kw_only=True, tag="run.started"):
    """The run began (published by stage 0 once all stages joined)."""

    name: str
    num_stages: NumStages
    num_microbatches: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)]
    schedule: str
    max_steps: Count
    batch_size: Count
    start_step: Count = 0
    run_dir: str = ""
    data_parallel: NumReplicas = 1
    """Replicas D of the pipeline; every stage runs on D processes."""
    virtual_stages: Annotated[int, msgspec.Meta(ge=1, le=MAX_STAGES)] = 1
    """Model chunks V per stage (interleaved and zbv; 1 otherwise)."""
    tensor_parallel: NumTensorRanks = 1
    """Tensor ranks T of every stage replica: each one runs on T processes."""


class RunEnded(Event, kw_only=True, tag="run.ended"):
    """The run finished: ``completed``, ``stopped`` (by a command or signal) or ``failed``."""

    status: Literal["completed", "stopped", "failed"]
    reason: str = ""
    step: Count = 0
    root_cause: str = ""
    """For a failed run: the first stage that failed and why (set by the launcher)."""


class StageStarted(Event, kw_only=True, tag="stage.started"):
    """A stage worker built its slice of the model and is ready to train."""

    stage: StageIndex
    replica: ReplicaIndex = 0
    num_stages: NumStages
    rank: Count
    host: str
    pid: Count
    device: str
    layers: list[Count]
    num_params: Count


class StageStopped(Event, kw_only=True, tag="stage.stopped"):
    """A stage worker left the run normally."""

    stage: StageIndex
    replica: ReplicaIndex = 0
    status: str
    reason: str = ""


class StageFailed(Event, kw_only=True, tag="stage.failed"):
    """A stage worker raised; ``traceback`` is the formatted exception."""

    stage: StageIndex
    replica: ReplicaIndex = 0
    error: str
    traceback: str
    step: Count | None = None


class HangReported(Event, kw_only=True, tag="run.hung"):
    """No stage made progress for the hang timeout (`evtrain.launcher.hang`).

    ``stage``/``replica`` is the one holding the others up, in ``doing``
    (empty: between steps) during step ``step``; ``location`` is the innermost
    frame of user code in its stack, if any. ``summary`` is the report's
    short form (a line per stage); ``report`` the file with every stack.
    The run ends after it, or elastic restarts the workers (``restarting``).
    """

    step: Count
    stage: StageIndex
    replica: ReplicaIndex = 0
    doing: Annotated[str, msgspec.Meta(max_length=200)] = ""
    location: str = ""
    summary: str
    report: str = ""
    restarting: bool = False


class StragglerReported(Event, kw_only=True, tag="run.straggler"):
    """A stage (``whole_stage``), one replica of it, or one tensor rank of a replica
    (``tp`` set) became a straggler at ``step``, or stopped being one (``straggling``
    false) (`evtrain.launcher.stragglers`).

    ``slowdown``: how many times slower than expected it is over the recent
    steps: for a replica, its work (forward time; CPU time on the CPU)
    against its stage's other replicas'; for a tensor rank, its CPU time
    against its replica's other tensor ranks'; for a stage, its busy time's
    ratio to the other stages' against the ratio it had at the start.
    """

    step: Count
    stage: StageIndex
    replica: ReplicaIndex = 0
    whole_stage: bool = False
    tp: TensorRankIndex | None = None
    """The tensor rank named alone; None names every tensor rank of the replica (or stage)."""
    slowdown: Annotated[float, msgspec.Meta(ge=0)]
    straggling: bool = True

    def replicas(self, data_parallel: int) -> list[int]:
        """The replicas it names: every one of the stage's for a whole stage."""
        return list(range(data_parallel)) if self.whole_stage else [self.replica]

    @property
    def tensor_rank(self) -> int | None:
        """The tensor rank it names alone; None for a whole stage or replica."""
        return None if self.whole_stage else self.tp

    def describe(self) -> str:
        """One line: ``"stage 1 is a straggler from step 20: ..."``."""
        who = f"stage {self.stage}" + ("" if self.whole_stage else f" replica {self.replica}")
        if self.tensor_rank is not None:
            who += f" tensor rank {self.tensor_rank}"
        if not self.straggling:
            return f"{who} is no straggler any more (step {self.step})"
        times = f"{self.slowdown:.1f} times as long as"
        if self.whole_stage:
            how = f"relative to the other stages, its steps take {times} at the start"
        elif self.tp is not None:
            how = f"its work takes {times} its replica's other tensor ranks'"
        else:
            how = f"its work takes {times} its stage's other replicas'"
        return f"{who} is a straggler from step {self.step}: {how}"


DOING_KINDS = frozenset(
    {
        # the instructions of a schedule (`evtrain.stages.instructions`)
        "LoadMicrobatch",
        "RecvActivation",
        "Forward",
        "SendActivation",
        "RecvGrad",
        "Backward",
        "BackwardInput",
        "BackwardWeight",
        "SendGrad",
        "ReduceGrads",
        "OptimizerStep",
        # the rest of a step: reading its batch, agreeing the batch's shapes
        "LoadBatch",
        "AgreeShapes",
        # phases between steps, with the instruction inside them if any
        "Evaluate",
        "SaveCheckpoint",
        "Boundary",
        "AwaitPlan",
        "AwaitVerdicts",
    }
)
"""The words a `Heartbeat.doing` begins with."""


def doing_kind(doing: str) -> str:
    """The innermost kind in a `Heartbeat.doing` (``"Evaluate step 4: Forward m2"``:
    ``"Forward"``): one of `DOING_KINDS`, ``"idle"`` for an empty one, else ``"other"``."""
    if not doing:
        return "idle"
    kind = doing.rsplit(": ", 1)[-1].split(" ", 1)[0]
    return kind if kind in DOING_KINDS else "other"


class Heartbeat(Event, kw_only=True, tag="heartbeat"):
    """Periodic liveness signal of a stage (or any process).

    A stage says where it is: ``doing`` is the instruction it executes or
    waits in (``"RecvActivation m5 from stage 1"``, ``"Forward m5"``,
    ``"OptimizerStep"``), or the phase between steps with the instruction
    inside it (``"Evaluate step 40: Forward m3"``, ``"SaveCheckpoint step
    40"``); empty between steps. It begins with one of `DOING_KINDS`
    (`doing_kind`) and has lasted ``doing_s`` seconds so far.
    """

    stage: StageIndex | None = None
    replica: ReplicaIndex = 0
    step: Count = 0
    state: str = "running"
    doing: Annotated[str, msgspec.Meta(max_length=200)] = ""
    doing_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


# --- steps and microbatches ------------------------------------------------------


class StepStarted(Event, kw_only=True, tag="step.started"):
    """A stage began an optimizer step."""

    step: Count
    stage: StageIndex
    replica: ReplicaIndex = 0


class StepEnded(Event, kw_only=True, tag="step.ended"):
    """A stage finished an optimizer step.

    ``loss`` is the batch loss (mean over microbatches) and is set only by the last
    stage; times are seconds; ``metrics`` holds values reported with
    `evtrain.report` during the step.
    """

    step: Count
    stage: StageIndex
    replica: ReplicaIndex = 0
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    samples: Count = 0
    epoch: Count = 0
    duration_s: Seconds = 0.0
    forward_s: Seconds = 0.0
    backward_s: Seconds = 0.0
    comm_wait_s: Seconds = 0.0
    cpu_s: Seconds = 0.0
    """On a CPU device: CPU seconds of the thread that ran the step, the stage's own work
    (0 on other devices)."""
    peak_memory_bytes: Count | None = None
    state_bytes: Count | None = None
    """Bytes of the parameters and optimizer state this process holds between steps:
    its shards under `evtrain.job.Job.shard`."""
    metrics: dict[str, float] = msgspec.field(default_factory=dict)


class TensorRankStepEnded(Event, kw_only=True, tag="step.tensor_rank"):
    """Tensor rank ``tp`` (> 0) of a stage replica finished an optimizer step: the times
    and memory of its own process.

    Tensor rank 0 publishes the replica's `StepEnded`; the others compute the same
    loss, norm and step, and publish only what differs between the processes.
    The fields mean what `StepEnded`'s of the same names do.
    """

    step: Count
    stage: StageIndex
    replica: ReplicaIndex = 0
    tp: Annotated[int, msgspec.Meta(ge=1, lt=MAX_TENSOR_RANKS)]
    duration_s: Seconds = 0.0
    forward_s: Seconds = 0.0
    backward_s: Seconds = 0.0
    comm_wait_s: Seconds = 0.0
    cpu_s: Seconds = 0.0
    peak_memory_bytes: Count | None = None
    state_bytes: Count | None = None


SPAN_MODES: tuple[str, ...] = ("all", "sampled", "off")
"""Which steps publish microbatch spans (`evtrain.job.Job.microbatch_spans`)."""


class MicrobatchSpan(Event, kw_only=True):
    """Base of the per-microbatch spans; ``start``/``end`` are wall-clock seconds."""

    step: Count
    stage: StageIndex
    replica: ReplicaIndex = 0
    microbatch: Annotated[int, msgspec.Meta(ge=-1, le=MAX_INT)]
    """The microbatch, or -1 for a wait outside any microbatch (control at a step end)."""
    start: Timestamp
    end: Timestamp
    chunk: Annotated[int, msgspec.Meta(ge=0, lt=MAX_STAGES)] = 0
    """The stage's local model chunk (interleaved and zbv) the span is for."""


class MicrobatchForward(MicrobatchSpan, kw_only=True, tag="microbatch.forward"):
    """One forward computation of one microbatch on one stage."""


class MicrobatchBackward(MicrobatchSpan, kw_only=True, tag="microbatch.backward"):
    """One backward computation of one microbatch on one stage."""

    part: Literal["", "input", "weight"] = ""
    """A zero-bubble schedule's split backward: its ``input`` half (I) or its
    ``weight`` half (W); empty for a whole backward."""


class MicrobatchWait(MicrobatchSpan, kw_only=True, tag="microbatch.wait"):
    """Time a stage blocked on point-to-point communication (``op``: recv_act, recv_grad...)."""

    op: str = ""


# --- evaluation ------------------------------------------------------------------


class EvalStarted(Event, kw_only=True, tag="eval.started"):
    """Evaluation began at training step ``step``; ``num_batches`` over all its sets (with
    data parallelism, replica 0's share: the replicas evaluate side by side)."""

    step: Count
    stage: StageIndex
    num_batches: Count = 0


class EvalProgress(Event, kw_only=True, tag="eval.progress"):
    """An evaluation in progress: ``batches_done`` of ``num_batches`` (over all its sets),
    now in set ``set`` (``""``: the single unnamed set).

    The last stage publishes it with its heartbeats, about once a second while
    it evaluates, so a long evaluation shows progress and a short one costs nothing.
    """

    step: Count
    stage: StageIndex
    batches_done: Count
    num_batches: Count
    set: str = ""


class EvalEnded(Event, kw_only=True, tag="eval.ended"):
    """Evaluation finished; ``metrics`` always include ``loss`` (last stage publishes).

    With named evaluation sets every name is prefixed by its set (``val/loss``,
    ``test/accuracy``) and ``sets`` gives each set's samples by name; a single
    unnamed set has plain names and no ``sets``. ``samples`` counts all sets.
    """

    step: Count
    stage: StageIndex
    metrics: dict[str, float]
    samples: Count = 0
    duration_s: Seconds = 0.0
    sets: dict[str, Count] = {}


class EpochEnded(Event, kw_only=True, tag="epoch.ended"):
    """Training finished the last batch of ``epoch`` (from 0) within ``step`` (stage 0).

    ``step`` is the boundary right after it, where an epoch-end evaluation or
    checkpoint applies.
    """

    epoch: Count
    step: Count


# --- checkpoints -----------------------------------------------------------------


class CheckpointRequested(Event, kw_only=True, tag="checkpoint.requested"):
    """The stages began saving checkpoint ``checkpoint_id`` of ``step`` (stage 0 publishes it).

    ``metric`` is the evaluated value a best checkpoint was taken for;
    ``fulfils`` lists other requested checkpoint ids this one stands for (two
    requests that land on one boundary share one checkpoint).
    """

    checkpoint_id: str
    step: Count
    path: str
    reason: str = ""
    metric: float | None = None
    fulfils: list[str] = msgspec.field(default_factory=list)


class CheckpointShardSaved(Event, kw_only=True, tag="checkpoint.shard_saved"):
    """A stage's shard is durable on disk; ``blocked_s`` is training time it cost."""

    checkpoint_id: str
    step: Count
    stage: StageIndex
    path: str
    bytes: Count = 0
    duration_s: Seconds = 0.0
    blocked_s: Seconds = 0.0


class CheckpointFailed(Event, kw_only=True, tag="checkpoint.failed"):
    """A shard could not be written; the checkpoint will never be committed."""

    checkpoint_id: str
    step: Count
    stage: StageIndex | None
    error: str


class CheckpointCommitted(Event, kw_only=True, tag="checkpoint.committed"):
    """Every shard was durable and the manifest was committed atomically."""

    checkpoint_id: str
    step: Count
    path: str
    bytes: Count = 0
    duration_s: Seconds = 0.0
    metric: float | None = None
    reason: str = ""


# --- hooks and the bus itself --------------------------------------------------------


class HookError(Event, kw_only=True, tag="hook.error"):
    """A hook's handler raised; the hook keeps running.

    ``count`` is how many raises this event stands for: a handler that keeps
    raising is reported in full a few times, then in batches (see
    `evtrain.hooks.runner`).
    """

    hook: str
    handler: str
    event_type: str
    error: str
    traceback: str = ""
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)] = 1


class HookProbe(Event, kw_only=True, tag="hook.probe"):
    """Sent by a starting hook process until one comes back to it through the broker.

    A probe that arrives anywhere proves nothing about the sender's own
    subscription (it travels on another connection); `HookStarted` follows the
    first probe the sender itself received.
    """

    pid: Count = 0


class HookStarted(Event, kw_only=True, tag="hook.started"):
    """A hook process's subscription is live: published once, after its own `HookProbe` returned.

    Everything published after this event arrived reaches the process's hooks.
    """

    hooks: list[str]
    topics: list[str]
    pid: Count = 0


class BusDrops(Event, kw_only=True, tag="bus.drops"):
    """A publisher dropped events because its queue was full (never blocks instead)."""

    dropped: Count
    total_dropped: Count


class BusGaps(Event, kw_only=True, tag="bus.gaps"):
    """A subscriber saw sequence gaps from ``from_source`` (messages it never got)."""

    from_source: str
    missing: Count
    total_missing: Count


class CommandAcked(Event, kw_only=True, tag="command.acked"):
    """A stage accepted (``ok``) or refused a command; it applies at boundary ``step``.

    ``late``: the command named an earlier boundary, which had passed when it
    arrived; it applies at ``step`` instead (see `evtrain.bus.commands`).
    """

    command_id: str
    command: str
    stage: StageIndex
    step: Count
    ok: bool = True
    detail: str = ""
    late: bool = False


# --- commands (hooks -> stages) --------------------------------------------------


class CheckpointNow(Command, kw_only=True, tag="cmd.checkpoint"):
    """Save one checkpoint at the command's boundary into ``path``.

    ``path`` may hold a ``{step}`` placeholder (``.../step-{step:08d}``).
    """

    checkpoint_id: str
    path: str
    reason: str = ""


class CheckpointPlan(Command, kw_only=True, tag="cmd.plan_checkpoints"):
    """Standing checkpoint orders the stages carry out themselves, exactly on their boundaries.

    It replaces any earlier plan. The stages save into ``path`` (with a
    ``{step}`` placeholder) at every boundary that is a multiple of
    ``every_steps``; after every evaluation whose ``best_metric`` beats
    ``best`` (and every better one since) in direction ``mode``; and with
    ``on_stop`` once when the run ends without failure. One boundary saves at
    most one checkpoint, whatever number of reasons it has. The protocol is in
    `evtrain.checkpoint`.
    """

    path: str
    every_steps: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)] | None = None
    best_metric: str | None = None
    mode: Literal["min", "max"] = "min"
    best: float | None = None
    on_stop: bool = False


class EvaluateNow(Command, kw_only=True, tag="cmd.evaluate"):
    """Evaluate at the command's boundary; with ``every``/``every_epochs``, also from then on.

    ``every``: at every boundary that is a multiple of it; ``every_epochs``: at
    the boundary after every ``every_epochs``-th epoch ends (`EpochEnded`).
    """

    every: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)] | None = None
    every_epochs: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)] | None = None


class StopRun(Command, kw_only=True, tag="cmd.stop"):
    """End the run cleanly at the next step boundary; ``reason`` ends up in `RunEnded`."""

    reason: str = ""


def _subclasses(cls: type[Message]) -> list[type[Message]]:
    found: list[type[Message]] = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_subclasses(sub))
    return found


# msgspec tags an untagged subclass with its class name; the bases above are those.
MESSAGE_TYPES: tuple[type[Message], ...] = tuple(
    t for t in dict.fromkeys(_subclasses(Message)) if t.__struct_config__.tag != t.__name__
)
"""Every concrete message type, in definition order."""

BY_TAG: dict[str, type[Message]] = {str(t.__struct_config__.tag): t for t in MESSAGE_TYPES}
for _tag, _type in BY_TAG.items():
    _type.topic = _tag.encode()

AnyMessage = typing.Union[MESSAGE_TYPES]  # type: ignore[valid-type]  # noqa: UP007

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)


def encode(msg: Message) -> bytes:
    """Serialize a message to msgpack bytes (the payload frame)."""
    return _encoder.encode(msg)


decode_unchecked: Callable[[bytes], Message] = _decoder.decode
"""The schema's decoder without `decode`'s version and topic checks, for a loop that
makes them itself and hands what fails to `decode` for the error
(`evtrain.bus.subscriber`: one Python call less per message)."""


def decode(payload: bytes | memoryview, topic: bytes | None = None) -> Message:
    """Parse a payload frame; with ``topic`` also check it matches the message type.

    Raises `DecodeError` for anything that is not a valid message of this schema.
    """
    try:
        msg: Message = _decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise DecodeError(str(exc), _invalid_kind(topic, exc)) from None
    except msgspec.DecodeError as exc:
        raise DecodeError(str(exc), "undecodable") from None
    except Exception as exc:  # msgspec may raise others on hostile input; keep one type
        raise DecodeError(f"{type(exc).__name__}: {exc}", "undecodable") from None
    return _checked(msg, topic)


def _checked(msg: Message, topic: bytes | None) -> Message:
    if msg.v != SCHEMA_VERSION:
        raise DecodeError(
            f"schema version {msg.v} is not supported (expected {SCHEMA_VERSION})",
            "unsupported schema version",
        )
    if topic is not None and bytes(topic) != msg.topic:
        raise DecodeError(
            f"topic {bytes(topic)!r} does not match message type {msg.topic!r}", "topic mismatch"
        )
    return msg


# msgspec ends a validation error with the path of the bad value: " - at `$.metrics[...]`".
_ERROR_PATH = re.compile(r" - at `(\$[^`\[]*)")


def _invalid_kind(topic: bytes | memoryview | None, exc: Exception) -> str:
    # Subscripts (dict keys, list indices) are cut off: they come from the sender.
    match = _ERROR_PATH.search(str(exc))
    where = f" {match.group(1)}" if match else ""
    name = bytes(topic).decode("ascii", "replace") if topic is not None else ""
    return f"{name if name in BY_TAG else 'message'}: invalid{where}"


def to_builtins(msg: Message) -> dict[str, Any]:
    """A JSON-ready dict of a message, including its ``type`` tag."""
    return msgspec.to_builtins(msg)


def from_builtins(data: Any) -> Message:
    """Inverse of `to_builtins` (used by the event recorder and replay).

    Checks what `decode` checks; raises `DecodeError` and nothing else.
    """
    try:
        msg: Message = msgspec.convert(data, AnyMessage)
    except msgspec.ValidationError as exc:
        tag = data.get("type") if isinstance(data, dict) else None
        topic = tag.encode("utf-8", "replace") if isinstance(tag, str) else None
        raise DecodeError(str(exc), _invalid_kind(topic, exc)) from None
    except Exception as exc:  # as in decode: one error type whatever the input
        raise DecodeError(f"{type(exc).__name__}: {exc}", "undecodable") from None
    return _checked(msg, None)
