"""The Python API with real runs: `evtrain.launch` and `evtrain.evaluate` / ``evtrain eval``.

One training run (launched in this process, with the metrics log and best
checkpoints by eval loss) is shared by the tests that read its outcome; its
checkpoints are evaluated again by the stages alone and must give the
recorded metrics to the last bit.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers.launch_helpers import (
    MARKER_ENV,
    kill_marked,
    launch_env,
    new_marker,
    run_eval,
    wait_no_marked,
    write_eval_spec,
)

import evtrain
from evtrain.checkpoint import list_checkpoints
from evtrain.errors import UsageError
from evtrain.launcher.run_record import read_run_record
from evtrain.spec import load_job

pytestmark = pytest.mark.slow

STEPS = 8
EVAL_EVERY = 4

HOOKS = [{"type": "metrics"}, {"type": "checkpoint", "best_metric": "loss"}]


def write_spec(directory: Path, *, hooks: list[dict[str, Any]] | None = None) -> Path:
    return write_eval_spec(
        directory, steps=STEPS, hooks=HOOKS if hooks is None else hooks, name="apitest"
    )


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def evals_of(run: Path) -> dict[int, dict[str, float]]:
    """The metrics of each evaluation in the run's metrics log, by step."""
    return {r["step"]: r["metrics"] for r in lines(run / "metrics.jsonl") if r["type"] == "eval"}


@dataclass
class Trained:
    spec: Path
    run: Path
    result: evtrain.LaunchResult
    shown: str


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    """`evtrain.launch` of the spec, run in this process (its children carry a marker),
    on a bus secured with CURVE keys the launch makes."""
    directory = tmp_path_factory.mktemp("api")
    spec = write_spec(directory)
    token = new_marker()
    shown = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MARKER_ENV, token)
        try:
            result = evtrain.launch(
                spec, eval_every=EVAL_EVERY, out=shown, curve_dir=directory / "keys"
            )
        finally:
            left = wait_no_marked(token, timeout=10.0)
            kill_marked(token)
    assert left == []
    yield Trained(spec, directory / "run", result, shown.getvalue())


def test_launch_returns_the_result_of_the_run(trained: Trained) -> None:
    result, run = trained.result, trained.run
    assert result.ok and result.status == "completed" and result.exit_status == 0
    assert result.run_dir == run and result.steps == STEPS and result.root_cause is None
    record = read_run_record(run)
    assert record is not None and record["run_id"] == result.run_id
    # The bus was secured: the launch made the keys its processes used.
    keys = run.parent / "keys"
    assert record["curve_dir"] == str(keys) and (keys / "client.key_secret").is_file()
    metrics = lines(run / "metrics.jsonl")
    steps = [r for r in metrics if r["type"] == "step"]
    evals = [r for r in metrics if r["type"] == "eval"]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert result.final_loss == steps[-1]["loss"]
    assert [r["step"] for r in evals] == [EVAL_EVERY, STEPS]
    assert result.last_eval == evals[-1]["metrics"] and result.last_eval_step == STEPS
    committed = [c for c in list_checkpoints(run) if c.committed]
    assert committed and result.checkpoint == max(committed, key=lambda c: c.time).path
    # The launcher's own display streamed the run to `out`.
    assert str(run) in trained.shown


def test_a_used_run_directory_raises_a_usage_error_without_deep_frames(trained: Trained) -> None:
    with pytest.raises(UsageError, match=r"holds run .*--resume auto continues it") as caught:
        evtrain.launch(trained.spec, quiet=True)
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert [Path(f.filename).name for f in frames] == [Path(__file__).name, "api.py", "api.py"]


