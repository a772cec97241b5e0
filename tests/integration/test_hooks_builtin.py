"""The built-in hooks against a real broker and a real publisher process (tests/fake_run.py).

Acting hooks send real commands; the fake run's stage-side `CommandReceiver`s
receive and acknowledge them in another process.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers.hook_helpers import fake_args, json_lines, loss_at, run_hooks, wait_for_text
from structlog.testing import capture_logs

from evtrain.bus.address import BusAddress
from evtrain.errors import UsageError
from evtrain.events import Message, RunStarted
from evtrain.hooks import (
    ConsoleLog,
    EarlyStopping,
    EvalTrigger,
    LRMonitor,
    MemoryMonitor,
    Timer,
)
from evtrain.hooks.registry import BUILTIN_HOOKS, build_hook_from_spec, resolve_hook_class

MIB = 1024 * 1024


def two_stage_run(data_parallel: int = 1) -> RunStarted:
    """The `RunStarted` of run ``r1``: 2 stages of ``data_parallel`` replicas, 100 steps."""
    return RunStarted(
        name="r",
        num_stages=2,
        num_microbatches=1,
        schedule="1f1b",
        max_steps=100,
        batch_size=1,
        data_parallel=data_parallel,
        run_id="r1",
    )


# -- options ----------------------------------------------------------------------


def test_builtin_names_resolve_to_hooks_of_that_name() -> None:
    for short, target in BUILTIN_HOOKS.items():
        cls = resolve_hook_class(short)
        assert cls.hook_name() == short, target


def test_spec_dicts_build_hooks_with_their_options() -> None:
    hook = build_hook_from_spec(dict(type="logging", every=10, priority=5))
    assert isinstance(hook, ConsoleLog)
    assert (hook.every, hook.priority) == (10, 5)
    stopper = build_hook_from_spec(
        dict(type="early_stopping", metric="accuracy", mode="MAX", patience="2", min_delta=0.01)
    )
    assert isinstance(stopper, EarlyStopping)
    assert (stopper.metric, stopper.mode, stopper.patience, stopper.min_delta) == (
        "accuracy",
        "max",
        2,
        0.01,
    )
    memory = build_hook_from_spec(dict(type="memory", threshold="1.5GiB"))
    assert isinstance(memory, MemoryMonitor)
    assert memory.threshold == int(1.5 * 1024**3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (dict(type="logging", every=0), "option 'every' must be an integer >= 1, got 0"),
        (dict(type="logging", log_format="xml"), "option 'log_format' must be one of console"),
        (dict(type="eval_every"), "give exactly one of 'every' or 'every_epochs'"),
        (dict(type="eval_every", every=2.5), "option 'every' must be an integer >= 1, got 2.5"),
        (dict(type="early_stopping", mode="up"), "option 'mode' must be one of min, max"),
        (dict(type="early_stopping", patience=-1), "option 'patience' must be an integer >= 1"),
        (dict(type="early_stopping", min_delta="x"), "option 'min_delta' must be a number"),
        (dict(type="early_stopping", metric=""), "option 'metric' must be a non-empty string"),
        (dict(type="memory", threshold="lots"), "option 'threshold' must be a size in bytes"),
        (dict(type="timer", every=True), "option 'every' must be an integer >= 1, got True"),
        (dict(type="lr_monitor", rtol=-1), "option 'rtol' must be a number >= 0"),
        (dict(type="prometheus", port=70000), "option 'port' must be <= 65535"),
        (dict(type="prometheus", port="http"), "option 'port' must be an integer >= 0"),
        (dict(type="recorder", flush_interval=-1), "option 'flush_interval' must be a number"),
        (dict(type="metrics", every=3), "accepted options: dir, path, priority"),
    ],
)
def test_bad_options_are_one_clear_usage_error(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError) as info:
        build_hook_from_spec(spec)
    assert message in str(info.value)
    assert spec["type"] in str(info.value)


def test_early_stopping_improvement_rule() -> None:
    stop = EarlyStopping(mode="max", min_delta=0.1)
    assert stop.improved(0.5)
    stop.best = 0.5
    assert not stop.improved(0.55)  # within min_delta
    assert stop.improved(0.65)
    low = EarlyStopping(mode="min")
    low.best = 1.0
    assert low.improved(0.99) and not low.improved(1.0)


# -- the logging hook ----------------------------------------------------------------


def test_logging_hook_process_prints_progress_eval_and_warnings(
    bus: BusAddress, procs: Any
) -> None:
    log_dir = Path(tempfile.mkdtemp(prefix="evt-log-"))
    try:
        stderr = log_dir / "hook.err"
        with stderr.open("w") as err:
            hook = procs.evtrain(
                "--log-format",
                "json",
                "hook",
                "logging",
                "--bus",
                str(bus),
                "-o",
                "every=5",
                "--exit-on-run-end",
                stderr=err,
            )
            wait_for_text(stderr, "hooks attached")
            fake = procs.start(
                *fake_args(bus, steps=20, eval_every=10, drops_at=7, gaps_at=8, stages=2)
            )
            assert fake.wait(timeout=30) == 0
            assert hook.wait(timeout=15) == 0  # --exit-on-run-end
        lines = json_lines(stderr.read_text())
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)

    progress = [line for line in lines if line["event"] == "progress"]
    assert [p["step"] for p in progress] == ["5/20", "10/20", "15/20", "20/20"]
    last = progress[-1]
    assert last["loss"] == pytest.approx(loss_at(20), rel=1e-3)
    assert last["lr"] == pytest.approx(0.1)
    assert last["samples_per_s"] > 0 and last["step_time_s"] > 0
    assert last["eta"] == "0:00:00"
    assert "s0=100.0MiB" in last["peak_mem"] and "s1=150.0MiB" in last["peak_mem"]
    assert last["tokens"] == 512.0  # reported with the step

    evals = [line for line in lines if line["event"] == "eval"]
    assert [e["step"] for e in evals] == [10, 20]
    assert evals[0]["val_loss"] == pytest.approx(1.0)

    drops = [line for line in lines if line["event"] == "events dropped by publisher"]
    assert drops and drops[0]["level"] == "warning" and drops[0]["dropped"] == 5
    assert drops[0]["source"] == "stage/0"
    gaps = [line for line in lines if line["event"] == "bus gap: events lost"]
    assert any(g.get("observer") == "stage/0" and g["missing"] == 3 for g in gaps)

    ended = [line for line in lines if line["event"] == "run ended"]
    assert ended and ended[0]["status"] == "completed" and ended[0]["step"] == 20
    started = [line for line in lines if line["event"] == "run started"]
    assert started and started[0]["max_steps"] == 20 and started[0]["stages"] == 2


async def logged_run(bus: BusAddress, procs: Any, every: int, **fake: Any) -> list[dict[str, Any]]:
    """The JSON lines the logging hook writes into its own file during the fake run."""
    directory = Path(tempfile.mkdtemp(prefix="evt-log-"))
    try:
        path = directory / "train.log"
        hook = ConsoleLog(every=every, log_format="json", path=path)
        await run_hooks([hook], bus, procs, **fake)
        return json_lines(path.read_text())
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.anyio
async def test_logging_hook_own_format_into_a_file(bus: BusAddress, procs: Any) -> None:
    lines = await logged_run(bus, procs, every=4, steps=8, stages=3)
    assert [line["step"] for line in lines if line["event"] == "progress"] == ["4/8", "8/8"]
    assert lines[-1]["event"] == "run ended"


@pytest.mark.anyio
async def test_logging_hook_with_replicas_says_each_step_once(bus: BusAddress, procs: Any) -> None:
    """2 stages x 2 replicas: four stage processes report every step, one line shows it."""
    lines = await logged_run(bus, procs, every=5, steps=20, stages=2, dp=2)
    progress = [line for line in lines if line["event"] == "progress"]
    assert [p["step"] for p in progress] == ["5/20", "10/20", "15/20", "20/20"]
    last = progress[-1]
    assert last["loss"] == pytest.approx(loss_at(20), rel=1e-3)
    # The global batch of 32 per step: replicas counted too would make it 64 a step.
    assert 20 < last["samples_per_s"] * last["step_time_s"] < 48
    # A stage's peak is its fullest replica's (replica 1: +10 MiB in the fake run).
    assert "s0=110.0MiB" in last["peak_mem"] and "s1=160.0MiB" in last["peak_mem"]
    started = sorted(
        (line["stage"], line.get("replica", 0))
        for line in lines
        if line["event"] == "stage started"
    )
    assert started == [(0, 0), (0, 1), (1, 0), (1, 1)]
    run = next(line for line in lines if line["event"] == "run started")
    assert run["data_parallel"] == 2
    assert [line["event"] for line in lines].count("run ended") == 1


def test_launcher_progress_with_replicas_counts_each_step_once(bus: BusAddress, procs: Any) -> None:
    """The launcher's console folds what its subscriber receives: each step counts once."""
    import time

    import anyio

    from evtrain.bus.publisher import Publisher
    from evtrain.bus.subscriber import Subscriber
    from evtrain.events import Heartbeat
    from evtrain.launcher.progress import Progress

    progress = Progress()

    async def follow(subscriber: Subscriber, probe: Publisher) -> None:
        deadline = time.monotonic() + 30
        # The subscription is live once it receives what is published after it.
        while not any(isinstance(m, Heartbeat) for m in await subscriber.receive(timeout=0.1)):
            assert time.monotonic() < deadline, "the subscription never became live"
            probe.publish(Heartbeat())
        fake = procs.start(*fake_args(bus, steps=20, dp=2, step_time=0.01))
        while progress.stats.ended is None:
            assert time.monotonic() < deadline, "the run never ended on the bus"
            for msg in await subscriber.receive(timeout=0.2):
                progress.update(msg)
        assert await anyio.to_thread.run_sync(fake.wait) == 0

    topics = ["run.", "step.ended", "heartbeat"]
    with (
        Subscriber(bus.endpoint("events_out"), topics) as subscriber,
        Publisher(bus.endpoint("events_in"), source="test") as probe,
    ):
        anyio.run(follow, subscriber, probe)
    stats = progress.stats
    assert (stats.steps_done, stats.samples_total, stats.data_parallel) == (20, 20 * 32, 2)
    assert stats.last_loss == pytest.approx(loss_at(20))
    samples, steps = stats.samples_per_s(), stats.steps_per_s()
    assert samples is not None and steps is not None and samples / steps == pytest.approx(32)
    # A stage's peak is its fullest replica's (replica 1: +10 MiB in the fake run).
    assert stats.peak_memory == {0: 110 * MIB + 20 * 1024, 1: 160 * MIB + 20 * 1024}
    assert "peak memory: s0=110.0MiB s1=160.0MiB" in progress.summary(status="completed", wall_s=1)


