"""One run per run directory, with real ``evtrain launch`` runs.

A second run into a directory that holds a run is refused (one line, exit 2,
nothing touched) until it is told to ``--overwrite`` or to ``--resume``;
``--resume auto`` starts a fresh directory at step 0 and continues a used
one from its latest committed checkpoint, and the run's files then read as
one history: metrics, timeline and replay show every step once, from the
launch whose weights went on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from helpers.launch_helpers import run_launch, write_spec

from evtrain.checkpoint import latest_committed, list_checkpoints
from evtrain.errors import UsageError
from evtrain.events import RunStarted, StepEnded
from evtrain.exporters import MetricsLog
from evtrain.exporters.recorder import read_recording
from evtrain.hooks.checkpoint import CheckpointHook
from evtrain.launcher import Launcher, LaunchOptions
from evtrain.launcher.run_record import read_run_record, without_redone
from evtrain.tools.replay import replay
from evtrain.tools.timeline import load_run

pytestmark = pytest.mark.slow

MICROBATCHES = 4
STAGES = 2


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_of(path: Path) -> list[int]:
    """The step numbers of a metrics log's step lines, in file order."""
    return [r["step"] for r in lines(path) if r["type"] == "step"]


def run_starts(run: Path) -> list[RunStarted]:
    return [m for m in read_recording(run / "events.jsonl") if isinstance(m, RunStarted)]


