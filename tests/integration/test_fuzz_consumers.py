"""Hostile events against every consumer: the hooks, the exporters, ``evtrain events``.

Seeded random messages, each with at least one hostile field (integers far out
of range, NaN and infinities, escape sequences, wrong types, huge text), a few
valid but absurd ones (a step of 10**12, a stage or data-parallel replica the
run does not have, events of made-up runs), and garbage bytes (random, truncated msgpack, wrong
topics, wrong frame counts), interleaved with a real run's events. Every
consumer must skip or ignore the hostile ones without a traceback and count
the real ones exactly.

Made-up events never name the real run's id, and none is a valid
``run.started``: a valid ``run.started`` is how a new run begins, so a forged
one is indistinguishable from a real new run for every consumer.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import signal
import tempfile
import time
import types
import typing
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
import msgspec
import pytest
import zmq
from helpers.hook_helpers import wait_for_text
from prometheus_client.parser import text_string_to_metric_families

from evtrain.bus.address import BusAddress
from evtrain.bus.publisher import Publisher
from evtrain.events import (
    MAX_INT,
    MAX_REPLICAS,
    MAX_SECONDS,
    MAX_STAGES,
    MAX_TIMESTAMP,
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    BusGaps,
    Command,
    DecodeError,
    Heartbeat,
    HookError,
    HookStarted,
    Message,
    RunEnded,
    RunStarted,
    StageFailed,
    StageStarted,
    StepEnded,
    decode,
    encode,
)
from evtrain.exporters import EventRecorder, MetricsLog, PrometheusExporter
from evtrain.exporters.recorder import read_recording
from evtrain.hooks import ConsoleLog, EarlyStopping, EvalTrigger, LRMonitor, MemoryMonitor, Timer
from evtrain.tools.replay import ReplayRunner

REAL_RUN = "realrun00001"
STAGES = 2
STEPS = 60
MADE_UP_REPLICAS = range(2, MAX_REPLICAS)
"""Replicas no real run of these tests has (they have 1 or 2)."""

ESCAPES = (
    "\x1b[2J\x1b[H",
    "\x1b]0;owned\x07",
    "\x1b[31mred\x1b[0m",
    "cr\rover",
    "\u202eevil",
    "nul\x00byte",
    "\x9b2J",
    "del\x7f",
    "line\nbreak",
)
HUGE_INTS = (-1, -(2**63), 2**63 - 1, 2**64 - 1, MAX_INT + 1, 10**18)
ABSURD_INTS = (10**12, MAX_INT, 2**40)
BAD_FLOATS = (math.nan, math.inf, -math.inf, -1.0, 1e308, -1e308)
WRONG_TYPES: tuple[Any, ...] = (None, [], {}, "12", [1, [2, [3]]], {"a": {"b": 1}}, b"\x00\x01")


def _strip(tp: Any) -> tuple[Any, bool]:
    """The base type of an annotation and whether it carries bounds (Annotated)."""
    bounded = False
    if typing.get_origin(tp) is Annotated:
        tp, bounded = typing.get_args(tp)[0], True
    return tp, bounded


def _args(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp)


def legit_value(tp: Any, rng: random.Random) -> Any:
    """A plausible value of annotation ``tp``."""
    tp, _ = _strip(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return legit_value(next(a for a in _args(tp) if a is not type(None)), rng)
    if origin is Literal:
        return rng.choice(_args(tp))
    if origin is list:
        return [legit_value(_args(tp)[0], rng) for _ in range(2)]
    if origin is dict:
        return {"acc": rng.random()}
    if tp is bool:
        return rng.random() < 0.5
    if tp is int:
        return rng.randrange(1, STAGES)
    if tp is float:
        return rng.uniform(0.001, 1.0)
    if tp is str:
        return "text"
    raise AssertionError(f"no value for {tp!r}")


def hostile_value(tp: Any, rng: random.Random) -> Any:
    """A value of annotation ``tp`` meant to hurt: out of range, non-finite, wrong type."""
    if rng.random() < 0.15:
        return rng.choice(WRONG_TYPES)
    base, bounded = _strip(tp)
    origin = typing.get_origin(base)
    if origin in (typing.Union, types.UnionType):
        return hostile_value(next(a for a in _args(base) if a is not type(None)), rng)
    if origin is Literal:
        return rng.choice(("exploded", 7, ""))
    if origin is list:
        return [hostile_value(_args(base)[0], rng) for _ in range(rng.choice((1, 3)))]
    if origin is dict:
        return {
            rng.choice((*ESCAPES, "event", "level", "exc_info")): rng.choice(BAD_FLOATS)
            for _ in range(3)
        }
    if base is bool:
        return rng.choice((2, "yes", -1))
    if base is int:
        return rng.choice(HUGE_INTS) if bounded else rng.choice(("x", 1.5, 2**64 - 1))
    if base is float:
        if not bounded:  # loss, grad_norm, metrics: anything a float holds is valid
            return rng.choice(("NaN", [math.nan], 2**64 - 1))
        return rng.choice((*BAD_FLOATS, MAX_SECONDS * 10, MAX_TIMESTAMP * 10))
    if base is str:
        return rng.choice((*ESCAPES, 7, ["s"]))
    raise AssertionError(f"no hostile value for {tp!r}")


def _hints(cls: type[Message]) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _fields(cls: type[Message]) -> list[str]:
    return [f.name for f in msgspec.structs.fields(cls)]


def made_up_run(rng: random.Random) -> str:
    return rng.choice((*ESCAPES, "otherrun", "x" * 300))


def invalid_message(cls: type[Message], rng: random.Random) -> dict[str, Any]:
    """A msgpack-ready dict of type ``cls`` with 1-3 hostile fields (never valid)."""
    hints = _hints(cls)
    fields = _fields(cls)
    data: dict[str, Any] = {name: legit_value(hints[name], rng) for name in fields}
    data.update(type=cls.topic.decode(), v=SCHEMA_VERSION, run_id=made_up_run(rng))
    data["ts"] = time.time()
    data["seq"] = rng.randrange(0, 10)
    candidates = [n for n in fields if n not in ("v", "run_id", "source")]
    for name in rng.sample(candidates, k=min(len(candidates), rng.randint(1, 3))):
        data[name] = hostile_value(hints[name], rng)
    if cls is RunStarted:  # never a valid one (see the module's docs)
        data["num_stages"] = rng.choice((0, MAX_STAGES + 1, *HUGE_INTS))
    return data


def absurd_valid_message(rng: random.Random) -> Message:
    """A valid message that must not count: absurd numbers, made-up runs, escapes."""
    choice = rng.randrange(7)
    text = rng.choice(ESCAPES)
    if choice == 0:  # the real run's id, a step far past max_steps
        return StepEnded(step=rng.choice(ABSURD_INTS), stage=0, samples=10**9, run_id=REAL_RUN)
    if choice == 1:  # the real run's id, a stage it does not have
        return StepEnded(step=3, stage=rng.randrange(STAGES, MAX_STAGES), run_id=REAL_RUN)
    if choice == 2:  # a made-up run: NaN loss, escapes everywhere
        return StepEnded(
            step=rng.choice(ABSURD_INTS),
            stage=rng.randrange(MAX_STAGES),
            loss=math.nan,
            grad_norm=math.inf,
            lr=1e300,
            metrics={text: math.nan, "event": 1.0, "exc_info": -math.inf},
            samples=MAX_INT,
            duration_s=MAX_SECONDS,
            run_id=made_up_run(rng),
        )
    if choice == 3:
        return RunEnded(status="failed", reason=text, step=MAX_INT, run_id=made_up_run(rng))
    if choice == 5:  # the real run's id, a replica it does not have
        replica = rng.choice(MADE_UP_REPLICAS)
        return rng.choice(
            (
                StepEnded(step=3, stage=0, replica=replica, samples=10**9, run_id=REAL_RUN),
                Heartbeat(stage=1, replica=replica, run_id=REAL_RUN),
                StageFailed(stage=0, replica=replica, error=text, traceback="", run_id=REAL_RUN),
            )
        )
    if choice == 4:
        return StageStarted(
            stage=rng.randrange(MAX_STAGES),
            num_stages=MAX_STAGES,
            rank=MAX_INT,
            host=text,
            pid=MAX_INT,
            device=text,
            layers=[MAX_INT],
            num_params=MAX_INT,
            run_id=made_up_run(rng),
        )
    roll = rng.random()
    if roll < 0.3:
        return BusGaps(from_source=text, missing=MAX_INT, total_missing=MAX_INT)
    if roll < 0.6:
        return HookError(hook=text, handler=text, event_type=text, error=text, count=MAX_INT)
    if roll < 0.8:  # thousands of made-up hook names: label values must stay bounded
        return HookStarted(hooks=[f"{text}{i}" for i in range(5000)], topics=[text], pid=1)
    return StageFailed(  # 100 KB of text
        stage=0, error=text * 1000, traceback=(text + "\n") * 10_000, run_id=made_up_run(rng)
    )


def _stamp(msg: Message, rng: random.Random) -> Message:
    msg.source = rng.choice((*ESCAPES, "stage/0", "hook/x"))
    msg.seq = rng.choice((0, 1, MAX_INT, rng.randrange(MAX_INT)))
    msg.ts = rng.choice((0.0, time.time(), MAX_TIMESTAMP))
    return msg


EVENT_TYPES = [t for t in MESSAGE_TYPES if not issubclass(t, Command)]


def hostile_payloads(rng: random.Random, count: int) -> Iterator[list[bytes]]:
    """``count`` multipart messages for the broker's input: garbage and hostile events."""
    for _ in range(count):
        roll = rng.random()
        if roll < 0.55:
            cls = rng.choice(EVENT_TYPES)
            payload = msgspec.msgpack.encode(invalid_message(cls, rng))
            yield [cls.topic, payload]
        elif roll < 0.75:
            msg = _stamp(absurd_valid_message(rng), rng)
            yield [msg.topic, encode(msg)]
        elif roll < 0.85:
            cls = rng.choice(EVENT_TYPES)
            payload = msgspec.msgpack.encode(invalid_message(cls, rng))
            yield [cls.topic, payload[: rng.randrange(len(payload))]]  # truncated
        elif roll < 0.9:
            yield [rng.choice(EVENT_TYPES).topic, rng.randbytes(rng.choice((0, 1, 9, 300)))]
        elif roll < 0.95:  # a topic that is none of ours, or a wrong frame count
            yield [b"step.ended.x", b"\x80"]
        else:
            yield [rng.choice(EVENT_TYPES).topic]


