"""The event schema: round trips, hierarchical topics, and decoding hostile bytes."""

from __future__ import annotations

import json
import math
import random
import types
import typing
from typing import Any, Literal

import msgspec
import pytest

from evtrain import events
from evtrain.events import (
    BY_TAG,
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Command,
    DecodeError,
    Event,
    Message,
    StepEnded,
    decode,
    encode,
    from_builtins,
    to_builtins,
)


def _value(tp: Any, salt: int) -> Any:
    """A non-default value of annotation ``tp`` (``salt`` varies it)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return args[salt % len(args)]
    if origin in (typing.Union, types.UnionType):
        return _value(next(a for a in args if a is not type(None)), salt)
    if origin is list:
        return [_value(args[0], salt + i) for i in range(3)]
    if origin is dict:
        return {f"k{i}": _value(args[1], salt + i) for i in range(2)}
    if tp is bool:
        return salt % 2 == 0
    if tp is int:
        return 7 + salt
    if tp is float:
        return 0.25 + salt
    if tp is str:
        return f"text-{salt}-é"
    raise AssertionError(f"no sample value for {tp!r}")


def full_instance(cls: type[Message], salt: int = 0) -> Message:
    """``cls`` with every field set, envelope included."""
    hints = typing.get_type_hints(cls)
    values = {f.name: _value(hints[f.name], salt) for f in msgspec.structs.fields(cls)}
    values["v"] = SCHEMA_VERSION
    return cls(**values)


def minimal_instance(cls: type[Message]) -> Message:
    """``cls`` with only its required fields."""
    hints = typing.get_type_hints(cls)
    return cls(
        **{f.name: _value(hints[f.name], 1) for f in msgspec.structs.fields(cls) if f.required}
    )


def test_catalogue_is_complete() -> None:
    tags = set(BY_TAG)
    for needed in (
        "run.started",
        "run.ended",
        "stage.started",
        "stage.stopped",
        "step.started",
        "step.ended",
        "microbatch.forward",
        "microbatch.backward",
        "eval.started",
        "eval.ended",
        "checkpoint.requested",
        "checkpoint.shard_saved",
        "checkpoint.committed",
        "hook.error",
        "heartbeat",
        "bus.drops",
        "cmd.checkpoint",
        "cmd.evaluate",
        "cmd.stop",
        "command.acked",
    ):
        assert needed in tags
    assert len(MESSAGE_TYPES) == len(set(MESSAGE_TYPES)) == len(BY_TAG)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_round_trip_every_message_type(cls: type[Message]) -> None:
    for msg in (full_instance(cls), full_instance(cls, salt=3), minimal_instance(cls)):
        payload = encode(msg)
        assert decode(payload) == msg
        assert decode(payload, cls.topic) == msg
        assert decode(memoryview(payload), cls.topic) == msg
        assert type(decode(payload)) is cls
        data = to_builtins(msg)
        assert data["type"] == cls.topic.decode()
        assert from_builtins(json.loads(json.dumps(data))) == msg
    # Envelope fields travel too.
    msg = full_instance(cls)
    back = decode(encode(msg))
    assert (back.run_id, back.source, back.seq, back.ts) == (
        msg.run_id,
        msg.source,
        msg.seq,
        msg.ts,
    )


def test_events_and_commands_are_separated() -> None:
    for cls in MESSAGE_TYPES:
        topic = cls.topic.decode()
        if issubclass(cls, Command):
            assert topic.startswith("cmd.")
            assert "command_id" in cls.__struct_fields__
        else:
            assert issubclass(cls, Event)
            assert not topic.startswith("cmd.")


def test_topics_are_hierarchical_and_prefix_filterable() -> None:
    topics = {cls: cls.topic.decode() for cls in MESSAGE_TYPES}
    for topic in topics.values():
        assert topic == topic.lower() and " " not in topic
        assert all(part for part in topic.split("."))
    groups = {topic.split(".")[0] for topic in topics.values()}
    assert {"run", "stage", "step", "microbatch", "eval", "checkpoint", "hook", "bus", "cmd"} <= (
        groups
    )
    assert {c.__name__ for c, t in topics.items() if t.startswith("step.")} == {
        "StepStarted",
        "StepEnded",
        "TensorRankStepEnded",
    }
    assert {c.__name__ for c, t in topics.items() if t.startswith("checkpoint.")} == {
        "CheckpointRequested",
        "CheckpointShardSaved",
        "CheckpointFailed",
        "CheckpointCommitted",
    }
    # No topic is a prefix of a different one, so a full topic selects one type.
    for a in topics.values():
        for b in topics.values():
            assert a == b or not b.startswith(a)


def _must_reject(payload: bytes, topic: bytes | None = None) -> None:
    with pytest.raises(DecodeError):
        decode(payload, topic)


def test_wrong_version_and_topic_mismatch() -> None:
    msg = full_instance(StepEnded)
    msg.v = SCHEMA_VERSION + 1
    with pytest.raises(DecodeError, match="version"):
        decode(encode(msg))
    with pytest.raises(DecodeError, match="topic"):
        decode(encode(full_instance(StepEnded)), b"step.started")
    with pytest.raises(DecodeError):
        decode(encode(full_instance(StepEnded)), b"")
    # Unknown tag, missing tag, wrong field type, missing required field.
    _must_reject(msgspec.msgpack.encode({"type": "step.unknown", "step": 1}))
    _must_reject(msgspec.msgpack.encode({"step": 1, "stage": 0}))
    _must_reject(msgspec.msgpack.encode({"type": "step.ended", "step": "one", "stage": 0}))
    _must_reject(msgspec.msgpack.encode({"type": "step.ended", "stage": 0}))
    with pytest.raises(DecodeError):
        from_builtins({"type": "step.ended", "step": [], "stage": 0})
    with pytest.raises(DecodeError):
        from_builtins("garbage")


def _outcome(payload: bytes, topic: bytes | None = None) -> Message | None:
    """Decode; only DecodeError may escape decode, and a success must be a Message."""
    try:
        msg = decode(payload, topic)
    except DecodeError:
        return None
    assert isinstance(msg, Message)
    return msg


def test_fuzz_random_bytes_raise_only_decode_error() -> None:
    rng = random.Random(20240501)
    for i in range(4000):
        size = rng.choice((0, 1, 2, 3, 8, 40, 240, 1000))
        payload = rng.randbytes(size)
        if i % 4 == 0 and payload:
            payload = bytes([0x80 | (payload[0] & 0x0F)]) + payload[1:]  # looks like a map
        _outcome(payload)
        _outcome(payload, b"step.ended")


def test_fuzz_truncated_and_mutated_payloads() -> None:
    rng = random.Random(7)
    cases = 0
    for cls in MESSAGE_TYPES:
        payload = encode(full_instance(cls))
        for cut in range(len(payload)):
            _must_reject(payload[:cut], cls.topic)
            cases += 1
        for _ in range(60):
            mutated = bytearray(payload)
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            _outcome(bytes(mutated), cls.topic)
            cases += 1
        _must_reject(payload + b"\x00", cls.topic)  # trailing bytes
    assert cases > 2000


def test_hostile_structures_raise_only_decode_error() -> None:
    deep_list = b"\x91" * 100_000 + b"\x01"  # 100k nested one-element arrays
    deep_map = b"\x81\xa1a" * 50_000 + b"\x01"
    huge_claim = b"\xdf\xff\xff\xff\xff"  # a map that claims 4 billion entries
    huge_str = b"\xdb\xff\xff\xff\xff"
    for payload in (deep_list, deep_map, huge_claim, huge_str, b"\xc1", b"\xff" * 10):
        _must_reject(payload)
    ext = msgspec.msgpack.encode(msgspec.msgpack.Ext(5, b"abc"))
    _must_reject(ext)


def test_decode_error_is_the_only_error_type() -> None:
    assert issubclass(DecodeError, ValueError)
    assert events.DecodeError is DecodeError


# -- range validation -------------------------------------------------------------------


def _step_payload(**fields: Any) -> bytes:
    data = {"type": "step.ended", "v": SCHEMA_VERSION, "step": 1, "stage": 0, **fields}
    return msgspec.msgpack.encode(data)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seq", -(2**63)),
        ("seq", 2**63 - 1),
        ("seq", 2**64 - 1),
        ("seq", events.MAX_INT + 1),
        ("step", -1),
        ("stage", -1),
        ("stage", events.MAX_STAGES),
        ("samples", -5),
        ("peak_memory_bytes", -1),
        ("ts", math.nan),
        ("ts", math.inf),
        ("ts", -1.0),
        ("ts", events.MAX_TIMESTAMP * 2),
        ("duration_s", math.inf),
        ("forward_s", math.nan),
        ("backward_s", -0.5),
        ("comm_wait_s", events.MAX_SECONDS * 2),
    ],
)
def test_out_of_range_fields_make_a_message_malformed(field: str, value: Any) -> None:
    payload = _step_payload(**{field: value})
    with pytest.raises(DecodeError) as caught:
        decode(payload, b"step.ended")
    assert caught.value.kind == f"step.ended: invalid $.{field}"
    with pytest.raises(DecodeError):
        from_builtins(msgspec.msgpack.decode(payload))


def test_non_finite_losses_and_metrics_are_valid() -> None:
    """A diverging run really reports them, and a loss guard must see them."""
    payload = _step_payload(
        loss=math.nan, grad_norm=math.inf, lr=math.nan, metrics={"ce": -math.inf, "a": math.nan}
    )
    msg = decode(payload, b"step.ended")
    assert isinstance(msg, StepEnded)
    assert math.isnan(msg.loss or 0.0) and msg.grad_norm == math.inf
    assert msg.metrics["ce"] == -math.inf
    # The largest values of each bound are still valid.
    edge = _step_payload(
        seq=events.MAX_INT,
        step=events.MAX_INT,
        stage=events.MAX_STAGES - 1,
        ts=events.MAX_TIMESTAMP,
        duration_s=events.MAX_SECONDS,
        lr=-1e300,
    )
    assert decode(edge).seq == events.MAX_INT


def test_the_kind_of_a_malformed_message_holds_no_sender_text() -> None:
    hostile = "\x1b[2J" * 50
    payload = _step_payload(metrics={hostile: "not a number"})
    with pytest.raises(DecodeError) as caught:
        decode(payload, b"step.ended")
    assert caught.value.kind == "step.ended: invalid $.metrics"
    with pytest.raises(DecodeError) as caught:
        decode(msgspec.msgpack.encode({"type": hostile, "v": 1}))
    assert caught.value.kind == "message: invalid $.type"
    assert decode_kind(b"\xc1") == "undecodable"
    wrong_version = msgspec.msgpack.encode({"type": "heartbeat", "v": 99})
    assert decode_kind(wrong_version) == "unsupported schema version"
    assert decode_kind(encode(full_instance(StepEnded)), b"heartbeat") == "topic mismatch"


def decode_kind(payload: bytes, topic: bytes | None = None) -> str:
    with pytest.raises(DecodeError) as caught:
        decode(payload, topic)
    return caught.value.kind


def test_publishers_construct_without_validation_and_decode_checks() -> None:
    """Bounds cost nothing on the publish path: they are checked where bytes arrive."""
    msg = StepEnded(step=1, stage=0, duration_s=math.inf)
    payload = encode(msg)  # the publisher's work: construct and encode
    with pytest.raises(DecodeError, match="duration_s"):
        decode(payload)


def test_a_control_wait_outside_any_microbatch_is_valid() -> None:
    """Stages publish waits at a step end with microbatch -1; below that is malformed."""
    span = {"v": SCHEMA_VERSION, "step": 3, "stage": 1, "start": 1.0, "end": 2.0, "op": "control"}
    ok = msgspec.msgpack.encode({"type": "microbatch.wait", "microbatch": -1, **span})
    assert decode(ok, b"microbatch.wait").microbatch == -1  # type: ignore[attr-defined]
    bad = msgspec.msgpack.encode({"type": "microbatch.wait", "microbatch": -2, **span})
    with pytest.raises(DecodeError):
        decode(bad, b"microbatch.wait")