# -- acting hooks ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_eval_every_and_early_stopping_steer_the_run(bus: BusAddress, procs: Any) -> None:
    trigger = EvalTrigger(every=5)
    stopper = EarlyStopping(metric="loss", mode="min", patience=3)
    run = await run_hooks(
        [trigger, stopper],
        bus,
        procs,
        steps=400,
        step_time=0.01,
        eval_losses="1.0,0.8,0.85,0.9,0.95,0.99,0.99",
    )
    summary = run.summary
    # One standing order from the hook; the stages evaluated at every multiple of 5.
    (order,) = [c for c in summary["commands"] if c["type"] == "cmd.evaluate"]
    assert order["source"] == "hook/eval_every+early_stopping"
    assert summary["evals"] == 5
    # 1.0 and 0.8 improved; 0.85, 0.9, 0.95 did not: the third bad eval stops the run.
    stops = [c for c in summary["commands"] if c["type"] == "cmd.stop"]
    assert len(stops) == 1
    assert summary["status"] == "stopped"
    assert summary["reason"].startswith("early stopping: val loss did not improve for 3 evals")
    assert "best 0.8" in summary["reason"]
    assert summary["steps"] < 400
    ended = run.runner.state.ended
    assert ended is not None and ended.status == "stopped" and ended.reason == summary["reason"]
    assert stopper.best == 0.8 and stopper.bad_evals == 3