# -- in-process: every built-in hook and exporter ------------------------------------------


def real_step(step: int, stage: int, replica: int = 0) -> StepEnded:
    """The step event a stage process of the real run publishes."""
    return StepEnded(
        step=step,
        stage=stage,
        replica=replica,
        loss=1.0 / step if stage == STAGES - 1 else None,
        lr=0.1,
        samples=32,
        duration_s=0.01,
        forward_s=0.003,
        backward_s=0.004,
        comm_wait_s=0.002,
        peak_memory_bytes=1 << 20,
    )


def real_run(steps: int = STEPS, replicas: int = 1) -> list[Message]:
    """A real run's events, stamped as its two stages' publishers (of each replica) would."""
    seqs: dict[tuple[str, bytes], int] = {}
    out: list[Message] = []
    now = time.time()

    def add(msg: Message, stage: int, replica: int = 0) -> None:
        msg.source = f"stage/{stage}" + (f"/{replica}" if replica else "")
        msg.run_id = REAL_RUN
        key = (msg.source, msg.topic)
        msg.seq = seqs.get(key, 0)
        seqs[key] = msg.seq + 1
        msg.ts = now + len(out) * 0.001
        out.append(msg)

    add(
        RunStarted(
            name="real",
            num_stages=STAGES,
            num_microbatches=4,
            schedule="1f1b",
            max_steps=steps,
            batch_size=32,
            data_parallel=replicas,
        ),
        0,
    )
    for step in range(1, steps + 1):
        for stage in reversed(range(STAGES)):
            for replica in range(replicas):
                add(real_step(step, stage, replica), stage, replica)
    add(RunEnded(status="completed", step=steps), 0)
    return out