def launch_ok(spec: Path, *args: str, marker: str) -> str:
    proc, leftovers = run_launch(spec, "--quiet", *args, marker=marker, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert leftovers == []
    return proc.stdout + proc.stderr


def test_a_directory_holding_a_run_is_refused_until_overwrite(tmp_path: Path, marker: str) -> None:
    hooks = [{"type": "metrics"}, {"type": "recorder"}, {"type": "checkpoint", "on_stop": True}]
    spec = write_spec(tmp_path, steps=2, hooks=hooks)
    run = tmp_path / "run"
    launch_ok(spec, marker=marker)
    first = read_run_record(run)
    assert first is not None
    kept = {name: (run / name).read_bytes() for name in ("run.json", "metrics.jsonl")}
    events = (run / "events.jsonl").read_bytes()

    proc, leftovers = run_launch(spec, "--quiet", "--steps", "3", marker=marker, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert leftovers == []
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    assert said == [
        f"evtrain launch: error: run directory {run} holds run {first['run_id']} "
        "(completed, 2 steps): --resume auto continues it, --overwrite starts it over, "
        "--run-dir DIR starts a new run elsewhere"
    ]
    # Nothing of the old run changed, nothing new was started or written.
    assert {name: (run / name).read_bytes() for name in kept} == kept
    assert (run / "events.jsonl").read_bytes() == events
    assert [p.name for p in (run / "launches").iterdir()] == [first["run_id"]]

    launch_ok(spec, "--overwrite", "--steps", "3", marker=marker)
    record = read_run_record(run)
    assert record is not None and record["run_id"] != first["run_id"]
    assert record["status"] == "completed" and record["previous_run"] is None
    assert steps_of(run / "metrics.jsonl") == [1, 2, 3]
    assert [s.run_id for s in run_starts(run)] == [record["run_id"]]
    assert [c.step for c in list_checkpoints(run)] == [3]  # the old step-2 is gone
    assert [p.name for p in (run / "launches").iterdir()] == [record["run_id"]]


def test_overwrite_and_resume_exclude_each_other(tmp_path: Path) -> None:
    spec = write_spec(tmp_path)
    launcher = Launcher(LaunchOptions(spec=str(spec), overwrite=True, resume="auto"))
    with pytest.raises(UsageError, match="--overwrite starts the run over"):
        launcher.prepare()


def test_resume_auto_starts_fresh_then_continues_the_run_as_one_history(
    tmp_path: Path, marker: str
) -> None:
    # The first launch fails in step 5 after the checkpoint of step 3 committed:
    # step 4 is in the logs, but no checkpoint holds it.
    hooks = [
        {"type": "metrics"},
        {"type": "recorder"},
        {"type": "checkpoint", "every_steps": 3, "keep_last": 5},
    ]
    spec = write_spec(
        tmp_path, steps=6, fail_at_step=5, marker=str(tmp_path / "failed-once"), hooks=hooks
    )
    run = tmp_path / "run"
    args = ("--quiet", "--resume", "auto", "--spans", "all")

    failed, leftovers = run_launch(spec, *args, marker=marker, timeout=90)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert leftovers == []
    first = read_run_record(run)
    assert first is not None and first["start_step"] == 0 and first["resume"] is None
    latest = latest_committed(run)
    assert latest is not None and latest.step == 3
    assert 4 in steps_of(run / "metrics.jsonl")

    launch_ok(spec, *args[1:], marker=marker)
    second = read_run_record(run)
    assert second is not None and second["status"] == "completed"
    assert second["start_step"] == 3 and second["resume"] == str(latest.path)
    assert second["previous_run"]["status"] == "failed"
    assert [s.start_step for s in run_starts(run)] == [0, 3]

    # Every step once, in order; steps 4-6 from the launch that went on.
    assert steps_of(run / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    current = list(without_redone(run / "events.jsonl", read_recording(run / "events.jsonl")))
    ended = {(e.step, e.stage): e.run_id for e in current if isinstance(e, StepEnded)}
    assert sorted(ended) == [(s, st) for s in range(1, 7) for st in range(STAGES)]
    assert {ended[(4, st)] for st in range(STAGES)} == {second["run_id"]}
    assert {ended[(3, st)] for st in range(STAGES)} == {first["run_id"]}

    spans = load_run(run).spans
    forwards = [s for s in spans if s.kind == "forward" and s.step == 4]
    assert len(forwards) == STAGES * MICROBATCHES
    resumed_at = run_starts(run)[1].ts
    assert min(s.start for s in forwards) > resumed_at

    out = tmp_path / "replayed"
    anyio.run(lambda: replay(run, [MetricsLog()], out_dir=out))
    assert steps_of(out / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]

    # The same command once more: the run has trained its steps, nothing starts.
    recorded = (run / "run.json").read_bytes()
    said = launch_ok(spec, *args[1:], marker=marker)
    assert f"the run in {run} has trained its 6 steps" in said
    assert (run / "run.json").read_bytes() == recorded

    # A replayed checkpoint hook (one that would keep only the last) leaves the
    # recorded run's checkpoints as they are, one that never got committed too.
    newest = max(list_checkpoints(run), key=lambda c: c.step)
    (newest.path / "MANIFEST.json").unlink()

    def checkpoints() -> list[tuple[str, int, int]]:
        files = [(f, f.stat()) for f in (run / "checkpoints").rglob("*")]
        return sorted((str(f.relative_to(run)), st.st_size, st.st_mtime_ns) for f, st in files)

    before = checkpoints()
    assert before
    hook = CheckpointHook(every_steps=3, keep_last=1)
    anyio.run(lambda: replay(run, [hook], out_dir=tmp_path / "replayed-checkpoints"))
    assert checkpoints() == before


def test_a_launch_reusing_a_run_id_sets_the_earlier_reports_aside(
    tmp_path: Path, marker: str
) -> None:
    """A failed launch's reports under the same --run-id would read as the resumed
    launch's own (a failed stage, a failure report): they are moved out of its way."""
    hooks = [{"type": "checkpoint", "every_steps": 2}]
    spec = write_spec(
        tmp_path, steps=4, fail_at_step=3, marker=str(tmp_path / "failed-once"), hooks=hooks
    )
    failed, leftovers = run_launch(spec, "--quiet", "--run-id", "same", marker=marker, timeout=90)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert leftovers == []
    out = launch_ok(spec, "--run-id", "same", "--resume", "latest", marker=marker)
    launches = tmp_path / "run" / "launches"
    assert f"run id same was used here before: its launch reports moved to {launches}/same.1" in (
        out
    )
    assert sorted(p.name for p in launches.iterdir()) == ["same", "same.1"]
    assert (launches / "same.1" / "failure.txt").exists()
    assert not (launches / "same" / "failure.txt").exists()
    record = read_run_record(tmp_path / "run")
    assert record is not None and (record["status"], record["steps"]) == ("completed", 4)