@pytest.mark.anyio
async def test_early_stopping_in_max_mode(bus: BusAddress, procs: Any) -> None:
    # accuracy = 1 - loss/10 in the fake run: 0.90, 0.95, then 0.94 from then on.
    stopper = EarlyStopping(metric="accuracy", mode="max", patience=2, min_delta=0.001)
    run = await run_hooks([stopper], bus, procs, steps=30, eval_every=3, eval_losses="1.0,0.5,0.6")
    assert stopper.best == pytest.approx(0.95) and stopper.bad_evals == 2
    assert [c["type"] for c in run.summary["commands"]] == ["cmd.stop"]
    assert run.summary["status"] == "stopped"
    assert run.summary["reason"].startswith(
        "early stopping: val accuracy did not improve for 2 evals (best 0.95 at step 6, mode max"
    )
    assert 12 <= run.summary["steps"] < 30


# -- monitors --------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(("replicas", "threshold"), [(1, "120MiB"), (2, "155MiB")])
async def test_lr_timer_and_memory_monitors(
    bus: BusAddress, procs: Any, replicas: int, threshold: str
) -> None:
    """With replicas every step still counts once; replica 0 speaks for its stage."""
    lr = LRMonitor()
    timer = Timer(every=10)
    memory = MemoryMonitor(threshold=threshold)
    with capture_logs() as logs:
        await run_hooks(
            [lr, timer, memory],
            bus,
            procs,
            steps=40,
            lr_decay_every=10,
            step_time=0.005,
            dp=replicas,
        )
    assert list(lr.changes) == [(1, 0.1), (11, 0.05), (21, 0.025), (31, 0.0125)]
    changed = [e for e in logs if e["event"] == "learning rate changed"]
    assert [(e["step"], e["lr"], e["previous"]) for e in changed] == [
        (11, 0.05, 0.1),
        (21, 0.025, 0.05),
        (31, 0.0125, 0.025),
    ]
    assert not [e for e in logs if e["event"] == "stages report different learning rates"]

    timing = [e for e in logs if e["event"] == "timing"]
    assert [e["step"] for e in timing] == [10, 20, 30, 40]
    for e in timing:  # 32 samples a step, not 32 per replica
        assert e["samples_per_s"] / e["steps_per_s"] == pytest.approx(32, rel=0.02)
    overall = timer.summaries[-1]
    assert overall["steps"] == 40
    for stage in (0, 1):
        assert overall["fractions"][stage] == pytest.approx(
            {"fwd": 0.3, "bwd": 0.4, "wait": 0.2, "other": 0.1}
        )
    assert any(e["event"] == "overall training speed" for e in logs)

    # Stage 0 peaks at 100 MiB, stage 1 at 150; a replica 1 holds 10 MiB more. Only
    # stage 1 passes the threshold: without replicas past 120 MiB, with them past 155
    # MiB, on its replica 1.
    fullest = 10 * (replicas - 1)
    assert memory.peak == {
        0: (100 + fullest) * MIB + 40 * 1024,
        1: (150 + fullest) * MIB + 40 * 1024,
    }
    assert memory.warned == {1}
    (warning,) = [e for e in logs if e["event"] == "peak memory above threshold"]
    assert (warning["stage"], warning.get("replica", 0), warning["step"]) == (1, replicas - 1, 1)
    assert warning["log_level"] == "warning"