def interleave(real: list[Message], rng: random.Random, hostile: int) -> list[Message]:
    """``real`` in order with ``hostile`` decodable-or-not messages between its events.

    Only what `decode` accepts reaches the hooks: that is what a subscriber hands on.
    """
    out: list[Message] = []
    frames = list(hostile_payloads(rng, hostile))
    per_event = len(frames) // len(real) + 1
    rejected = 0
    for i, msg in enumerate(real):
        if i:  # after run.started: the run is known when the first hostile one comes
            for parts in frames[(i - 1) * per_event : i * per_event]:
                if len(parts) != 2:
                    continue
                try:
                    out.append(decode(parts[1], parts[0]))
                except DecodeError:
                    rejected += 1
        out.append(msg)
    assert rejected > hostile // 2  # most of them are malformed
    return out


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="evt-fz-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("replicas", [1, 2])
def test_every_builtin_consumer_survives_hostile_events_in_process(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, replicas: int
) -> None:
    monkeypatch.chdir(workdir)  # made-up run directories are relative paths
    rng = random.Random(20250101)
    messages = interleave(real_run(replicas=replicas), rng, hostile=3000)
    log_path = workdir / "train.log"
    exporter = PrometheusExporter(port=0)
    hooks = [
        ConsoleLog(every=10, path=log_path),
        MetricsLog(dir=workdir),
        EventRecorder(dir=workdir),
        exporter,
        Timer(every=10),
        LRMonitor(),
        MemoryMonitor(threshold="1GiB"),
        EarlyStopping(patience=2),
        EvalTrigger(every=5),
    ]
    runner = ReplayRunner(hooks)
    anyio.run(runner.replay, messages)
    assert runner.errors == 0
    assert runner.dispatched == len(messages)

    value = exporter.registry.get_sample_value
    assert value("evtrain_steps_total") == STEPS
    assert value("evtrain_samples_total") == STEPS * 32
    assert value("evtrain_runs_ended_total", {"status": "completed"}) == 1
    assert value("evtrain_runs_ended_total", {"status": "failed"}) == 0
    for sample in (s for m in exporter.registry.collect() for s in m.samples):
        if sample.name.endswith("_total"):
            assert math.isfinite(sample.value) and sample.value >= 0, sample

    labels = {
        (sample.labels["stage"], sample.labels["replica"])
        for family in exporter.registry.collect()
        for sample in family.samples
        if "replica" in sample.labels
    }
    assert labels == {(str(s), str(d)) for s in range(STAGES) for d in range(replicas)}

    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["type"] == "step"] == list(range(1, STEPS + 1))
    assert all(sorted(m["stages"]) == ["0", "1"] and m["samples"] == 32 for m in metrics)
    others = [{r: sorted(s) for r, s in m.get("replicas", {}).items()} for m in metrics]
    assert others == [{"1": ["0", "1"]} if replicas == 2 else {}] * STEPS

    text = log_path.read_text()
    assert "\x1b" not in text and "\r" not in text and "\u202e" not in text
    assert "\\x1b" in text  # the escape was shown, visibly
    assert "progress" in text and f"step={STEPS}/{STEPS}" in text.replace("'", "")


