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
"""

from __future__ import annotations

import typing
from typing import Any, ClassVar, Literal

import msgspec

SCHEMA_VERSION = 1


class DecodeError(ValueError):
    """Bytes that are not a valid evtrain message (garbage, truncated, wrong version)."""


class Message(msgspec.Struct, kw_only=True, tag_field="type"):
    """Base of every event and command; holds the envelope."""

    v: int = SCHEMA_VERSION
    run_id: str = ""
    source: str = ""
    seq: int = 0
    ts: float = 0.0

    topic: ClassVar[bytes]


class Event(Message, kw_only=True):
    """Something that happened (stages -> hooks)."""


class Command(Message, kw_only=True):
    """A request a hook sends to the stages; the stages acknowledge it with `CommandAcked`.

    ``command_id`` makes retries idempotent: stages apply one id once.
    """

    command_id: str


# --- run and stage lifecycle -------------------------------------------------------


class RunStarted(Event, kw_only=True, tag="run.started"):
    """The run began (published by stage 0 once all stages joined)."""

    name: str
    num_stages: int
    num_microbatches: int
    schedule: str
    max_steps: int
    batch_size: int
    start_step: int = 0
    run_dir: str = ""


class RunEnded(Event, kw_only=True, tag="run.ended"):
    """The run finished: ``completed``, ``stopped`` (by a command or signal) or ``failed``."""

    status: Literal["completed", "stopped", "failed"]
    reason: str = ""
    step: int = 0


class StageStarted(Event, kw_only=True, tag="stage.started"):
    """A stage worker built its slice of the model and is ready to train."""

    stage: int
    num_stages: int
    rank: int
    host: str
    pid: int
    device: str
    layers: list[int]
    num_params: int


class StageStopped(Event, kw_only=True, tag="stage.stopped"):
    """A stage worker left the run normally."""

    stage: int
    status: str
    reason: str = ""


class StageFailed(Event, kw_only=True, tag="stage.failed"):
    """A stage worker raised; ``traceback`` is the formatted exception."""

    stage: int
    error: str
    traceback: str
    step: int | None = None


class Heartbeat(Event, kw_only=True, tag="heartbeat"):
    """Periodic liveness signal of a stage (or any process)."""

    stage: int | None = None
    step: int = 0
    state: str = "running"


# --- steps and microbatches ------------------------------------------------------


class StepStarted(Event, kw_only=True, tag="step.started"):
    """A stage began an optimizer step."""

    step: int
    stage: int


class StepEnded(Event, kw_only=True, tag="step.ended"):
    """A stage finished an optimizer step.

    ``loss`` is the batch loss (mean over microbatches) and is set only by the last
    stage; times are seconds; ``metrics`` holds values reported with
    `evtrain.report` during the step.
    """

    step: int
    stage: int
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    samples: int = 0
    epoch: int = 0
    duration_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_wait_s: float = 0.0
    peak_memory_bytes: int | None = None
    metrics: dict[str, float] = msgspec.field(default_factory=dict)


class MicrobatchSpan(Event, kw_only=True):
    """Base of the per-microbatch spans; ``start``/``end`` are wall-clock seconds."""

    step: int
    stage: int
    microbatch: int
    start: float
    end: float


class MicrobatchForward(MicrobatchSpan, kw_only=True, tag="microbatch.forward"):
    """One forward computation of one microbatch on one stage."""


class MicrobatchBackward(MicrobatchSpan, kw_only=True, tag="microbatch.backward"):
    """One backward computation of one microbatch on one stage."""


class MicrobatchWait(MicrobatchSpan, kw_only=True, tag="microbatch.wait"):
    """Time a stage blocked on point-to-point communication (``op``: recv_act, recv_grad...)."""

    op: str = ""


# --- evaluation ------------------------------------------------------------------


class EvalStarted(Event, kw_only=True, tag="eval.started"):
    """Evaluation began at training step ``step``."""

    step: int
    stage: int
    num_batches: int = 0


class EvalEnded(Event, kw_only=True, tag="eval.ended"):
    """Evaluation finished; ``metrics`` always include ``loss`` (last stage publishes)."""

    step: int
    stage: int
    metrics: dict[str, float]
    samples: int = 0
    duration_s: float = 0.0


# --- checkpoints -----------------------------------------------------------------


class CheckpointRequested(Event, kw_only=True, tag="checkpoint.requested"):
    """The checkpoint coordinator asked all stages to save at ``step``."""

    checkpoint_id: str
    step: int
    path: str
    reason: str = ""


class CheckpointShardSaved(Event, kw_only=True, tag="checkpoint.shard_saved"):
    """A stage's shard is durable on disk; ``blocked_s`` is training time it cost."""

    checkpoint_id: str
    step: int
    stage: int
    path: str
    bytes: int = 0
    duration_s: float = 0.0
    blocked_s: float = 0.0