def test_lr_monitor_warns_once_about_a_replica_that_disagrees() -> None:
    import anyio

    from evtrain.events import StepEnded
    from evtrain.tools.replay import ReplayRunner

    lr = LRMonitor()
    events: list[Message] = [two_stage_run(data_parallel=2)]
    for step in (1, 2):
        for stage, replica in ((1, 0), (1, 1), (0, 0), (0, 1)):
            wrong = (stage, replica) == (0, 1)
            value = 0.2 if wrong else 0.1
            events.append(StepEnded(step=step, stage=stage, replica=replica, lr=value))
    runner = ReplayRunner([lr])
    with capture_logs() as logs:
        anyio.run(runner.replay, events)
    assert runner.errors == 0
    assert list(lr.changes) == [(1, 0.1)] and lr.last_lr == {0: 0.1, 1: 0.1}
    (warning,) = [e for e in logs if e["event"] == "stages report different learning rates"]
    assert (warning["stage"], warning["replica"], warning["lr"]) == (0, 1, 0.2)
    assert warning["others"] == {"1": 0.1, "1/1": 0.1, "0": 0.1}


def test_monitors_take_a_step_that_overtook_its_run_start_as_that_run() -> None:
    """Stages publish on their own sockets: stage 1's first step can reach a hook
    before stage 0's `RunStarted`. It is of the same run, so nothing is said twice."""
    import anyio

    from evtrain.events import StepEnded
    from evtrain.tools.replay import ReplayRunner

    lr, memory = LRMonitor(), MemoryMonitor(threshold="1MiB")

    def step(number: int, stage: int) -> StepEnded:
        return StepEnded(step=number, stage=stage, lr=0.1, peak_memory_bytes=2 * MIB, run_id="r1")

    runner = ReplayRunner([lr, memory])
    events = [step(1, 1), two_stage_run(), step(1, 0), step(2, 1), step(2, 0)]
    with capture_logs() as logs:
        anyio.run(runner.replay, events)
    assert runner.errors == 0
    assert list(lr.changes) == [(1, 0.1)]
    assert [e["stage"] for e in logs if e["event"] == "peak memory above threshold"] == [1, 0]