# -- real processes on a real broker ---------------------------------------------------

HOOK_RSS_LIMIT_MIB = 100
"""RSS bound of each hook process at the end (measured: 33-37 MiB each)."""
PROCESS_STEPS = 150
HOSTILE_FRAMES = 4500
RAW_CONTROLS = ("\x1b", "\r", "\x07", "\u202e", "\x9b", "\x00")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(name, sorted labels) -> value of every sample of an exposition."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _decodes(frame: list[bytes]) -> bool:
    try:
        decode(frame[1], frame[0])
    except (DecodeError, IndexError):
        return False
    return True


class RawSender:
    """A bare socket on the broker's input: sends any frames, as a hostile client does."""

    def __init__(self, bus: BusAddress) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.connect(bus.endpoint("events_in"))
        assert self.sock.poll(10_000, zmq.POLLIN), "the broker never subscribed"
        self.sent = 0

    def send(self, parts: list[bytes]) -> None:
        self.sock.send_multipart(parts)
        self.sent += 1
        while self.sock.poll(0, zmq.POLLIN):
            self.sock.recv()  # what the broker passes upstream

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()


def _stage_events(pubs: list[Publisher], step: int) -> None:
    for stage in reversed(range(STAGES)):
        event = real_step(step, stage)
        event.grad_norm = math.nan if step % 50 == 0 else 1.0  # a diverging step is real
        event.metrics = {"tokens": 512.0}
        pubs[stage].publish(event)


