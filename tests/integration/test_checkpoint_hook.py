"""Checkpoints and evaluations land where asked, with real launches.

Real `evtrain launch` runs (broker, stage workers, launcher-managed hooks):
periodic checkpoints on exact steps although the coordinator lags far
behind, evaluations on exact steps and epoch ends, best checkpoints that
re-evaluate to their recorded metric, the final commit seen by every hook,
a dropped acknowledgement healed, and a coordinator killed mid-run and at
the last steps that still commits everything.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.hook_helpers import hosted_hooks
from helpers.launch_helpers import launch_cmd, launch_env, marked_pids, run_launch
from helpers.launch_helpers import write_eval_spec as write_spec

from evtrain.checkpoint import latest_committed, list_checkpoints, read_manifest
from evtrain.checkpoint.loader import read_model_tensors
from evtrain.data import eval_microbatches
from evtrain.errors import UsageError
from evtrain.hooks.checkpoint import CheckpointHook
from evtrain.hooks.registry import build_hook_from_spec as build_hook
from evtrain.spec import load_job
from evtrain.stages.job_data import job_data
from evtrain.stages.partition import build_full_model

pytestmark = pytest.mark.slow


def events(run: Path) -> list[dict[str, Any]]:
    """What the launcher-managed recorder hook saw, in order."""
    lines = (run / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def of_type(recorded: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in recorded if e.get("type") == kind]


def reevaluate(spec: Path, ckpt: Path) -> dict[str, float]:
    """The job's eval metrics of a checkpoint's weights, computed in this process.

    The same microbatches in the same order and the same float64 sums as the
    pipeline's evaluation, so the result is the same to the last bit.
    """
    job = load_job(spec)
    model = build_full_model(job)
    state = read_model_tensors(ckpt)
    model.load_state_dict({k: state[k] for k in model.state_dict()})
    model.eval()
    data = job_data(job).eval_tensors()
    assert data is not None
    sums: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        plan = eval_microbatches(data.num_samples, job.effective_eval_batch_size, 4)
        for batch in plan:
            for r in batch:
                out = model(data.inputs[r.start : r.stop])
                target = data.targets[r.start : r.stop]
                values = {"loss": job.loss_fn(out, target)}
                values.update({name: fn(out, target) for name, fn in job.metrics.items()})
                for name, value in values.items():
                    weighted = torch.as_tensor(value).double() * len(r)
                    sums[name] = weighted if name not in sums else sums[name] + weighted
    return {k: float(v) / data.num_samples for k, v in sums.items()}


def no_error_lines(output: str) -> None:
    markers = ("[error", "[critical", "Traceback")
    bad = [line for line in output.splitlines() if any(m in line for m in markers)]
    assert not bad, "\n".join(bad)


def test_options_are_validated() -> None:
    with pytest.raises(UsageError, match="mode"):
        CheckpointHook(best_metric="loss", mode="sideways")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="every_steps"):
        CheckpointHook(every_steps=0)
    with pytest.raises(UsageError, match="on_stop"):
        build_hook({"type": "checkpoint", "on_stop": "maybe"})
    hook = build_hook({"type": "checkpoint", "every_steps": "7", "on_stop": "true"})
    assert isinstance(hook, CheckpointHook) and hook.every_steps == 7 and hook.on_stop


def test_exact_steps_best_weights_and_closed_books_with_a_lagging_coordinator(
    tmp_path: Path, marker: str
) -> None:
    """The coordinator reacts to each step 50 ms late (200+ steps behind by the end)."""
    hooks = [
        {
            "type": "helpers.launch_hooks:LaggingCheckpoint",
            "lag_s": 0.05,
            "every_steps": 7,
            "best_metric": "loss",
            "on_stop": True,
        },
        {"type": "eval_every", "every": 5},
        {"type": "recorder"},
    ]
    spec = write_spec(tmp_path, steps=30, hooks=hooks)
    proc, leftovers = run_launch(spec, marker=marker, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert leftovers == []
    no_error_lines(output)
    run = tmp_path / "run"
    recorded = events(run)
    # Evaluations on exactly the steps asked for, the last step's included.
    assert [e["step"] for e in of_type(recorded, "eval.ended")] == [5, 10, 15, 20, 25, 30]
    committed = [i for i in list_checkpoints(run) if i.committed]
    steps = [i.step for i in committed]
    assert {7, 14, 21, 28, 30} <= set(steps), steps
    for info in committed:
        assert read_manifest(info.path).step == info.step
    # Best means best: each best checkpoint holds exactly the weights evaluated.
    losses = {e["step"]: e["metrics"]["loss"] for e in of_type(recorded, "eval.ended")}
    best = [i for i in committed if i.metric is not None]
    assert best, [i.reason for i in committed]
    for info in best:
        assert info.metric == losses[info.step]
        assert reevaluate(spec, info.path)["loss"] == info.metric, info.path.name
    final = min(losses.values())
    assert any(i.metric == final for i in best), "the best evaluation has no checkpoint"
    # The books are closed before the run ends: the recorder (which exits on
    # run.ended) saw the commit of the last step, and no checkpoint failed.
    kinds = [e["type"] for e in recorded]
    last_commit = max(i for i, k in enumerate(kinds) if k == "checkpoint.committed")
    assert recorded[last_commit]["step"] == 30
    assert last_commit < kinds.index("run.ended")
    assert of_type(recorded, "checkpoint.failed") == []
    latest = latest_committed(run)
    assert latest is not None and latest.step == 30


def test_the_plan_applies_from_the_first_step_of_a_short_run(tmp_path: Path, marker: str) -> None:
    """Stage 0 holds boundary 0 for the plan: nothing is missed, however fast the run."""
    hooks = [{"type": "checkpoint", "every_steps": 1, "on_stop": True}]
    spec = write_spec(tmp_path, steps=3, hooks=hooks)
    proc, leftovers = run_launch(spec, marker=marker, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert leftovers == []
    committed = [i.step for i in list_checkpoints(tmp_path / "run") if i.committed]
    assert committed == [1, 2, 3]


def test_epoch_end_evaluations_and_a_dropped_acknowledgement_healed(
    tmp_path: Path, marker: str
) -> None:
    """256 samples in batches of 32: an epoch ends with every 8th step."""
    hooks = [{"type": "eval_every", "every_epochs": 1}, {"type": "recorder"}]
    # Long enough (about 2 s) for the issuer's retry, a second after the order.
    spec = write_spec(tmp_path, steps=24, hooks=hooks, delay=0.02)
    proc, leftovers = run_launch(spec, marker=marker, timeout=120, EVTRAIN_DROP_FIRST_ACK="1")
    assert leftovers == []
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    recorded = events(tmp_path / "run")
    epochs = [(e["epoch"], e["step"]) for e in of_type(recorded, "epoch.ended")]
    assert epochs == [(0, 8), (1, 16), (2, 24)]
    assert [e["step"] for e in of_type(recorded, "eval.ended")] == [8, 16, 24]
    # Stage 1 never published its first acknowledgement; the issuer's retry got it again.
    assert "acknowledgement dropped" in output
    acks = of_type(recorded, "command.acked")
    order = [a for a in acks if a["command"] == "cmd.evaluate"]
    assert {a["stage"] for a in order} == {0, 1}
    assert "not acknowledged" not in output


def _checkpoint_hook_pid(marker: str) -> int | None:
    """The process running the checkpoint hook: on its own, or hosting it among built-ins."""
    for pid in marked_pids(marker):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "checkpoint" in hosted_hooks(cmdline):
            return pid
    return None


def _step_reached(run: Path) -> int:
    """The highest step any stage reported so far (from the stage status files)."""
    best = 0
    for report in run.glob("launches/*/attempt-*/rank-*.json"):
        try:
            best = max(best, int(json.loads(report.read_text()).get("step", 0)))
        except (OSError, ValueError):
            continue
    return best


def _wait(predicate: Any, proc: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the launch ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_coordinator_killed_mid_run_and_at_the_last_steps_commits_everything(
    tmp_path: Path, marker: str
) -> None:
    steps = 40
    # The coordinator alone is killed: the recorder, in a process of its own, witnesses
    # every commit live (in a shared host it would die and restart with it).
    checkpoint = {"type": "checkpoint", "every_steps": 10, "on_stop": True, "isolate": True}
    hooks = [checkpoint, {"type": "recorder"}]
    spec = write_spec(tmp_path, steps=steps, hooks=hooks, delay=0.03)
    run = tmp_path / "run"
    proc = subprocess.Popen(
        launch_cmd(spec),
        env=launch_env(marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    killed: list[int] = []
    try:
        for at in (15, steps - 2):
            _wait(lambda at=at: _step_reached(run) >= at, proc, f"step {at}")
            # After the first kill, the launcher's restart of the hook must be up first.
            pid = _wait(
                lambda: (p := _checkpoint_hook_pid(marker)) not in (None, *killed) and p,
                proc,
                "the checkpoint hook",
            )
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "completed" in out
    committed = sorted(i.step for i in list_checkpoints(run) if i.committed)
    assert committed == [10, 20, 30, 40], out
    recorded = events(run)
    kinds = [e["type"] for e in recorded]
    assert any(e["type"] == "checkpoint.committed" and e["step"] == steps for e in recorded), (
        "the last step's commit never reached the recorder"
    )
    assert kinds.index("run.ended") > max(
        i for i, k in enumerate(kinds) if k == "checkpoint.committed"
    )


def test_a_hook_that_outlives_its_run_keeps_the_books_of_each_run_apart(tmp_path: Path) -> None:
    import anyio

    from evtrain.events import CheckpointPlan, RunEnded, RunStarted
    from evtrain.tools.replay import ReplayRunner

    def started(run_id: str, run_dir: Path) -> RunStarted:
        return RunStarted(
            name="r",
            num_stages=1,
            num_microbatches=1,
            schedule="1f1b",
            max_steps=10,
            batch_size=1,
            run_id=run_id,
            run_dir=str(run_dir),
        )

    first, second = tmp_path / "first", tmp_path / "second"
    hook = CheckpointHook(every_steps=5)
    runner = ReplayRunner([hook])
    events = [
        started("run-a", first),
        RunEnded(status="completed", step=10, run_id="run-a"),
        started("run-b", second),
    ]
    anyio.run(runner.replay, events)
    plans = [c for c in runner.commands if isinstance(c, CheckpointPlan)]
    assert [Path(p.path).parents[1] for p in plans] == [first, second]
    assert hook.run_dir == second
    assert hook.coordinator is not None and hook.coordinator.run_dir == second
