"""The default demo: its spec, the quality it reaches alone and through the real pipeline."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import ProcessGroup
from helpers.console_helpers import LOG_LINE, PROGRESS_TEXT, Terminal, run_in_pty
from helpers.launch_helpers import kill_marked, launch_env, new_marker, wait_no_marked

from evtrain.checkpoint import latest_committed, list_checkpoints
from evtrain.data import microbatches
from evtrain.errors import UsageError
from evtrain.hooks.registry import build_hook_from_spec
from evtrain.job import Job
from evtrain.spec import load_job
from evtrain.stages.job_data import job_data
from evtrain.stages.partition import build_full_model, partition
from evtrain.tools.demo import (
    DEMO_HOOKS,
    EVAL_EVERY,
    MAX_STEPS,
    SPEC_PATH,
    load_digits_split,
    make_job,
)

MIN_ACCURACY = 0.95
"""Test accuracy the demo must reach; it typically reaches 0.966-0.975 (seeds 0-3)."""


def train_single_process(job: Job) -> float:
    """Train ``job`` in one process exactly as the pipeline does; the final test accuracy."""
    torch.set_num_threads(1)
    model = build_full_model(job)
    optimizer = job.optimizer(model.parameters())
    scheduler = job.lr_scheduler(optimizer) if job.lr_scheduler else None
    inputs, targets = job_data(job).train_tensors()
    stream = job_data(job).train_stream()
    m = job.num_microbatches
    for step in range(job_data(job).total_steps()):
        indices = stream.indices(step)
        optimizer.zero_grad()
        for x, y in zip(
            microbatches(inputs, indices, m), microbatches(targets, indices, m), strict=True
        ):
            (job.loss_fn(model(x), y) / m).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    eval_set = job_data(job).eval_tensors()
    assert eval_set is not None
    model.eval()
    with torch.no_grad():
        return float(job.metrics["accuracy"](model(eval_set.inputs), eval_set.targets))


def test_demo_spec_is_the_documented_job() -> None:
    job = load_job(SPEC_PATH)
    assert job.stages == 2 and job.device == "cpu"
    assert job.batch_size == 64 and job.num_microbatches == 4
    assert job.max_steps == MAX_STEPS and job.eval_every is not None
    assert "accuracy" in job.metrics
    assert [len(r) for r in partition(job)] == [2, 3]
    names = [h["type"] for h in job.hooks]  # type: ignore[index]
    for wanted in ("logging", "prometheus", "metrics", "recorder", "checkpoint"):
        assert wanted in names, f"the demo does not start the {wanted} hook"


@pytest.mark.parametrize("spec", DEMO_HOOKS, ids=lambda h: h["type"])
def test_every_demo_hook_builds(spec: dict[str, object]) -> None:
    # A renamed hook or option would otherwise only show when the demo runs.
    build_hook_from_spec(spec)


def test_split_is_fixed_disjoint_and_scaled() -> None:
    train_x, train_y = load_digits_split("train")
    test_x, test_y = load_digits_split("test")
    assert train_x.shape == (1438, 64) and test_x.shape == (359, 64)
    assert set(train_y.tolist()) == set(test_y.tolist()) == set(range(10))
    assert train_x.mean(dim=0).abs().max() < 1e-4  # standardized on the training part
    again_x, again_y = load_digits_split("test")
    assert torch.equal(again_x, test_x) and torch.equal(again_y, test_y)
    train_rows = {tuple(row.tolist()) for row in train_x}
    overlap = sum(tuple(row.tolist()) in train_rows for row in test_x)
    assert overlap <= 2  # the set holds a couple of duplicate images, nothing more


def test_missing_scikit_learn_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn", None)  # makes `import sklearn` fail
    with pytest.raises(UsageError, match=r"pip install -e '\.\[demo\]'"):
        make_job()


def test_demo_quality_single_process() -> None:
    accuracy = train_single_process(load_job(SPEC_PATH))
    assert accuracy >= MIN_ACCURACY


@dataclass
class DemoRun:
    """One finished ``evtrain demo`` run without a terminal (stdout and stderr are pipes)."""

    done: subprocess.CompletedProcess[str]
    run_dir: Path
    tmp: Path


def demo_env(marker: str, **extra: str) -> dict[str, str]:
    """Environment for ``evtrain demo`` in a test: any free Prometheus port, no size hints."""
    env = launch_env(marker, EVTRAIN_DEMO_PROMETHEUS_PORT="0", **extra)
    for name in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR"):
        env.pop(name, None)  # the terminal's own size and capabilities decide
    return env


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """``evtrain demo`` once, to the end (shared by the tests that read its outcome)."""
    tmp = tmp_path_factory.mktemp("demo")
    marker = new_marker()
    run_dir = tmp / "digits"
    cmd = [sys.executable, "-m", "evtrain", "demo", "--run-dir", str(run_dir)]
    try:
        done = subprocess.run(
            cmd,
            env=demo_env(marker),
            capture_output=True,
            text=True,
            timeout=180,
            start_new_session=True,
        )
    finally:
        left = wait_no_marked(marker, timeout=5.0)
        kill_marked(marker)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not left, f"processes left behind: {left}"
    return DemoRun(done=done, run_dir=run_dir, tmp=tmp)


@pytest.mark.slow
def test_demo_quality_through_evtrain_launch(demo_run: DemoRun) -> None:
    run_dir, done = demo_run.run_dir, demo_run.done
    assert str(run_dir) in done.stdout  # it says where the run's files are

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["type"] == "eval"]
    assert evals, "no evaluation in metrics.jsonl"
    final = evals[-1]
    assert final["step"] == MAX_STEPS
    assert final["metrics"]["accuracy"] >= MIN_ACCURACY
    # The pipeline trains exactly what one process would (same data, seed, math).
    reference = train_single_process(load_job(SPEC_PATH))
    assert final["metrics"]["accuracy"] == pytest.approx(reference, abs=2 / 359)

    # The recorded run renders as a timeline.
    trace = demo_run.tmp / "trace.json"
    shown = subprocess.run(
        [sys.executable, "-m", "evtrain", "timeline", str(run_dir), "-o", str(trace)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    stages = {e["tid"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    assert stages == {0, 1}

    # Periodic and best checkpoints were committed, and retention kept few.
    latest = latest_committed(run_dir)
    assert latest is not None and latest.step == MAX_STEPS
    committed = [c for c in list_checkpoints(run_dir) if c.committed]
    assert 1 <= len(committed) <= 3


EVAL_STEPS = list(range(EVAL_EVERY, MAX_STEPS + 1, EVAL_EVERY))
CHATTER = ("hooks attached", "broker started", "broker stopped", "topics=", "shard saved")
"""Details that belong to debug level."""


def assert_console(lines: list[str], finished: list[str]) -> None:
    """What the demo's console must look like: ``lines`` as shown, ``finished`` as written.

    Each fact once, no line that holds both progress and log text, each
    evaluation shown once, the summary with the last evaluation, no chatter.
    """
    text = "\n".join(lines)
    twice = [line for line, n in Counter(lines).items() if n > 1]
    assert not twice, f"lines shown more than once: {twice}\n{text}"
    mixed = [x for x in finished if LOG_LINE.search(x) and PROGRESS_TEXT.search(x)]
    assert not mixed, f"progress and log text on one line: {mixed}"
    evals = [int(m.group(1)) for x in lines if (m := re.match(r"eval at step (\d+): ", x))]
    assert evals == EVAL_STEPS, text
    assert not [x for x in lines if re.search(r"\beval\b.*val_accuracy", x)], text  # only once
    commits = Counter(m.group(1) for x in lines if (m := re.search(r"committed .*step=(\d+)", x)))
    assert commits and max(commits.values()) == 1, commits
    for word in CHATTER:
        assert word not in text, f"{word!r} at the default level:\n{text}"
    head = next(i for i, x in enumerate(lines) if x.startswith("run completed: "))
    assert lines[head].startswith(f"run completed: {MAX_STEPS}/{MAX_STEPS} steps in "), text
    summary = lines[head:]
    last_eval = [x for x in summary if x.startswith(f"  last eval (step {MAX_STEPS}): loss ")]
    assert last_eval and " accuracy 0.9" in last_eval[0], text


@pytest.mark.slow
def test_demo_console_without_a_terminal(demo_run: DemoRun) -> None:
    out, err = demo_run.done.stdout, demo_run.done.stderr
    for stream in (out, err):
        assert "\x1b" not in stream and "\r" not in stream  # plain lines: no control codes
    progress = [x for x in out.splitlines() if x.startswith("step ")]
    assert len(progress) >= 2 and progress[-1].startswith(f"step {MAX_STEPS}/{MAX_STEPS}  loss ")
    lines = [x for x in (out + err).splitlines() if x.strip()]
    assert_console(lines, lines)


@pytest.mark.slow
def test_demo_console_on_a_terminal(tmp_path: Path, marker: str, procs: ProcessGroup) -> None:
    cmd = [sys.executable, "-m", "evtrain", "demo", "--run-dir", str(tmp_path / "digits")]
    env = demo_env(marker, TERM="xterm-256color")
    status, raw = run_in_pty(procs, cmd, env=env, timeout=180)
    assert status == 0, raw[-3000:]
    assert "━" in raw  # rich drew its bar
    screen = Terminal(raw)
    lines = screen.lines()
    assert_console(lines, screen.finished)
    assert any(f"{MAX_STEPS}/{MAX_STEPS}" in x and "ETA" in x for x in screen.finished)
    assert not [x for x in lines if PROGRESS_TEXT.search(x)]  # the summary replaced the bar
    assert not wait_no_marked(marker, timeout=5.0)