def test_evaluate_reproduces_every_recorded_metric_exactly(trained: Trained) -> None:
    run = trained.run
    recorded = evals_of(run)
    before = {
        "metrics": (run / "metrics.jsonl").read_bytes(),
        "checkpoints": [(c.path, c.committed, c.time) for c in list_checkpoints(run)],
    }
    best = [c for c in list_checkpoints(run) if c.committed and c.metric is not None]
    assert best, "the run saved no best checkpoint"
    for ckpt in best:
        result = evtrain.evaluate(trained.spec, ckpt.path, quiet=True)
        assert result.step == ckpt.step and result.checkpoint == ckpt.path
        assert result.metrics == recorded[ckpt.step]  # every metric, bit for bit
        assert result.recorded == {"loss": ckpt.metric} and result.metrics["loss"] == ckpt.metric
        assert result.eval_dir.parent == run / "evals" and result.samples == 96
        assert not (result.eval_dir / "checkpoints").exists()
        assert json.loads(result.output.read_text())["metrics"] == result.metrics
    # The training run's own files are as they were.
    assert (run / "metrics.jsonl").read_bytes() == before["metrics"]
    assert [(c.path, c.committed, c.time) for c in list_checkpoints(run)] == before["checkpoints"]


def test_evtrain_eval_prints_the_metrics_and_writes_them_as_json(
    trained: Trained, tmp_path: Path
) -> None:
    run = trained.run
    recorded = evals_of(run)
    ckpt = min((c for c in list_checkpoints(run) if c.committed), key=lambda c: c.step)
    output = tmp_path / "scores.json"
    done, left = run_eval(trained.spec, ckpt.path, output)
    assert done.returncode == 0, done.stdout + done.stderr
    assert left == []
    saved = json.loads(output.read_text())
    assert saved["step"] == ckpt.step and saved["metrics"] == recorded[ckpt.step]
    assert f"eval of step {ckpt.step}: loss=" in done.stdout
    assert "Traceback" not in done.stderr


SCRIPT = '''\
"""A script that trains a Job object built here (generated)."""

import asyncio
import json
import sys

import torch

import evtrain


def halved_mse(output, target):
    return 0.5 * torch.nn.functional.mse_loss(output, target)


async def in_a_notebook(job):
    # A running event loop in this thread, as in a Jupyter cell.
    return evtrain.launch(job, steps=3, hooks=False, quiet=True)


if __name__ == "__main__":
    job = evtrain.load_job(sys.argv[1]).with_overrides(loss_fn=halved_mse)
    result = asyncio.run(in_a_notebook(job))
    said = {{"status": result.status, "steps": result.steps, "run_dir": str(result.run_dir)}}
    print(json.dumps(said))
'''


def test_a_job_object_from_a_script_runs_inside_an_event_loop(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, hooks=[])
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format())
    marker = new_marker()
    try:
        done = subprocess.run(
            [sys.executable, str(script), str(spec)],
            env=launch_env(marker),
            capture_output=True,
            text=True,
            timeout=90,
            cwd=tmp_path,
        )
    finally:
        left = wait_no_marked(marker, timeout=10.0)
        kill_marked(marker)
    assert done.returncode == 0, done.stdout + done.stderr
    assert left == []
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said == {"status": "completed", "steps": 3, "run_dir": str(tmp_path / "run")}
    record = read_run_record(tmp_path / "run")
    assert record is not None
    # The workers rebuilt the Job from the spec the launcher wrote for it.
    generated = Path(record["spec"])
    assert generated.parent == Path(record["reports"]) / "job" and generated.is_file()


def test_a_job_the_workers_cannot_rebuild_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    job = load_job(write_spec(tmp_path, hooks=[]))
    with pytest.raises(UsageError, match="cannot be sent to the stage processes"):
        evtrain.launch(job.with_overrides(loss_fn=lambda out, target: (out - target).abs().mean()))
    assert not (tmp_path / "run").exists()

    # A function of an interactive session: no file the workers could import it from.
    code = textwrap.dedent(
        f"""
        import evtrain

        def l1(output, target):
            return (output - target).abs().mean()

        job = evtrain.load_job({str(tmp_path / "spec.py")!r}).with_overrides(loss_fn=l1)
        try:
            evtrain.launch(job)
        except evtrain.UsageError as exc:
            print(exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "refers to l1, defined in this interactive session" in done.stdout
    assert not (tmp_path / "run").exists()