def test_lr_monitor_rtol_thins_out_smooth_schedules() -> None:
    """Handlers are plain methods: feed a cosine-like schedule straight in."""
    import itertools
    import math

    from evtrain.events import StepEnded

    lr = LRMonitor(rtol=0.05)
    for step in range(1, 101):
        value = 0.1 * (1 + math.cos(math.pi * step / 100)) / 2 + 1e-4
        for stage in (1, 0):
            lr.step_ended(StepEnded(step=step, stage=stage, lr=value))
    steps = [s for s, _ in lr.changes]
    assert 10 < len(steps) < 60  # not every step, yet the whole decay is visible
    assert steps[0] == 1 and steps[-1] > 80
    values = [v for _, v in lr.changes]
    assert all(b < a * (1 - 0.05) for a, b in itertools.pairwise(values))


# -- hostile text and numbers ---------------------------------------------------------


def test_safe_text_shows_control_characters_as_visible_escapes() -> None:
    from evtrain.formatting import safe_lines, safe_text

    assert safe_text("stage/0 loss é 日本") == "stage/0 loss é 日本"
    assert safe_text("\x1b[2J\x1b]0;t\x07\r\n\t\x00\x7f\x9b\u202e") == (
        "\\x1b[2J\\x1b]0;t\\x07\\r\\n\\t\\x00\\x7f\\x9b\\u202e"
    )
    assert safe_text("x" * 100, 10) == "xxxxxxx..."
    assert safe_text(12.5) == "12.5"
    assert safe_lines("a\x1b\nb") == "a\\x1b\nb"


def test_number_formatters_take_any_float() -> None:
    import math

    from evtrain.formatting import fmt_bytes, fmt_duration, short

    assert fmt_duration(math.inf) == "inf" and fmt_duration(math.nan) == "nan"
    assert fmt_duration(1e300) == "1e+300s" and fmt_duration(83.2) == "0:01:23"
    assert fmt_bytes(math.nan) == "nan" and fmt_bytes(1536) == "1.5KiB"
    result = short(math.nan)
    assert result is not None and math.isnan(result)