class CheckpointFailed(Event, kw_only=True, tag="checkpoint.failed"):
    """A shard could not be written; the checkpoint will never be committed."""

    checkpoint_id: str
    step: int
    stage: int | None
    error: str


class CheckpointCommitted(Event, kw_only=True, tag="checkpoint.committed"):
    """Every shard was durable and the manifest was committed atomically."""

    checkpoint_id: str
    step: int
    path: str
    bytes: int = 0
    duration_s: float = 0.0
    metric: float | None = None
    reason: str = ""


# --- hooks and the bus itself --------------------------------------------------------


class HookError(Event, kw_only=True, tag="hook.error"):
    """A hook's handler raised; the hook keeps running."""

    hook: str
    handler: str
    event_type: str
    error: str
    traceback: str = ""


class HookStarted(Event, kw_only=True, tag="hook.started"):
    """A hook process subscribed and proved its subscription live (it received this event)."""

    hooks: list[str]
    topics: list[str]
    pid: int = 0


class BusDrops(Event, kw_only=True, tag="bus.drops"):
    """A publisher dropped events because its queue was full (never blocks instead)."""

    dropped: int
    total_dropped: int


class BusGaps(Event, kw_only=True, tag="bus.gaps"):
    """A subscriber saw sequence gaps from ``from_source`` (messages it never got)."""

    from_source: str
    missing: int
    total_missing: int


class CommandAcked(Event, kw_only=True, tag="command.acked"):
    """A stage applied (``ok``) or refused a command at the boundary after ``step``."""

    command_id: str
    command: str
    stage: int
    step: int
    ok: bool = True
    detail: str = ""


# --- commands (hooks -> stages) --------------------------------------------------


class CheckpointNow(Command, kw_only=True, tag="cmd.checkpoint"):
    """Save a checkpoint; ``path`` is the checkpoint directory the stages write into.

    With ``on_stop`` the stages do not save now: they keep the request armed and
    save when the run ends (stop command, signal, last step).
    """

    checkpoint_id: str
    path: str
    step: int | None = None
    reason: str = ""
    on_stop: bool = False


class EvaluateNow(Command, kw_only=True, tag="cmd.evaluate"):
    """Run evaluation at the next step boundary."""


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


def decode(payload: bytes | memoryview, topic: bytes | None = None) -> Message:
    """Parse a payload frame; with ``topic`` also check it matches the message type.

    Raises `DecodeError` for anything that is not a valid message of this schema.
    """
    try:
        msg: Message = _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DecodeError(str(exc)) from None
    except Exception as exc:  # msgspec may raise others on hostile input; keep one type
        raise DecodeError(f"{type(exc).__name__}: {exc}") from None
    if msg.v != SCHEMA_VERSION:
        raise DecodeError(f"schema version {msg.v} is not supported (expected {SCHEMA_VERSION})")
    if topic is not None and bytes(topic) != msg.topic:
        raise DecodeError(f"topic {bytes(topic)!r} does not match message type {msg.topic!r}")
    return msg


def to_builtins(msg: Message) -> dict[str, Any]:
    """A JSON-ready dict of a message, including its ``type`` tag."""
    return msgspec.to_builtins(msg)  # type: ignore[no-any-return]


def from_builtins(data: Any) -> Message:
    """Inverse of `to_builtins` (used by the event recorder and replay)."""
    try:
        msg: Message = msgspec.convert(data, AnyMessage)
    except (msgspec.ValidationError, TypeError) as exc:
        raise DecodeError(str(exc)) from None
    return msg