def test_hook_processes_and_evtrain_events_survive_a_hostile_bus(
    bus: BusAddress, procs: Any, workdir: Path
) -> None:
    logs = {name: workdir / f"{name}.err" for name in ("logging", "metrics", "recorder", "prom")}
    streams = [path.open("w") for path in logs.values()]
    events_out = (workdir / "events.out").open("w")
    events_err = (workdir / "events.err").open("w")
    try:
        tail = procs.evtrain("events", "--bus", str(bus), stdout=events_out, stderr=events_err)
        hooks = {
            "logging": procs.evtrain(
                "hook", "logging", "--bus", str(bus), "-o", "every=25", stderr=streams[0]
            ),
            "metrics": procs.evtrain(
                "hook", "metrics", "--bus", str(bus), "-o", f"dir={workdir}", stderr=streams[1]
            ),
            "recorder": procs.evtrain(
                "hook", "recorder", "--bus", str(bus), "-o", f"dir={workdir}", stderr=streams[2]
            ),
            "prom": procs.evtrain(
                "hook",
                "prometheus",
                "--bus",
                str(bus),
                "-o",
                "port=0",
                "-o",
                f"dir={workdir}",
                stderr=streams[3],
            ),
        }
        for path in logs.values():
            wait_for_text(path, "hooks attached", timeout=60)
        pubs = [
            Publisher(bus.endpoint("events_in"), source=f"stage/{s}", run_id=REAL_RUN)
            for s in range(STAGES)
        ]
        # `evtrain events` prints once its subscription is live (bounded against a hang:
        # a loaded machine starts a process slowly).
        deadline = time.monotonic() + 120
        while "heartbeat" not in (workdir / "events.out").read_text():
            assert time.monotonic() < deadline, "evtrain events never printed"
            pubs[0].publish(Heartbeat(stage=0))
            time.sleep(0.1)

        raw = RawSender(bus)
        rng = random.Random(4242)
        frames = list(hostile_payloads(rng, HOSTILE_FRAMES))
        # Before a run is known any valid step may be of it: only malformed frames then.
        for frame in frames[:50]:
            if not _decodes(frame):
                raw.send(frame)
        for stage, pub in enumerate(pubs):
            pub.publish(
                StageStarted(
                    stage=stage,
                    num_stages=STAGES,
                    rank=stage,
                    host="h",
                    pid=1,
                    device="cpu",
                    layers=[stage],
                    num_params=10,
                )
            )
        pubs[0].publish(
            RunStarted(
                name="fuzzed",
                num_stages=STAGES,
                num_microbatches=4,
                schedule="1f1b",
                max_steps=PROCESS_STEPS,
                batch_size=32,
                run_dir=str(workdir),
            )
        )
        # The hostile frames come on their own connection: without waiting, some could
        # overtake run.started, and before a run is known any valid step is of it.
        port = int(wait_for_text(workdir / "prometheus.port", "\n", timeout=30))
        deadline = time.monotonic() + 120
        while "evtrain_run_running 1.0" not in _scrape(port):
            assert time.monotonic() < deadline, "the exporter never saw run.started"
            time.sleep(0.05)
        for path, text in ((logs["logging"], "run started"), (workdir / "events.out", "run.")):
            wait_for_text(path, text, timeout=30)
        wait_for_text(workdir / "events.jsonl", '"run.started"', timeout=30)
        per_step = (len(frames) - 50) // PROCESS_STEPS + 1
        scraped_mid_run = False
        for step in range(1, PROCESS_STEPS + 1):
            for frame in frames[50 + (step - 1) * per_step : 50 + step * per_step]:
                raw.send(frame)
            _stage_events(pubs, step)
            for stage, pub in enumerate(pubs):
                pub.publish(Heartbeat(stage=stage, step=step))
            time.sleep(0.004)  # a hook's pace, so the broker never drops for a slow one
            if step == PROCESS_STEPS // 2:
                assert "evtrain_run_running 1.0" in _scrape(port)
                scraped_mid_run = True
        pubs[0].publish(RunEnded(status="completed", step=PROCESS_STEPS))
        assert [pub.dropped for pub in pubs] == [0] * STAGES
        assert scraped_mid_run

        metrics_file = workdir / "metrics.jsonl"
        wait_for_text(metrics_file, f'"step":{PROCESS_STEPS},', timeout=60)
        wait_for_text(workdir / "events.jsonl", '"run.ended"', timeout=60)
        deadline = time.monotonic() + 60
        while True:
            text = _scrape(port)
            if 'evtrain_runs_ended_total{status="completed"} 1.0' in text:
                break
            assert time.monotonic() < deadline, text[-2000:]
            time.sleep(0.2)
        wait_for_text(logs["logging"], "run ended", timeout=60)
        deadline = time.monotonic() + 60
        while f"step={PROCESS_STEPS} stage=0" not in (workdir / "events.out").read_text():
            assert time.monotonic() < deadline, "evtrain events missed the last step"
            time.sleep(0.1)

        # Everyone is alive, and small.
        everyone = {**hooks, "events": tail}
        assert {name: p.poll() for name, p in everyone.items()} == dict.fromkeys(everyone)
        rss = {name: _rss_mib(p.pid) for name, p in everyone.items()}
        assert max(rss.values()) < HOOK_RSS_LIMIT_MIB, rss
        raw.close()
        for pub in pubs:
            pub.close()
        for proc in everyone.values():
            proc.send_signal(signal.SIGINT)
        # Hooks finish cleanly; `evtrain events` exits like any tool stopped by Ctrl-C.
        codes = {name: proc.wait(timeout=30) for name, proc in everyone.items()}
        assert codes == {**dict.fromkeys(hooks, 0), "events": 130}
    finally:
        for stream in (*streams, events_out, events_err):
            stream.close()

    # Prometheus counted exactly the real run; no counter took a poisoned value.
    samples = _samples(text)
    assert samples[("evtrain_steps_total", ())] == PROCESS_STEPS
    assert samples[("evtrain_samples_total", ())] == PROCESS_STEPS * 32
    assert samples[("evtrain_steps_done", ())] == PROCESS_STEPS
    assert samples[("evtrain_runs_ended_total", (("status", "failed"),))] == 0
    forward = samples[("evtrain_forward_seconds_total", (("replica", "0"), ("stage", "1")))]
    assert forward == pytest.approx(PROCESS_STEPS * 0.003)
    stages = {dict(labels)["stage"] for _, labels in samples if "stage" in dict(labels)}
    assert stages == {"0", "1"}
    replicas = {dict(labels)["replica"] for _, labels in samples if "replica" in dict(labels)}
    assert replicas == {"0"}  # made-up replicas of the real run never got a series
    for (name, labels), value in samples.items():
        if name.endswith("_total"):
            assert math.isfinite(value) and 0 <= value < 1e14, (name, labels, value)
        for label in dict(labels).values():
            assert label.isprintable(), (name, label)

    # metrics.jsonl holds every real step, each merged from both stages.
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, PROCESS_STEPS + 1))
    assert all(sorted(r["stages"]) == ["0", "1"] and r["samples"] == 32 for r in steps)
    assert steps[49]["grad_norm"] is None  # NaN in JSON: null
    assert steps[0]["loss"] == 1.0

    # The recorder has every real event once, and only valid lines.
    recorded = list(read_recording(workdir / "events.jsonl"))
    real = [
        (e.stage, e.step)
        for e in recorded
        if isinstance(e, StepEnded)
        and e.run_id == REAL_RUN
        and e.stage < STAGES
        and e.replica == 0
        and e.step <= PROCESS_STEPS
        and e.source == f"stage/{e.stage}"
    ]
    assert sorted(real) == [(s, k) for s in range(STAGES) for k in range(1, PROCESS_STEPS + 1)]

    # Terminals saw no control characters and no traceback; logs stayed small.
    outputs = {path.name: path.read_text() for path in [*logs.values(), workdir / "events.out"]}
    outputs["events.err"] = (workdir / "events.err").read_text()
    for name, content in outputs.items():
        assert "Traceback" not in content, (name, content[-3000:])
        assert not [c for c in RAW_CONTROLS if c in content], name
        assert len(content) < 2_000_000, (name, len(content))
    assert "malformed bus frames skipped" in outputs["logging.err"]
    assert f"step={PROCESS_STEPS}/{PROCESS_STEPS}" in outputs["logging.err"].replace("'", "")
    human_steps = {
        line.split("step=")[1].split()[0]
        for line in outputs["events.out"].splitlines()
        if " stage/1 " in line and "step.ended" in line and "loss=" in line
    }
    assert {str(k) for k in range(1, PROCESS_STEPS + 1)} <= human_steps


def test_evtrain_events_lines_escape_text_and_stay_strict_json() -> None:
    from evtrain.cli.events import format_human, format_json

    msg = _stamp(
        StepEnded(
            step=3,
            stage=0,
            loss=math.nan,
            grad_norm=math.inf,
            metrics={"\x1b[31m": 1.0},
            run_id="\x1b]0;t\x07",
        ),
        random.Random(1),
    )
    msg.source = "\x1b[2J\r"
    line = format_human(msg)
    assert line.isprintable() and "\\x1b[2J\\r" in line and "loss=nan" in line
    data = json.loads(format_json(msg))  # strict: no NaN token
    assert data["loss"] is None and data["grad_norm"] is None
    assert data["metrics"] == {"\x1b[31m": 1.0} and format_json(msg).isascii()
