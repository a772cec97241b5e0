"""Exporters against a real broker and a real publisher process (tests/fake_run.py):
metrics log, event recorder, replay, TensorBoard, Prometheus exposition (+ promtool)."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from helpers.hook_helpers import fake_args, loss_at, run_hooks, wait_for_text
from prometheus_client import generate_latest

from evtrain import events
from evtrain.bus.address import BusAddress
from evtrain.errors import UsageError
from evtrain.events import (
    BusGaps,
    DecodeError,
    Heartbeat,
    HookError,
    HookStarted,
    Message,
    RunEnded,
    RunStarted,
    StageFailed,
    StepEnded,
    decode,
    encode,
    from_builtins,
)
from evtrain.exporters import EventRecorder, MetricsLog, PrometheusExporter
from evtrain.exporters.prometheus import _StageLiveness
from evtrain.hooks.registry import build_hook

PROMTOOL = shutil.which("promtool")


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="evt-exp-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def at(stage: int | str, replica: int = 0) -> dict[str, str]:
    """The labels of a per-stage series of the stage process (``stage``, ``replica``)."""
    return {"stage": str(stage), "replica": str(replica)}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _replay_metrics(run_dir: Path) -> subprocess.CompletedProcess[str]:
    """``evtrain replay RUN_DIR --hook metrics``, which must write the run's metrics.jsonl."""
    replay = subprocess.run(
        [sys.executable, "-m", "evtrain", "replay", str(run_dir), "--hook", "metrics"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert replay.returncode == 0, replay.stderr
    replayed = run_dir / "replay" / "metrics.jsonl"
    assert replayed.read_text() == (run_dir / "metrics.jsonl").read_text()
    return replay


# -- metrics log, recorder, replay -------------------------------------------------------


@pytest.mark.anyio
async def test_metrics_log_and_recorder_then_replay_reproduces_them(
    bus: BusAddress, procs: Any, workdir: Path
) -> None:
    run_dir = workdir / "run"
    await run_hooks(
        [EventRecorder(), MetricsLog()],
        bus,
        procs,
        steps=30,
        stages=3,
        eval_every=10,
        run_dir=run_dir,
    )
    metrics = _lines(run_dir / "metrics.jsonl")
    steps = [m for m in metrics if m["type"] == "step"]
    evals = [m for m in metrics if m["type"] == "eval"]
    assert [m["step"] for m in steps] == list(range(1, 31))
    assert [m["step"] for m in evals] == [10, 20, 30]
    first = steps[0]
    assert first["loss"] == pytest.approx(loss_at(1))
    assert first["lr"] == pytest.approx(0.1)
    assert first["samples"] == 32 and first["tokens"] == 512.0
    assert sorted(first["stages"]) == ["0", "1", "2"]
    stage2 = first["stages"]["2"]
    assert stage2["forward_s"] == pytest.approx(0.3 * stage2["duration_s"])
    assert stage2["peak_memory_bytes"] == 200 * 1024 * 1024 + 1024
    assert first["step_time_s"] == max(s["duration_s"] for s in first["stages"].values())
    assert evals[0]["metrics"] == {"loss": 1.0, "accuracy": 0.9}

    events = [from_builtins(e) for e in _lines(run_dir / "events.jsonl")]
    assert sum(isinstance(e, StepEnded) for e in events) == 90
    # Its own process's announcement comes first, then the stages, which announce
    # themselves before run.started: the recorder kept them.
    assert events[0].topic == b"hook.started" and events[0].source == "hook/recorder+metrics"
    assert events[1].topic == b"stage.started"
    assert not any(e.topic == b"hook.probe" for e in events)  # start-up plumbing, not the run
    assert any(isinstance(e, RunStarted) for e in events)
    assert events[-1].topic == b"run.ended"  # the runner exits on run end

    # Offline: the same events through the metrics hook write the same lines.
    replay = _replay_metrics(run_dir)
    assert f"replayed {len(events)} events through metrics: 0 handler errors" in replay.stdout

    # An acting hook replays too; its commands are shown, not sent.
    stopper = subprocess.run(
        [
            sys.executable,
            "-m",
            "evtrain",
            "replay",
            str(run_dir / "events.jsonl"),
            "--hook",
            "early_stopping",
            "-o",
            "patience=1",
            "--out",
            str(workdir / "elsewhere"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stopper.returncode == 0, stopper.stderr
    assert "command (not sent): cmd.stop" in stopper.stdout
    assert "early stopping: val loss did not improve for 1 evals" in stopper.stdout


def test_replay_reports_a_missing_recording(workdir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "evtrain", "replay", str(workdir), "--hook", "metrics"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "no recorded events at" in out.stderr and "recorder" in out.stderr


def test_recorder_flushes_while_the_run_goes_on(bus: BusAddress, procs: Any, workdir: Path) -> None:
    """A recorder killed mid-run (no teardown) has still written what it received."""
    err = workdir / "recorder.err"
    with err.open("w") as stream:
        recorder = procs.evtrain(
            "hook",
            "recorder",
            "--bus",
            str(bus),
            "-o",
            f"dir={workdir}",
            "-o",
            "flush_interval=0.2",
            stderr=stream,
        )
        wait_for_text(err, "hooks attached")
        resume = workdir / "resume"
        procs.start(*fake_args(bus, steps=20, pause_at=10, pause_until=resume))
        events = workdir / "events.jsonl"

        def ended() -> list[tuple[int, int]]:
            lines = events.read_text().splitlines() if events.exists() else []
            records = [json.loads(line) for line in lines if line.endswith("}")]
            return [(e["step"], e["stage"]) for e in records if e["type"] == "step.ended"]

        # Written during the pause: a heartbeat or two trigger the timed flush.
        deadline = time.monotonic() + 60
        while len(ended()) < 18:
            assert time.monotonic() < deadline, ended()
            time.sleep(0.05)
        os.kill(recorder.pid, signal.SIGKILL)
        recorder.wait(timeout=5)
        resume.touch()
    content = events.read_text()
    # Steps 1-9 of both stages, nothing lost to buffering.
    assert sorted(ended()) == [(step, stage) for step in range(1, 10) for stage in (0, 1)]
    assert content.endswith("\n")


# -- TensorBoard ---------------------------------------------------------------------


def test_tensorboard_without_the_package_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As if it were not installed: a None in sys.modules makes the import fail.
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(UsageError, match=r"pip install 'evtrain\[tensorboard\]'"):
        build_hook("tensorboard")


@pytest.mark.anyio
async def test_tensorboard_scalars(bus: BusAddress, procs: Any, workdir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from evtrain.exporters import TensorBoardWriter

    logdir = workdir / "tb"
    await run_hooks([TensorBoardWriter(dir=logdir)], bus, procs, steps=12, eval_every=6)
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 13))
    assert loss[0].value == pytest.approx(loss_at(1), rel=1e-6)
    assert [e.step for e in acc.Scalars("eval/loss")] == [6, 12]
    assert len(acc.Scalars("stage1/comm_wait_s")) == 12


class _Scalars:
    """Stands in for TensorBoard's SummaryWriter: keeps every scalar, by tag."""

    written: dict[str, list[tuple[int, float]]] = {}

    def __init__(self, log_dir: str, flush_secs: int) -> None:
        type(self).written = {}

    def add_scalar(self, tag: str, value: float, step: int, walltime: float | None) -> None:
        self.written.setdefault(tag, []).append((step, value))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.anyio
async def test_tensorboard_scalars_of_every_replica_once_a_step(
    bus: BusAddress, procs: Any, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from evtrain.exporters import TensorBoardWriter, tensorboard

    monkeypatch.setattr(tensorboard, "_summary_writer_class", lambda: _Scalars)
    await run_hooks([TensorBoardWriter(dir=workdir)], bus, procs, steps=12, dp=2)
    written = _Scalars.written
    assert [step for step, _ in written["train/loss"]] == list(range(1, 13))
    for group in ("stage0", "stage1", "stage0_replica1", "stage1_replica1"):
        assert len(written[f"{group}/duration_s"]) == 12, group
    slow, fast = written["stage1_replica1/duration_s"][0][1], written["stage1/duration_s"][0][1]
    assert slow == pytest.approx(1.1 * fast)
    assert not [tag for tag in written if "replica0" in tag]  # replica 0 keeps its names


# -- Prometheus -----------------------------------------------------------------------


PROMETHEUS_AGENT = "Prometheus/2.42.0"
"""The ``User-Agent`` Prometheus scrapes with."""


def _scrape(port: int, agent: str = "Python-urllib/3.11") -> str:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"User-Agent": agent}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.read().decode()


def _sample(text: str, name: str) -> float | None:
    """The value of an unlabelled sample in an exposition."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return float(value)
    return None


class _MidRunScrape:
    """Scrapes the exporter whose port file is in ``directory`` once it counted ``steps``.

    The fake run pauses after them (heartbeats keep coming) until the scrape
    creates ``resume``, so the scrape sees the run going on.
    """

    def __init__(self, directory: Path, steps: int) -> None:
        self.text: str | None = None
        self.resume = directory / "resume"
        self._port_file = directory / "prometheus.port"
        self._steps = steps
        self._thread = threading.Thread(target=self._scrape, daemon=True)
        self._thread.start()

    def _scrape(self) -> None:
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if self._port_file.exists() and self._port_file.read_text().strip():
                    text = _scrape(int(self._port_file.read_text()))
                    if (_sample(text, "evtrain_steps_total") or 0) >= self._steps:
                        self.text = text
                        return
                time.sleep(0.05)
        finally:
            self.resume.touch()

    def result(self) -> str:
        self._thread.join(timeout=60)
        assert self.text is not None, "never scraped the exporter during the run"
        return self.text


def _promtool_check(exposition: str) -> None:
    if PROMTOOL is None:
        pytest.skip("promtool not installed (Debian package 'prometheus')")
    check = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.anyio
async def test_prometheus_exporter_serves_conventional_metrics(
    bus: BusAddress, procs: Any, workdir: Path
) -> None:
    exporter = PrometheusExporter(port=0, dir=workdir)
    scrape = _MidRunScrape(workdir, steps=9)
    await run_hooks(
        [exporter],
        bus,
        procs,
        steps=20,
        eval_every=10,
        drops_at=3,
        gaps_at=4,
        pause_at=10,
        pause_until=scrape.resume,
    )
    mid = scrape.result()
    assert 'evtrain_stage_up{replica="0",stage="0"} 1.0' in mid
    assert 'evtrain_stage_up{replica="0",stage="1"} 1.0' in mid
    assert "# TYPE evtrain_steps_total counter" in mid
    assert "# TYPE evtrain_step_duration_seconds histogram" in mid
    assert "evtrain_run_running 1.0" in mid

    value = exporter.registry.get_sample_value
    assert value("evtrain_steps_total") == 20
    assert value("evtrain_samples_total") == 20 * 32
    assert value("evtrain_steps_done") == 20
    assert value("evtrain_run_max_steps") == 20
    assert value("evtrain_loss") == pytest.approx(loss_at(20))
    assert value("evtrain_learning_rate", at(1)) == pytest.approx(0.1)
    assert value("evtrain_step_duration_seconds_count", at(0)) == 20
    assert value("evtrain_comm_wait_seconds_total", at(0)) == pytest.approx(
        0.2 * value("evtrain_step_duration_seconds_sum", at(0))
    )
    assert value("evtrain_bubble_ratio", at(1)) == pytest.approx(0.2)
    assert value("evtrain_peak_memory_bytes", at(1)) == 150 * 1024 * 1024 + 20 * 1024
    assert value("evtrain_eval_metric", {"set": "", "metric": "loss"}) == 1.0
    assert value("evtrain_evals_total") == 2
    assert value("evtrain_eval_last_step") == 20
    assert value("evtrain_step_metric", {"metric": "tokens"}) == 512.0
    assert value("evtrain_events_dropped_total", {"source": "stage/0"}) == 5
    assert value("evtrain_events_missing_total", {"source": "stage/1", "observer": "stage/0"}) == 3
    assert value("evtrain_runs_ended_total", {"status": "completed"}) == 1
    assert value("evtrain_run_running") == 0
    assert value("evtrain_stage_up", at(0)) == 0  # the run ended
    _promtool_check(mid)


@pytest.mark.anyio
async def test_data_parallel_run_has_series_per_stage_process_and_counts_each_step_once(
    bus: BusAddress, procs: Any, workdir: Path
) -> None:
    """2 stages x 2 replicas: four stage processes, each with its own series; one step each."""
    run_dir = workdir / "run"
    exporter = PrometheusExporter(port=0, dir=workdir)
    scrape = _MidRunScrape(workdir, steps=9)
    run = await run_hooks(
        [exporter, MetricsLog(), EventRecorder()],
        bus,
        procs,
        steps=20,
        stages=2,
        dp=2,
        pause_at=10,
        pause_until=scrape.resume,
        run_dir=run_dir,
    )
    places = [(stage, replica) for stage in (0, 1) for replica in (0, 1)]
    mid = scrape.result()
    for stage, replica in places:
        assert f'evtrain_stage_up{{replica="{replica}",stage="{stage}"}} 1.0' in mid

    value = exporter.registry.get_sample_value
    # Every replica reports every step with the global batch: counted once per step.
    assert value("evtrain_steps_total") == 20
    assert value("evtrain_samples_total") == 20 * 32
    assert value("evtrain_steps_done") == 20
    assert value("evtrain_loss") == pytest.approx(loss_at(20))
    for stage, replica in places:
        assert value("evtrain_step_duration_seconds_count", at(stage, replica)) == 20
        assert value("evtrain_peak_memory_bytes", at(stage, replica)) == (
            (100 + 50 * stage + 10 * replica) * 1024 * 1024 + 20 * 1024
        )
        assert value("evtrain_bubble_ratio", at(stage, replica)) == pytest.approx(0.2)
        assert value("evtrain_learning_rate", at(stage, replica)) == pytest.approx(0.1)
        assert value("evtrain_stage_failures_total", at(stage, replica)) == 0
        source = f"stage/{stage}" + (f"/{replica}" if replica else "")
        assert value("evtrain_events_dropped_total", {"source": source}) == 0
        observed = {"source": source, "observer": f"hook/{run.runner.name}"}
        assert value("evtrain_events_missing_total", observed) == 0
    # Replica 1 steps 10% slower in the fake run: its own series says so.
    slow, fast = (value("evtrain_step_duration_seconds_sum", at(1, r)) for r in (1, 0))
    assert slow == pytest.approx(1.1 * fast)
    # Only replica 0 writes checkpoint shards.
    assert value("evtrain_checkpoint_blocked_seconds_total", at(0, 0)) == 0
    assert value("evtrain_checkpoint_blocked_seconds_total", at(0, 1)) is None
    _promtool_check(mid)

    # metrics.jsonl: one line per step, with every replica's times.
    steps = [m for m in _lines(run_dir / "metrics.jsonl") if m["type"] == "step"]
    assert [m["step"] for m in steps] == list(range(1, 21))
    for record in steps:
        assert record["samples"] == 32
        assert record["loss"] == pytest.approx(loss_at(record["step"]))
        assert sorted(record["stages"]) == ["0", "1"]
        assert {r: sorted(s) for r, s in record["replicas"].items()} == {"1": ["0", "1"]}
        slowest = record["replicas"]["1"]["1"]["duration_s"]
        assert slowest == pytest.approx(1.1 * record["stages"]["1"]["duration_s"])
        assert record["step_time_s"] == slowest  # the step ends with its slowest process
    # Every event of every replica was recorded, and replaying it writes the same lines.
    recorded = [from_builtins(e) for e in _lines(run_dir / "events.jsonl")]
    assert sum(isinstance(e, StepEnded) for e in recorded) == 20 * 4
    _replay_metrics(run_dir)


def test_stage_up_goes_stale() -> None:
    liveness = _StageLiveness(stale_after=3600)  # no pause of a busy machine is that long
    assert liveness.up((0, 0)) == 0.0  # never seen
    liveness.seen((0, 0))
    assert liveness.up((0, 0)) == 1.0
    liveness.stale_after = 0.2
    time.sleep(0.3)
    assert liveness.up((0, 0)) == 0.0
    liveness.stale_after = 3600
    liveness.seen((0, 0))
    liveness.down((0, 0))
    assert liveness.up((0, 0)) == 0.0


def test_prometheus_port_in_use_is_a_usage_error(workdir: Path) -> None:
    import anyio

    first = PrometheusExporter(port=0)
    anyio.run(first.setup)
    try:
        assert first.bound_port is not None
        second = PrometheusExporter(port=first.bound_port)
        with pytest.raises(UsageError, match=r"cannot serve on 127\.0\.0\.1"):
            anyio.run(second.setup)
    finally:
        anyio.run(first.teardown)


@pytest.mark.anyio
async def test_exporter_joining_mid_run_knows_the_run_at_once(
    bus: BusAddress, procs: Any, tmp_path: Path
) -> None:
    import anyio

    from evtrain.bus.state_service import fetch_snapshot
    from evtrain.hooks.runner import HookRunner

    resume = tmp_path / "resume"
    fake = procs.start(*fake_args(bus, steps=12, pause_at=10, pause_until=resume))
    # Wait until the run sits in its pause after step 9, until the exporter joined.
    with anyio.fail_after(60):
        while not any(
            isinstance(m, StepEnded) and m.step == 9 and m.stage == 0
            for m in await anyio.to_thread.run_sync(fetch_snapshot, bus)
        ):
            await anyio.sleep(0.1)
    exporter = PrometheusExporter(port=0)
    runner = HookRunner([exporter], bus, exit_on_run_end=True)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner.run)
            await runner.ready.wait()
            value = exporter.registry.get_sample_value
            # Known from the broker's state snapshot, before any new event arrived.
            assert value("evtrain_steps_done") == 9
            assert value("evtrain_run_max_steps") == 12
            assert value("evtrain_run_stages") == 2
            assert value("evtrain_stage_up", at(1)) == 1
            assert value("evtrain_loss") == pytest.approx(loss_at(9))
            resume.touch()
            assert await anyio.to_thread.run_sync(fake.wait) == 0
    assert value("evtrain_steps_done") == 12
    assert value("evtrain_steps_total") == 4  # counted from the step it saw: 9..12


# -- Prometheus: counters that cannot be poisoned, labels that exist, the last scrape ------


def _through_schema(*events: Message) -> list[Message]:
    """What a subscriber hands on: the events encoded and decoded (out-of-range ones fail)."""
    out = []
    for ev in events:
        ev.run_id = ev.run_id or "run-a"
        try:
            out.append(decode(encode(ev), ev.topic))
        except DecodeError:
            continue
    return out


def _run_started(
    num_stages: int = 2,
    max_steps: int = 100,
    run_id: str = "run-a",
    data_parallel: int = 1,
    tensor_parallel: int = 1,
) -> RunStarted:
    return RunStarted(
        name="r",
        num_stages=num_stages,
        num_microbatches=2,
        schedule="1f1b",
        max_steps=max_steps,
        batch_size=8,
        run_id=run_id,
        data_parallel=data_parallel,
        tensor_parallel=tensor_parallel,
    )


def _replay(exporter: PrometheusExporter, events: list[Message]) -> Any:
    import anyio

    from evtrain.tools.replay import ReplayRunner

    runner = ReplayRunner([exporter])
    anyio.run(runner.replay, events)
    assert runner.errors == 0
    return exporter.registry.get_sample_value


def test_prometheus_counters_take_no_poisoned_value() -> None:
    events = _through_schema(
        _run_started(),
        StepEnded(step=1, stage=0, samples=8, forward_s=0.5),
        StepEnded(step=10**12, stage=0, samples=8),  # past max_steps: none of the run's
        StepEnded(step=2, stage=7, samples=8),  # a stage the run does not have
        StepEnded(step=3, stage=0, samples=-5),  # rejected by the schema
        StepEnded(step=3, stage=0, forward_s=math.inf),  # rejected by the schema
        StepEnded(step=50, stage=0, samples=8, run_id="made-up"),  # another run
        StepEnded(step=2, stage=0, samples=8, forward_s=0.25),
        StepEnded(step=2, stage=1, samples=8, forward_s=0.25),  # same step: counted once
        StepEnded(step=3, stage=0, samples=8, loss=math.nan, grad_norm=math.inf),
    )
    assert len(events) == 8
    value = _replay(PrometheusExporter(port=0), events)
    assert value("evtrain_steps_total") == 3
    assert value("evtrain_samples_total") == 24
    assert value("evtrain_forward_seconds_total", at(0)) == 0.75
    assert math.isnan(value("evtrain_loss"))  # a gauge may show a diverged loss
    assert value("evtrain_grad_norm") == math.inf
    assert value("evtrain_forward_seconds_total", at(7)) is None


def test_prometheus_replicas_the_run_does_not_have_count_nothing() -> None:
    received = _through_schema(
        _run_started(data_parallel=2),
        StepEnded(step=1, stage=0, replica=1, samples=8, forward_s=0.5),
        StepEnded(step=1, stage=0, samples=8, forward_s=0.25),
        StepEnded(step=2, stage=0, replica=2, samples=8, forward_s=9.0),  # D is 2
        StepEnded(step=2, stage=1, replica=events.MAX_REPLICAS, samples=8),  # rejected
        Heartbeat(stage=1, replica=7),
        StageFailed(stage=0, replica=3, error="made up", traceback=""),
    )
    assert len(received) == 6
    exporter = PrometheusExporter(port=0)
    value = _replay(exporter, received)
    assert value("evtrain_steps_total") == 1 and value("evtrain_samples_total") == 8
    assert value("evtrain_forward_seconds_total", at(0, 0)) == 0.25
    assert value("evtrain_forward_seconds_total", at(0, 1)) == 0.5
    text = generate_latest(exporter.registry).decode()
    assert {'replica="0"', 'replica="1"'} == set(re.findall(r'replica="\d+"', text))
    assert exporter.not_counted.total == 3


def test_prometheus_series_of_replicas_follow_the_run() -> None:
    exporter = PrometheusExporter(port=0)
    first = _run_started(num_stages=2, data_parallel=3, run_id="first")
    started = HookStarted(hooks=["logging"], topics=[], pid=1)
    started.source = "hook/logging"
    _replay(exporter, [first, started])
    text = generate_latest(exporter.registry).decode()
    # Zero series for all 2 x 3 stage processes, each source and each observer of it.
    for stage in (0, 1):
        for replica in (0, 1, 2):
            up = f'evtrain_stage_up{{replica="{replica}",stage="{stage}"}} 0.0'
            assert up in text
            source = f"stage/{stage}" + (f"/{replica}" if replica else "")
            dropped = f'evtrain_events_dropped_total{{source="{source}"}} 0.0'
            missing = f'evtrain_events_missing_total{{observer="hook/logging",source="{source}"}}'
            assert dropped in text and missing in text
    value = _replay(exporter, [_run_started(num_stages=2, run_id="second")])
    text = generate_latest(exporter.registry).decode()
    assert 'replica="1"' not in text and 'replica="2"' not in text  # the new run has none
    assert value("evtrain_stage_up", at(1)) == 0
    assert value("evtrain_forward_seconds_total", at(1)) == 0


def test_prometheus_tensor_ranks_have_their_own_series_and_name_their_straggler() -> None:
    def tensor(step: int, tp: int, **times: Any) -> events.TensorRankStepEnded:
        return events.TensorRankStepEnded(step=step, stage=1, replica=1, tp=tp, **times)

    def straggler(on: bool) -> events.StragglerReported:
        return events.StragglerReported(
            step=20, stage=1, replica=1, tp=1, slowdown=3.0, straggling=on
        )

    received = _through_schema(
        _run_started(data_parallel=2, tensor_parallel=2),
        StepEnded(step=1, stage=1, replica=1, cpu_s=0.25, peak_memory_bytes=100),
        tensor(1, 1, cpu_s=0.5, peak_memory_bytes=300),
        tensor(2, 1, cpu_s=0.75, forward_s=9.0),
        tensor(2, 2, cpu_s=9.0),  # T is 2
        tensor(10**12, 1, cpu_s=9.0),  # past max_steps
        straggler(True),
    )
    assert len(received) == 7
    exporter = PrometheusExporter(port=0)
    value = _replay(exporter, received)

    def of(tp: int, stage: int = 1, replica: int = 1) -> dict[str, str]:
        return {**at(stage, replica), "tp": str(tp)}

    assert value("evtrain_tensor_rank_work_seconds_total", of(0)) == 0.25
    assert value("evtrain_tensor_rank_work_seconds_total", of(1)) == 1.25
    assert value("evtrain_tensor_rank_peak_memory_bytes", of(1)) == 300
    # Every process of the run from its start, at 0; none beyond it.
    assert value("evtrain_tensor_rank_work_seconds_total", of(0, 0, 0)) == 0
    assert value("evtrain_tensor_rank_work_seconds_total", of(2)) is None
    assert exporter.not_counted.total == 2
    # Tensor rank 0 (the stage process) ran no slower: its own comparison is not it, but
    # the stage process counts as a straggler while one of its tensor ranks is.
    assert value("evtrain_tensor_rank_straggler", of(1)) == 1
    assert value("evtrain_tensor_rank_straggler", of(0)) == 0
    assert value("evtrain_straggler", at(1, 1)) == 1
    recovered = PrometheusExporter(port=0)
    value = _replay(recovered, [*received, *_through_schema(straggler(False))])
    assert value("evtrain_tensor_rank_straggler", of(1)) == 0
    assert value("evtrain_straggler", at(1, 1)) == 0
    # A run without tensor parallelism has no such series.
    _replay(exporter, _through_schema(_run_started(data_parallel=2)))
    text = generate_latest(exporter.registry).decode()
    assert "evtrain_tensor_rank_work_seconds_total{" not in text and 'tp="' not in text


def test_prometheus_steps_count_by_bounded_increments_without_a_run() -> None:
    """Without run.started nothing says a number is absurd: its jump counts, bounded."""
    from evtrain.steps import MAX_STEP_JUMP

    steps = [StepEnded(step=k, stage=0, samples=1) for k in (1, 2, 10**12, 3, 4, 5)]
    value = _replay(PrometheusExporter(port=0), _through_schema(*steps))
    # 1, 2; the jump counts MAX_STEP_JUMP; 3 starts the count over (1); 4, 5.
    assert value("evtrain_steps_total") == 2 + MAX_STEP_JUMP + 3
    assert value("evtrain_steps_done") == 5  # later steps are not frozen out
    huge = [StepEnded(step=1, stage=0, samples=events.MAX_INT)]
    value = _replay(PrometheusExporter(port=0), _through_schema(*huge))
    assert value("evtrain_steps_total") == 1 and value("evtrain_samples_total") == 0
    gaps = BusGaps(from_source="stage/0", missing=events.MAX_INT, total_missing=events.MAX_INT)
    value = _replay(PrometheusExporter(port=0), _through_schema(gaps))
    assert not value("evtrain_events_missing_total", {"source": "stage/0", "observer": ""})


def test_prometheus_labelled_counters_start_at_zero() -> None:
    exporter = PrometheusExporter(port=0)
    started = HookStarted(hooks=["logging", "metrics"], topics=["step."], pid=1)
    started.source = "hook/logging+metrics"
    value = _replay(exporter, [_run_started(num_stages=3), started])
    for status in ("completed", "stopped", "failed"):
        assert value("evtrain_runs_ended_total", {"status": status}) == 0
    for stage in ("0", "1", "2"):
        for name in (
            "evtrain_forward_seconds_total",
            "evtrain_backward_seconds_total",
            "evtrain_comm_wait_seconds_total",
            "evtrain_checkpoint_blocked_seconds_total",
            "evtrain_stage_failures_total",
        ):
            assert value(name, at(stage)) == 0, (name, stage)
        assert value("evtrain_events_dropped_total", {"source": f"stage/{stage}"}) == 0
        observed = {"source": f"stage/{stage}", "observer": "hook/logging+metrics"}
        assert value("evtrain_events_missing_total", observed) == 0
    for hook in ("prometheus", "logging", "metrics"):
        assert value("evtrain_hook_errors_total", {"hook": hook}) == 0
    assert value("evtrain_stage_up", at(2)) == 0


def test_prometheus_labels_stay_bounded_and_follow_the_run() -> None:
    from evtrain.exporters.prometheus import MAX_GAP_SERIES, MAX_LABEL_VALUES

    exporter = PrometheusExporter(port=0)
    names = HookStarted(hooks=[f"made-up-{i}" for i in range(5000)], topics=[], pid=1)
    gaps = []
    for i in range(3000):
        gap = BusGaps(from_source=f"src{i % 150}", missing=1, total_missing=1)
        gap.source = f"observer{i // 150}"
        gaps.append(gap)
    escaped = HookError(hook="\x1b[2Jx", handler="h", event_type="step.ended", error="e", count=3)
    events = [
        _run_started(num_stages=4, run_id="first"),
        StepEnded(step=1, stage=3, run_id="first"),
        names,
        escaped,
        *gaps,
        _run_started(num_stages=2, run_id="second"),
    ]
    _replay(exporter, events)
    text = generate_latest(exporter.registry).decode()
    missing = [
        line for line in text.splitlines() if line.startswith("evtrain_events_missing_total")
    ]
    assert len(missing) <= MAX_GAP_SERIES
    hook_series = [
        line for line in text.splitlines() if line.startswith("evtrain_hook_errors_total")
    ]
    assert len(hook_series) <= MAX_LABEL_VALUES
    assert "\x1b" not in text
    assert 'stage="3"' not in text and 'stage="2"' not in text  # the second run has 2 stages
    assert 'evtrain_forward_seconds_total{replica="0",stage="1"} 0.0' in text


class _Scraper:
    """Scrapes an exporter every ``interval`` seconds in a thread, as Prometheus (its
    ``User-Agent``) or another reader; keeps the last text."""

    def __init__(self, port: int, interval: float, agent: str = PROMETHEUS_AGENT) -> None:
        self.port = port
        self.interval = interval
        self.agent = agent
        self.last = ""
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.last = _scrape(self.port, self.agent)
                self.count += 1
            except OSError:
                return  # the exporter stopped serving

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


SHUTDOWN_S = 0.5
"""What stopping prometheus-client's HTTP server takes on its own (its poll interval)."""


def _linger(
    exporter: PrometheusExporter,
    scrape_every: float | None,
    scrapes: int,
    agent: str = PROMETHEUS_AGENT,
) -> float:
    """Set up, see a run end (after ``scrapes`` scrapes), time the teardown."""
    import anyio

    from evtrain.tools.replay import ReplayRunner

    runner = ReplayRunner([exporter])
    scraper: _Scraper | None = None

    async def main() -> float:
        nonlocal scraper
        await exporter.setup()
        exporter._runner = runner
        assert exporter.bound_port is not None
        await runner._handle(_run_started())
        if scrape_every is not None:
            scraper = _Scraper(exporter.bound_port, scrape_every, agent)
            with anyio.fail_after(20):
                while scraper.count < scrapes:
                    await anyio.sleep(0.01)
            if scrapes < 3:
                scraper.stop()  # Prometheus went away
        await runner._handle(RunEnded(status="completed", step=5, run_id="run-a"))
        start = time.monotonic()
        await exporter.teardown()
        return time.monotonic() - start

    try:
        return anyio.run(main)
    finally:
        if scraper is not None:
            scraper.stop()


def test_prometheus_never_scraped_exits_at_once() -> None:
    assert _linger(PrometheusExporter(port=0), None, 0) < SHUTDOWN_S + 0.5


def test_only_prometheus_scrapes_count_for_the_last_scrape() -> None:
    """A curl or a test reading /metrics is no scrape: the exporter does not wait for
    one after the run ended (nothing would carry the final values to Prometheus)."""
    exporter = PrometheusExporter(port=0)
    assert _linger(exporter, 0.2, scrapes=3, agent="curl/8.5.0") < SHUTDOWN_S + 0.5
    assert exporter.scrapes.last is None


def test_prometheus_lingers_until_a_scrape_after_the_run_ended() -> None:
    exporter = PrometheusExporter(port=0)
    waited = _linger(exporter, scrape_every=0.4, scrapes=3)
    assert waited < 0.4 + SHUTDOWN_S + 1.0  # the next scrape, not the 30 s bound
    last = exporter.scrapes.last
    assert last is not None and exporter._ended_at is not None and last > exporter._ended_at


def test_prometheus_waits_at_most_two_scrape_intervals() -> None:
    exporter = PrometheusExporter(port=0)
    waited = _linger(exporter, scrape_every=0.3, scrapes=2)  # then the scrapes stop
    interval = exporter.scrapes.interval()
    assert interval is not None
    assert 2 * interval - 0.1 <= waited <= 2 * interval + SHUTDOWN_S + 1.0
    assert _linger(PrometheusExporter(port=0, linger=0), 0.3, scrapes=2) < SHUTDOWN_S + 0.5


def test_metrics_log_writes_each_step_once_across_an_elastic_restart(tmp_path: Path) -> None:
    import anyio

    from evtrain.tools.replay import ReplayRunner

    # Steps 1-5, then the stages restart from the checkpoint of step 3 (same run,
    # a new RunStarted) and redo steps 4-6.
    first = _run_started(num_stages=1)
    first.run_dir = str(tmp_path)
    again = _run_started(num_stages=1)
    again.run_dir, again.start_step = str(tmp_path), 3
    events = _through_schema(
        first,
        *(StepEnded(step=s, stage=0, samples=8, loss=float(s)) for s in range(1, 6)),
        again,
        *(StepEnded(step=s, stage=0, samples=8, loss=10.0 + s) for s in range(4, 7)),
        RunEnded(status="completed", step=6),
    )
    runner = ReplayRunner([MetricsLog()])
    anyio.run(runner.replay, events)
    assert runner.errors == 0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["step"], r["loss"]) for r in lines if r["type"] == "step"]
    assert steps == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0), (6, 16.0)]


def test_info_and_timestamp_series_an_sre_alerts_on() -> None:
    """evtrain_build_info and evtrain_run_info (one series: a later run replaces the
    earlier's labels), and when the latest step ended and the latest checkpoint was
    committed."""
    from evtrain.tools.replay import ReplayRunner

    def run_started(run_id: str, ts: float) -> events.RunStarted:
        return events.RunStarted(
            name="r", num_stages=1, num_microbatches=1, schedule="zb", max_steps=5,
            batch_size=8, tensor_parallel=2, run_id=run_id, ts=ts,
        )  # fmt: skip

    exporter = PrometheusExporter(port=0)
    step = events.StepEnded(step=1, stage=0, duration_s=0.1, loss=0.5, run_id="b", ts=1002.0)
    committed = events.CheckpointCommitted(
        checkpoint_id="c1", step=1, path="/x/step-1", run_id="b", ts=1003.0
    )
    runner = ReplayRunner([exporter])
    anyio.run(runner.replay, [run_started("a", 900.0), run_started("b", 1000.0), step, committed])
    assert runner.errors == 0
    value = exporter.registry.get_sample_value
    assert value("evtrain_last_step_timestamp_seconds") == 1002.0
    assert value("evtrain_checkpoint_last_timestamp_seconds") == 1003.0
    infos = [
        sample.labels
        for metric in exporter.registry.collect()
        if metric.name == "evtrain_run_info"
        for sample in metric.samples
    ]
    shape = {"stages": "1", "replicas": "1", "tensor_ranks": "2"}
    assert infos == [{"run_id": "b", "name": "r", "schedule": "zb", **shape}]
    version = importlib.metadata.version("evtrain")
    assert value("evtrain_build_info", {"version": version}) == 1


def test_each_stage_has_one_instruction_series_and_hangs_are_counted() -> None:
    """evtrain_stage_instruction_seconds follows each heartbeat's instruction, one series
    per stage (the previous instruction's is removed); a made-up instruction is "other";
    evtrain_hangs_reported_total counts the launcher's hang reports."""
    from evtrain.tools.replay import ReplayRunner

    started = events.RunStarted(
        name="r", num_stages=2, num_microbatches=1, schedule="1f1b", max_steps=5,
        batch_size=8, run_id="h", ts=1.0,
    )  # fmt: skip

    def beat(stage: int, doing: str, doing_s: float) -> events.Heartbeat:
        return events.Heartbeat(stage=stage, step=2, doing=doing, doing_s=doing_s, run_id="h")

    exporter = PrometheusExporter(port=0)
    runner = ReplayRunner([exporter])
    anyio.run(
        runner.replay,
        [
            started,
            beat(0, "Forward m1", 0.5),
            beat(1, "", 0.0),
            beat(0, "RecvGrad m1 from stage 1", 41.0),
            beat(1, "Evaluate step 2: Forward m3", 2.0),
            beat(1, "Evaluate step 2: Bogus m3 <script>", 3.0),
            events.HangReported(step=3, stage=1, summary="the run hung", run_id="h"),
        ],
    )
    assert runner.errors == 0
    series = {
        (s.labels["stage"], s.labels["instruction"]): s.value
        for metric in exporter.registry.collect()
        if metric.name == "evtrain_stage_instruction_seconds"
        for s in metric.samples
    }
    assert series == {("0", "RecvGrad"): 41.0, ("1", "other"): 3.0}
    assert exporter.registry.get_sample_value("evtrain_hangs_reported_total") == 1.0


def test_stragglers_are_one_while_they_straggle() -> None:
    """evtrain_straggler: 0 for every stage process from the run's start, 1 while one
    straggles; a whole stage is each of its replicas."""
    from evtrain.tools.replay import ReplayRunner

    started = events.RunStarted(
        name="r", num_stages=2, num_microbatches=1, schedule="1f1b", max_steps=5,
        batch_size=8, data_parallel=2, run_id="s", ts=1.0,
    )  # fmt: skip

    def report(stage: int, replica: int, whole: bool, on: bool) -> events.StragglerReported:
        return events.StragglerReported(
            step=20, stage=stage, replica=replica, whole_stage=whole, slowdown=2.5,
            straggling=on, run_id="s",
        )  # fmt: skip

    exporter = PrometheusExporter(port=0)
    runner = ReplayRunner([exporter])
    anyio.run(
        runner.replay,
        [started, report(0, 1, False, True), report(1, 0, True, True), report(0, 1, False, False)],
    )
    assert runner.errors == 0
    value = exporter.registry.get_sample_value
    got = {
        (s, r): value("evtrain_straggler", {"stage": str(s), "replica": str(r)})
        for s in range(2)
        for r in range(2)
    }
    assert got == {(0, 0): 0.0, (0, 1): 0.0, (1, 0): 1.0, (1, 1): 1.0}