def test_logging_hook_escapes_event_text_and_prints_nan(tmp_path: Path) -> None:
    import math

    import anyio

    from evtrain.events import RunStarted, StageFailed, StepEnded
    from evtrain.tools.replay import ReplayRunner

    path = tmp_path / "train.log"
    hook = ConsoleLog(every=1, path=path)
    evil = "\x1b[2J\x1b]0;owned\x07"
    events = [
        RunStarted(
            name=evil,
            num_stages=1,
            num_microbatches=1,
            schedule="1f1b",
            max_steps=3,
            batch_size=1,
            run_dir=str(tmp_path),
        ),
        StepEnded(
            step=1,
            stage=0,
            loss=math.nan,
            grad_norm=math.inf,
            metrics={evil: 1.0, "event": 2.0, "exc_info": 3.0, "step": 4.0},
            duration_s=0.1,
        ),
        StageFailed(stage=0, error=evil, traceback=f"Traceback\n  {evil}\nValueError: {evil}"),
    ]
    runner = ReplayRunner([hook])
    anyio.run(runner.replay, events)
    assert runner.errors == 0
    text = path.read_text()
    assert "\x1b" not in text and "\x07" not in text
    assert "run=\\x1b[2J\\x1b]0;owned\\x07" in text
    progress = next(line for line in text.splitlines() if "progress" in line)
    assert "loss=nan" in progress and "grad_norm=inf" in progress
    assert "step=1/3" in progress  # a reported "step" never replaces the step
    assert "\\x1b[2J\\x1b]0;owned\\x07=1.0" in progress


def test_step_merger_checks_the_run_and_never_freezes() -> None:
    from evtrain.events import StepEnded
    from evtrain.run_state import RunState
    from evtrain.steps import MAX_STEP_JUMP, StepCount, StepMerger

    state = RunState()
    merger = StepMerger(lambda: state)
    lone = StepEnded(step=10**12, stage=0, loss=1.0)
    assert [m.step for m in merger.add(lone)] == [10**12]  # no run known: it may be real
    # ... but it does not hide the steps that follow.
    assert [m.step for m in merger.add(StepEnded(step=5, stage=0, loss=1.0))] == [5]
    assert merger.add(StepEnded(step=5, stage=0, loss=1.0)) == []  # a late duplicate

    state.update(two_stage_run())
    merger.reset()
    for absurd in (
        StepEnded(step=10**12, stage=0, run_id="r1"),
        StepEnded(step=3, stage=9, run_id="r1"),
        StepEnded(step=3, stage=0, run_id="another"),
    ):
        assert merger.add(absurd) == []
    assert merger.ignored.total == 3
    assert merger.add(StepEnded(step=3, stage=1, run_id="r1")) == []
    assert [m.step for m in merger.add(StepEnded(step=3, stage=0, run_id="r1"))] == [3]

    count = StepCount()
    assert [count.advance(s) for s in (1, 2, 2, 10**12, 3, 4)] == [1, 1, 0, MAX_STEP_JUMP, 1, 1]


