"""A token file several times larger than the memory bound streams through `evtrain launch`.

One epoch over a `FILE_MIB` MiB token file (`evtrain.datasets.TokenFile`)
at P=2 with two DataLoader workers per reading stage, so every byte of the
file passes through the first stage's workers (inputs) and the last
stage's (targets). The bound: no process grows by more than `MARGIN_MIB`
after the first `BASELINE_STEP` steps — by then torch, the model and the
DataLoader's in-flight batches are resident — while the file is
`FILE_MIB / MARGIN_MIB` times larger than that margin. A reader that mapped
the whole file would grow by the file's size, as the pages it touched
accumulated in its resident set; `TokenFile` reads each window with
``pread`` into a buffer freed with the sample.

The stages' peaks are their own reports (`StepEnded.peak_memory_bytes`, the
process's ``ru_maxrss``, recorded by the event recorder); the workers'
(separate processes the stages never report) are their ``VmHWM``, sampled
from /proc while the run goes on.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import stream_spec
from helpers.launch_helpers import (
    TESTS_DIR,
    kill_marked,
    marked_pids,
    new_marker,
    read_records,
    start_launch,
    wait_no_marked,
)

pytestmark = pytest.mark.slow

FILE_MIB = 384
MARGIN_MIB = 48
BASELINE_STEP = 8
MIB = 1 << 20
SAMPLES = (FILE_MIB * MIB // 2 - 1) // stream_spec.SEQ_LEN  # uint16 tokens, windows
STEPS = SAMPLES // stream_spec.BATCH  # one epoch


@dataclass
class Proc:
    """What was sampled of one process of the launch."""

    name: str
    parent: int
    """The parent's pid: a DataLoader worker's is its stage process."""
    baseline_hwm: int | None = None
    """``VmHWM`` at the first sample after `BASELINE_STEP` steps were done."""
    hwm: int = 0
    opened_tokens: bool = False
    mapped_tokens: bool = False
    looked: bool = field(default=False, repr=False)


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as fh:
        return dict(line.split(":\t", 1) for line in fh.read().splitlines() if ":\t" in line)


def _uses(pid: int, path: Path) -> tuple[bool, bool]:
    """Whether ``pid`` has ``path`` open, and whether it maps it."""
    opened = False
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            opened |= os.readlink(f"/proc/{pid}/fd/{fd}") == str(path)
        except OSError:
            continue
    with open(f"/proc/{pid}/maps") as fh:
        mapped = any(line.rstrip().endswith(str(path)) for line in fh)
    return opened, mapped


def _steps_done(path: Path) -> int:
    return sum("step" in r for r in read_records(path))


def _watch(
    proc: subprocess.Popen[str], marker: str, steps_file: Path, tokens: Path, timeout: float
) -> dict[int, Proc]:
    """Sample every process of the launch until it exits."""
    seen: dict[int, Proc] = {}
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"the launch did not end within {timeout} s")
        past_baseline = _steps_done(steps_file) >= BASELINE_STEP
        for pid in marked_pids(marker):
            try:
                status = _status(pid)
                info = seen.get(pid)
                if info is None:
                    info = seen[pid] = Proc(status["Name"], int(status["PPid"]))
                # A DataLoader worker names itself once it started.
                info.name = status["Name"]
                info.hwm = max(info.hwm, int(status["VmHWM"].split()[0]) * 1024)
                if past_baseline and info.baseline_hwm is None:
                    info.baseline_hwm = info.hwm
                if past_baseline and not info.looked:
                    info.opened_tokens, info.mapped_tokens = _uses(pid, tokens)
                    info.looked = True
            except (OSError, KeyError, ValueError):
                continue  # it ended between listing and reading
        time.sleep(0.05)
    return seen


@pytest.fixture
def token_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "tokens.bin"
    stream_spec.write_pattern(path, FILE_MIB)
    try:
        yield path
    finally:
        # pytest keeps recent temporary directories; this one must not stay.
        path.unlink(missing_ok=True)


def test_a_file_many_times_the_margin_streams_with_bounded_rss(
    token_file: Path, tmp_path: Path
) -> None:
    assert token_file.stat().st_size == FILE_MIB * MIB
    assert FILE_MIB >= 8 * MARGIN_MIB  # the bound means something
    steps_file = tmp_path / "steps.jsonl"
    run_dir = tmp_path / "run"
    hooks = [
        {"type": "recorder"},
        {"type": "helpers.launch_hooks:StepRecorder", "path": str(steps_file)},
    ]
    spec = tmp_path / "spec.py"
    spec.write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS_DIR)!r})\nfrom helpers import stream_spec\n"
        f"job = stream_spec.make_job({str(run_dir)!r}, {str(token_file)!r}, {STEPS}, 2, "
        f"hooks={hooks!r})\n"
    )
    marker = new_marker()
    proc = start_launch(spec, "--quiet", marker=marker)
    try:
        seen = _watch(proc, marker, steps_file, token_file, timeout=300)
        out, err = proc.communicate()
        assert proc.returncode == 0, out + err
        assert not wait_no_marked(marker)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kill_marked(marker)

    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    ended = [e for e in events if e["type"] == "step.ended"]
    # Exactly one epoch: every window of the file was read once by each reading stage.
    assert {(e["stage"], e["step"]) for e in ended} == {
        (s, k) for s in (0, 1) for k in range(1, STEPS + 1)
    }
    assert {e["epoch"] for e in ended} == {0}
    margin = MARGIN_MIB * MIB
    for stage in (0, 1):
        peak = {e["step"]: e["peak_memory_bytes"] for e in ended if e["stage"] == stage}
        bound = peak[BASELINE_STEP] + margin
        assert peak[STEPS] <= bound, (
            f"stage {stage} grew by {(peak[STEPS] - peak[BASELINE_STEP]) / MIB:.0f} MiB "
            f"while a {FILE_MIB} MiB file streamed (bound: {MARGIN_MIB} MiB)"
        )

    stage_of = {e["pid"]: e["stage"] for e in events if e["type"] == "stage.started"}
    workers = {pid: p for pid, p in seen.items() if p.name == "pt_data_worker"}
    assert sorted(stage_of.get(p.parent) for p in workers.values()) == [0, 0, 1, 1], seen
    for pid, worker in workers.items():
        assert worker.baseline_hwm is not None, (pid, worker)
        assert worker.hwm <= worker.baseline_hwm + margin, (
            f"a worker of stage {stage_of.get(worker.parent)} grew by "
            f"{(worker.hwm - worker.baseline_hwm) / MIB:.0f} MiB (bound: {MARGIN_MIB} MiB)"
        )
        # Each worker reads through its own descriptor, never through a mapping.
        assert worker.looked and worker.opened_tokens, (pid, worker)
    assert not [p for p in seen.values() if p.mapped_tokens], seen
