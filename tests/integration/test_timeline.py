"""The pipeline timeline: recorded spans -> Chrome/Perfetto trace and PNG."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from evtrain.bus.address import BusAddress
from evtrain.bus.broker import Broker
from evtrain.bus.publisher import Publisher
from evtrain.errors import UsageError
from evtrain.events import (
    MicrobatchBackward,
    MicrobatchForward,
    MicrobatchWait,
    RunEnded,
    RunStarted,
    StepEnded,
)
from evtrain.stages.simulator import simulate
from evtrain.tools.timeline import (
    KIND_COLOURS,
    StepRange,
    chrome_trace,
    draw_timeline,
    load_run,
    parse_steps,
    render_png,
    spans_from_simulation,
    stage_busy_fractions,
)

if TYPE_CHECKING:
    from tests.conftest import ProcessGroup

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def x_events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


# ------------------------------------------------------------ from the simulator


@pytest.mark.parametrize(("schedule", "stages", "microbatches"), [("1f1b", 4, 8), ("gpipe", 3, 4)])
def test_trace_matches_the_simulated_timeline(
    schedule: str, stages: int, microbatches: int
) -> None:
    result = simulate(schedule, stages, microbatches, forward_cost=1.0, backward_cost=2.0)
    # One cost unit = 1 ms, so the trace's microseconds are units * 1000.
    trace = chrome_trace(spans_from_simulation(result, seconds_per_unit=1e-3), title="sim")
    json.dumps(trace)  # valid JSON as written
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "sim"}} in meta
    thread_names = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert thread_names == {s: f"stage {s}" for s in range(stages)}

    events = x_events(trace)
    assert min(e["ts"] for e in events) == 0
    for stage, timeline in enumerate(result.timelines):
        mine = sorted((e for e in events if e["tid"] == stage), key=lambda e: e["ts"])
        assert all(e["pid"] == 0 for e in mine)
        assert [e["name"] for e in mine] == [
            f"{'F' if sp.kind == 'forward' else 'B'}{sp.microbatch}" for sp in timeline
        ]
        assert [e["cat"] for e in mine] == [sp.kind for sp in timeline]
        assert [e["ts"] for e in mine] == pytest.approx([sp.start * 1000 for sp in timeline])
        assert [e["dur"] for e in mine] == pytest.approx(
            [(sp.end - sp.start) * 1000 for sp in timeline]
        )
        assert Counter(e["name"][0] for e in mine) == {"F": microbatches, "B": microbatches}


def test_a_simulated_gradient_reduction_is_a_reduce_wait() -> None:
    result = simulate("1f1b", 2, 4, reduce_grads=True, reduce_cost=0.5)
    spans = spans_from_simulation(result)
    reduces = [s for s in spans if s.op == "reduce"]
    assert [(s.stage, s.kind, s.microbatch, s.label) for s in reduces] == [
        (stage, "wait", -1, "wait reduce") for stage in (1, 0)
    ]
    assert all(s.duration == pytest.approx(0.5e-3) for s in reduces)
    names = Counter(e["name"] for e in x_events(chrome_trace(spans)))
    assert names["wait reduce"] == 2


def test_busy_fractions_equal_the_simulated_bubble() -> None:
    result = simulate("1f1b", 4, 8)
    fractions = stage_busy_fractions(spans_from_simulation(result))
    for stage, idle in enumerate(result.stage_idle_fraction):
        assert fractions[stage]["idle"] == pytest.approx(idle)
        assert fractions[stage]["wait"] == 0
    mean_idle = sum(f["idle"] for f in fractions.values()) / 4
    assert mean_idle == pytest.approx(3 / 11)  # (P-1)/(M+P-1)


def test_png_shows_the_bubble_white(tmp_path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import to_rgb
    from matplotlib.figure import Figure

    result = simulate("1f1b", 4, 8)
    spans = spans_from_simulation(result)  # 1 unit = 1 ms
    path = render_png(spans, tmp_path / "sim.png", title="1F1B")
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000

    # Draw the same onto our own canvas and read pixels back at known places.
    fig = Figure(figsize=(10, 4), dpi=100)
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    draw_timeline(ax, spans)
    canvas.draw()
    pixels = np.asarray(canvas.buffer_rgba())
    height = int(fig.bbox.height)

    def colour_at(ms: float, row: float) -> tuple[float, float, float]:
        x, y = ax.transData.transform((ms, row))
        r, g, b, _ = pixels[height - round(y), round(x)]
        return (r / 255, g / 255, b / 255)

    def close(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
        return all(abs(p - q) < 0.06 for p, q in zip(a, b, strict=True))

    # Stage 3 idles for its first 3 units (the warm-up bubble), then forwards F0.
    assert close(colour_at(1.5, 3.2), (1, 1, 1))
    assert close(colour_at(3.5, 3.2), to_rgb(KIND_COLOURS["forward"]))
    # Stage 0 forwards from the start; its B0 comes at 7..8.
    assert close(colour_at(0.5, 0.2), to_rgb(KIND_COLOURS["forward"]))
    assert close(colour_at(7.5, 0.2), to_rgb(KIND_COLOURS["backward"]))
    # Between its warm-up forwards and B0, stage 0 is idle.
    assert close(colour_at(5.5, 0.2), (1, 1, 1))


# ----------------------------------------------------------------- step ranges


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10:12", StepRange(10, 12)),
        ("10:", StepRange(10, None)),
        (":12", StepRange(None, 12)),
        ("7", StepRange(7, 7)),
        (" 3 : 4 ", StepRange(3, 4)),
    ],
)
def test_parse_steps(text: str, expected: StepRange) -> None:
    steps = parse_steps(text)
    assert steps == expected
    assert 12 in StepRange(10, 12) and 13 not in StepRange(10, 12)


@pytest.mark.parametrize("text", ["", "a:b", "5:2", "-1:3", "1:2:3"])
def test_parse_steps_rejects_nonsense(text: str) -> None:
    with pytest.raises(UsageError, match="--steps"):
        parse_steps(text)


# ------------------------------------------- a real bus and the real recorder


STAGES, MICROBATCHES, STEPS = 2, 4, 4


def publish_run(publisher: Publisher, t0: float) -> None:
    """A 2-stage 1F1B run of 4 steps as the stages would publish it.

    Compute follows the simulator's timeline (1 unit = 1 ms); before each
    forward on stage 1 and each backward on stage 0 the stage waits 0.5 ms.
    """
    publisher.publish(
        RunStarted(
            name="synthetic",
            num_stages=STAGES,
            num_microbatches=MICROBATCHES,
            schedule="1f1b",
            max_steps=STEPS,
            batch_size=8,
        )
    )
    result = simulate("1f1b", STAGES, MICROBATCHES)
    for step in range(1, STEPS + 1):
        base = t0 + (step - 1) * 0.1
        for stage, timeline in enumerate(result.timelines):
            for span in timeline:
                start, end = base + span.start * 1e-3, base + span.end * 1e-3
                common = dict(step=step, stage=stage, microbatch=span.microbatch)
                waits = (stage == 1 and span.kind == "forward") or (
                    stage == 0 and span.kind == "backward"
                )
                if waits:
                    op = "recv_act" if span.kind == "forward" else "recv_grad"
                    publisher.publish(
                        MicrobatchWait(**common, start=start - 5e-4, end=start, op=op)
                    )
                kind = MicrobatchForward if span.kind == "forward" else MicrobatchBackward
                publisher.publish(kind(**common, start=start, end=end))
            publisher.publish(StepEnded(step=step, stage=stage, loss=1.0 / step))
    publisher.publish(RunEnded(status="completed", step=STEPS))


def wait_until_attached(proc: subprocess.Popen[str], timeout: float = 30.0) -> None:
    """Until the hook process logged that its hooks are attached (ready for events).

    Its stderr keeps being drained in a thread so the process never blocks on it.
    """
    attached = threading.Event()
    lines: list[str] = []

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "hooks attached" in line:
                attached.set()

    threading.Thread(target=pump, daemon=True).start()
    if not attached.wait(timeout):
        proc.kill()
        pytest.fail("the hook did not attach:\n" + "".join(lines))


@pytest.fixture
def recorded_run(ipc_bus: BusAddress, procs: ProcessGroup, tmp_path: Path) -> Path:
    """A run directory whose events.jsonl the real recorder hook wrote from the bus."""
    run_dir = tmp_path / "run"
    with Broker(ipc_bus):
        recorder = procs.evtrain(
            "hook", "recorder", "--bus", str(ipc_bus), "-o", f"dir={run_dir}", "--exit-on-run-end"
        )
        wait_until_attached(recorder)
        with Publisher(ipc_bus.endpoint("events_in"), source="stage/x") as publisher:
            publish_run(publisher, t0=time.time())
        try:
            recorder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the recorder did not exit on run end")
    assert recorder.returncode == 0
    assert (run_dir / "events.jsonl").is_file()
    return run_dir


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evtrain", "timeline", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_recorded_run_to_trace_and_png(recorded_run: Path, tmp_path: Path) -> None:
    recorded = load_run(recorded_run)
    assert recorded.title == "synthetic: 2 stages, 4 microbatches, 1f1b"
    assert len(recorded.spans) == STEPS * (2 * 2 * MICROBATCHES + 2 * MICROBATCHES)

    trace_path, png_path = tmp_path / "trace.json", tmp_path / "pic.png"
    done = run_cli(
        str(recorded_run), "-o", str(trace_path), "--png", str(png_path), "--steps", "2:3"
    )
    assert done.returncode == 0, done.stderr
    assert "steps 2..3" in done.stdout

    trace = json.loads(trace_path.read_text())
    events = x_events(trace)
    assert {e["args"]["step"] for e in events} == {2, 3}
    assert min(e["ts"] for e in events) == 0
    names = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    assert names == {0: "stage 0", 1: "stage 1"}
    for stage, wait_name in ((0, "wait recv_grad"), (1, "wait recv_act")):
        per_step = Counter(e["name"] for e in events if e["tid"] == stage)
        expected = {f"F{m}": 2 for m in range(MICROBATCHES)}
        expected |= {f"B{m}": 2 for m in range(MICROBATCHES)}
        expected[wait_name] = 2 * MICROBATCHES
        assert per_step == expected
        for e in events:
            if e["tid"] == stage and e["cat"] == "wait":
                assert e["dur"] == pytest.approx(500, abs=1)
    # Step 2's first span on stage 0 is F0 at its very start.
    first = min(events, key=lambda e: (e["ts"], e["tid"]))
    assert (first["name"], first["tid"], first["args"]["step"]) == ("F0", 0, 2)

    data = png_path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


@pytest.mark.anyio
async def test_data_parallel_run_has_a_track_per_stage_process(
    bus: BusAddress, procs: ProcessGroup, tmp_path: Path
) -> None:
    """2 stages x 2 replicas, recorded from the bus: four tracks, each with its reduce waits."""
    from helpers.hook_helpers import run_hooks
    from matplotlib.figure import Figure

    from evtrain.exporters import EventRecorder

    run_dir = tmp_path / "run"
    steps = 3
    await run_hooks(
        [EventRecorder(dir=run_dir)], bus, procs, steps=steps, dp=2, spans=True, run_dir=run_dir
    )
    recorded = load_run(run_dir)
    assert recorded.title == "fake: 2 stages x 2 replicas, 4 microbatches, 1f1b"
    trace = chrome_trace(recorded.spans, title=recorded.title)
    names = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    places = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}  # replicas of a stage side by side
    assert names == {tid: f"stage {s} · replica {d}" for tid, (s, d) in places.items()}
    events = x_events(trace)
    for tid, (stage, replica) in places.items():
        mine = [e for e in events if e["tid"] == tid]
        assert {e["args"]["replica"] for e in mine} == {replica}
        expected = {f"{kind}{m}": steps for kind in "FB" for m in range(2)}
        expected["wait reduce"] = steps  # the fake run's 2 microbatches, then the reduction
        if stage == 1:
            expected["wait recv_act"] = 2 * steps
        assert Counter(e["name"] for e in mine) == expected
        reduces = [e for e in mine if e["name"] == "wait reduce"]
        assert all(e["args"]["op"] == "reduce" and e["args"]["microbatch"] == -1 for e in reduces)
    figure = Figure()
    ax = figure.add_subplot()
    draw_timeline(ax, recorded.spans)
    assert [t.get_text() for t in ax.get_yticklabels()] == list(names.values())
    assert set(stage_busy_fractions(recorded.spans)) == {0, 1}

    done = run_cli(str(run_dir), "-o", str(tmp_path / "trace.json"))
    assert done.returncode == 0, done.stderr
    written = json.loads((tmp_path / "trace.json").read_text())
    assert len({e["tid"] for e in x_events(written)}) == 4


def test_truncated_last_line_is_tolerated(recorded_run: Path) -> None:
    events = recorded_run / "events.jsonl"
    complete = load_run(recorded_run).spans
    with events.open("a") as fh:
        fh.write('{"type": "microbatch.forward", "v": 1, "step": 9, "sta')
    assert load_run(recorded_run).spans == complete
    done = run_cli(str(recorded_run))
    assert done.returncode == 0, done.stderr
    trace = json.loads((recorded_run / "timeline.json").read_text())
    assert len(x_events(trace)) == len(complete)


def test_clear_errors(tmp_path: Path) -> None:
    done = run_cli(str(tmp_path / "nowhere"))
    assert done.returncode == 2
    assert "run directory not found" in done.stderr

    done = run_cli(str(tmp_path))
    assert done.returncode == 2
    assert "no events.jsonl" in done.stderr and "microbatch_spans='all'" in done.stderr
    assert "Traceback" not in done.stderr

    (tmp_path / "events.jsonl").write_text(
        json.dumps({"type": "run.ended", "v": 1, "status": "completed"}) + "\n"
    )
    with pytest.raises(UsageError, match=r"no microbatch spans.*recorder"):
        load_run(tmp_path)


def test_step_filter_that_matches_nothing(recorded_run: Path) -> None:
    done = run_cli(str(recorded_run), "--steps", "50:60")
    assert done.returncode == 2
    assert "recorded steps: 1..4" in done.stderr


HOSTILE_LINES = (
    '{"type": "microbatch.forward", "v": 1, "step": 1, "stage": 0, "microbatch": 0, '
    '"start": 1e999, "end": 1.0}',  # a number JSON cannot hold as a float
    '{"type": "microbatch.forward", "v": 1, "step": -1, "stage": 0, "microbatch": 0, '
    '"start": 1.0, "end": 2.0}',
    '{"type": "microbatch.backward", "v": 1, "step": 1, "stage": 99999, "microbatch": 0, '
    '"start": 1.0, "end": 2.0}',
    '{"type": "microbatch.wait", "v": 1, "step": 1, "stage": 0, "microbatch": 0, '
    '"start": "soon", "end": 2.0}',
    '{"type": "run.started", "v": 1, "name": "x", "num_stages": 0}',
    "[1, 2, 3]",
    "\x1b[2J garbage \x00",
    '{"type": "step.ended", "v": 7, "step": 1, "stage": 0}',
)


def test_hostile_lines_in_a_recording_are_skipped_and_counted(recorded_run: Path) -> None:
    from structlog.testing import capture_logs

    from evtrain.tools.replay import read_events as replay_events

    events = recorded_run / "events.jsonl"
    complete = load_run(recorded_run)
    good = events.read_text()
    events.write_text("\n".join(HOSTILE_LINES * 50) + "\n" + good + "\n".join(HOSTILE_LINES))
    with capture_logs() as logs:
        recorded = load_run(recorded_run)
    assert recorded.spans == complete.spans and recorded.title == complete.title
    skipped = {
        e["kind"]: e["lines"] for e in logs if e["event"] == "skipped lines that are not events"
    }
    # The step.ended line is not even decoded: a timeline does not ask for that type.
    assert sum(skipped.values()) == 51 * (len(HOSTILE_LINES) - 1)
    assert skipped["not JSON"] == 2 * 51  # 1e999 is no float JSON decoders accept
    assert skipped["microbatch.backward: invalid $.stage"] == 51
    assert len(logs) <= len(HOSTILE_LINES)  # once per kind, not once per line
    with capture_logs() as logs:
        replayed = list(replay_events(events))
    assert len(replayed) == len(good.splitlines())
    assert sum(e["lines"] for e in logs) == 51 * len(HOSTILE_LINES)
    done = run_cli(str(recorded_run))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "\x1b" not in done.stderr