def test_step_merger_waits_for_every_replica_and_adds_nothing_up() -> None:
    from evtrain.events import StepEnded
    from evtrain.run_state import RunState
    from evtrain.steps import StepMerger

    def event(step: int, stage: int, replica: int, duration: float = 0.1) -> StepEnded:
        loss = 0.5 if stage == 1 else None
        return StepEnded(
            step=step,
            stage=stage,
            replica=replica,
            loss=loss,
            samples=32,
            duration_s=duration,
            run_id="r1",
        )

    state = RunState()
    merger = StepMerger(lambda: state)
    # Before the run is known replica 0's stages decide (D is not known yet).
    assert merger.add(event(1, 0, 1)) == []
    (first,) = merger.add(event(1, 1, 0))  # no stage count either: the loss completes it
    assert sorted(first.events) == [(0, 1), (1, 0)]
    state.update(two_stage_run(data_parallel=2))
    merger.reset()
    for place in ((1, 0), (1, 1), (0, 0)):
        assert merger.add(event(2, *place)) == []
    assert merger.add(event(2, 0, 2)) == []  # a replica the run does not have
    assert merger.ignored.total == 1
    (merged,) = merger.add(event(2, 0, 1, duration=0.3))
    assert sorted(merged.events) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sorted(merged.stages) == [0, 1] and all(e.replica == 0 for e in merged.stages.values())
    assert {r: sorted(s) for r, s in merged.replicas().items()} == {1: [0, 1]}
    assert (merged.samples, merged.loss, merged.duration_s) == (32, 0.5, 0.3)
    assert merger.add(event(2, 1, 1)) == []  # a late duplicate


def test_logging_hook_says_a_stage_error_once_and_consequences_briefly(tmp_path: Path) -> None:
    import anyio

    from evtrain.events import RunEnded, RunStarted, StageFailed
    from evtrain.tools.replay import ReplayRunner

    path = tmp_path / "train.log"
    hook = ConsoleLog(path=path)
    cause = "RuntimeError: injected failure at step 3"
    gloo = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:1"
    events = [
        RunStarted(
            name="r", num_stages=2, num_microbatches=2, schedule="1f1b", max_steps=9, batch_size=4
        ),
        StageFailed(stage=1, step=3, error=cause, traceback=f"Traceback\n  layer\n{cause}"),
        StageFailed(stage=0, step=3, error=gloo, traceback=f"Traceback\n  deep in torch\n{gloo}"),
        RunEnded(status="failed", step=2, reason=f"stage 1 failed at step 3: {cause}"),
    ]
    runner = ReplayRunner([hook])
    anyio.run(runner.replay, events)
    assert runner.errors == 0
    lines = path.read_text().splitlines()
    assert sum("injected failure" in line for line in lines) == 1, lines
    consequence = next(line for line in lines if "peer's failure" in line)
    assert "stage=0" in consequence and "deep in torch" not in consequence
    assert any("run ended" in line and "status=failed" in line for line in lines)


def test_a_signal_ends_the_prometheus_hook_without_its_wait_for_a_last_scrape(
    bus: BusAddress, procs: Any, tmp_path: Path
) -> None:
    """Scraped during a run that then ended, the exporter waits up to MAX_LINGER (30 s)
    for a scrape that shows the end; SIGTERM cuts that wait short."""
    stderr = tmp_path / "hook.err"
    hooks = [{"type": "prometheus", "port": 0, "dir": str(tmp_path)}, {"type": "logging"}]
    with stderr.open("w") as err:
        hook = procs.evtrain(
            "--log-format", "json", "hook", "--hooks", json.dumps(hooks), "--bus", str(bus),
            stderr=err,
        )  # fmt: skip
        lines = json_lines(wait_for_text(stderr, "hooks attached"))
        port = next(line["port"] for line in lines if line["event"] == "serving prometheus metrics")
        scrape = urllib.request.Request(
            f"http://127.0.0.1:{port}/metrics", headers={"User-Agent": "Prometheus/2.42.0"}
        )
        with urllib.request.urlopen(scrape, timeout=10) as answer:
            assert answer.status == 200  # Prometheus scrapes it from here on
        fake = procs.start(*fake_args(bus, steps=5, stages=2))
        assert fake.wait(timeout=30) == 0
        wait_for_text(stderr, '"run ended"')  # the exporter handled RunEnded with it
        signalled = time.monotonic()
        hook.send_signal(signal.SIGTERM)
        hook.wait(timeout=60)
        took = time.monotonic() - signalled
    assert hook.returncode == 0, stderr.read_text()[-2000:]
    assert took < 15, (took, stderr.read_text()[-2000:])
    assert "hook teardown cut short by the signal" in stderr.read_text()
