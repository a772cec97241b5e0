"""Streaming a token file larger than the memory bound: per-process peak RSS and the
data-loading share of step time, one run.

    python bench/data_loading.py [--size-mb 2048] [--bound-mb 512] [--steps 40]
                                 [--workers 2] [--repeats 3] [--no-scan]

A nanoGPT-style token file of ``--size-mb`` MiB (uint16 character ids of the
built-in text of examples/lm_stream.py, repeated) is written to a new
directory under /tmp and removed at the end. The stated bound: every process
of a run — each stage and each DataLoader worker — peaks under
``--bound-mb`` MiB (default 512, a quarter of the default file), however
large the file. Three kinds of `evtrain launch` at P=2:

* ``stream``: the decoder of examples/lm_stream.py (4 blocks of width 128,
  256-token windows, batch 16 in 4 microbatches) reading
  `evtrain.datasets.TokenFile` through ``data_loader={"num_workers":
  --workers}``, ``--steps`` steps of windows drawn across the whole file;
* ``memory``, the peer: the same model and steps on as many windows of the
  same file stacked in memory (the tensor path, no DataLoader);
* ``scan``: one epoch over the whole file (windows of 512 KiB, the cheap
  model of tests/integration/test_streaming.py), so every byte of it passes through
  each reading stage's workers; its growth after the first `BASELINE_STEP`
  steps is what shows that the memory does not follow the file's size.

``stream`` and ``memory`` alternate, ``--repeats`` times each.

Measured, from outside the stages:

* peak RSS of a stage: the highest `StepEnded.peak_memory_bytes` (its
  ``ru_maxrss``); of a DataLoader worker (a separate process, which no event
  reports): its ``VmHWM``, sampled from /proc every 0.1 s, its stage from
  the ``RANK`` in its environment;
* the data-loading share of step time, two ways: (a) throughput,
  ``1 - t_memory / t_stream`` with ``t`` the median step time after
  `WARMUP` steps; (b) per reading stage, the step time outside forward,
  backward and communication waits (``duration - forward - backward -
  comm_wait``: loading the batch, the optimizer step, the control
  exchange), streaming minus memory, over the streaming step time. An
  exact figure needs the stage itself to time the DataLoader's ``next()``
  (in ``StageExecutor._load_batch``) and report it, e.g. as a
  ``StepEnded`` field; no event carries it today.

Prints a line per run and a summary; the last line is one JSON object:
``file_bytes``, ``bound_mib``, ``per_stage_peak_rss_mib``,
``worker_peak_rss_mib`` and ``stage_total_peak_rss_mib`` (a stage with its
workers) of the last stream run, ``data_share`` (``throughput``,
``outside_compute`` by stage), ``runs`` (each kind's figures), ``scan``
(its peaks, growth after the baseline step and read rate),
``within_bound``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from evtrain.datasets import TokenFile, write_tokens
from evtrain.events import StageStarted, StepEnded
from evtrain.exporters.recorder import read_recording
from evtrain.job import Job, layer

BENCH = Path(__file__).resolve().parent
EXAMPLES = BENCH.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
import lm_stream  # noqa: E402  (examples/ is no package)

MIB = 1 << 20
MARKER = "EVTRAIN_BENCH_MARKER"
WARMUP = 5
"""Steps left out of the step-time medians (start-up, first DataLoader batches)."""
BASELINE_STEP = 8
"""The scan's growth is measured from this step on."""

LM_SEQ, LM_DIM, LM_BATCH = 256, 128, 16
SCAN_SEQ, SCAN_BATCH, SCAN_PREFIX = 262144, 8, 512


# ------------------------------------------------------------------ the jobs


def memory_windows(path: str, seq_len: int, count: int) -> dict[str, torch.Tensor]:
    """The first ``count`` windows of the token file, stacked: the in-memory peer's data."""
    data = TokenFile(path, seq_len)
    rows = [data[i] for i in range(min(count, len(data)))]
    return {key: torch.stack([r[key] for r in rows]) for key in ("input_ids", "labels")}


def lm_job(kind: str, path: str, steps: int, workers: int, run_dir: str) -> Job:
    """The decoder of examples/lm_stream.py on the token file, streamed or in memory."""
    train: Any
    loader: dict[str, Any] | None
    if kind == "stream":
        train, loader = functools.partial(TokenFile, path, LM_SEQ), {"num_workers": workers}
    else:
        train, loader = functools.partial(memory_windows, path, LM_SEQ, steps * LM_BATCH), None
    return lm_stream.lm_job(
        train,
        vocab_size=len(lm_stream.VOCAB),
        seq_len=LM_SEQ,
        dim=LM_DIM,
        data_loader=loader,
        name=f"bench-{kind}",
        batch_size=LM_BATCH,
        max_steps=steps,
        run_dir=run_dir,
        microbatch_spans="off",
        hooks=[{"type": "recorder"}],
    )


class BagOfTokens(nn.Module):
    """The mean embedding of each window's first `SCAN_PREFIX` tokens (token frequencies
    times a linear map): the scan spends its time reading, not computing."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Linear(vocab, dim, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids[:, :SCAN_PREFIX]
        ones = torch.ones((), device=ids.device).expand(ids.shape)
        counts = torch.zeros(ids.shape[0], self.vocab, device=ids.device)
        return self.embed(counts.scatter_add_(1, ids, ones) / ids.shape[1])


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels[:, SCAN_PREFIX - 1])


def scan_steps(path: str) -> int:
    """Steps of one epoch of the scan over the file."""
    return len(TokenFile(path, SCAN_SEQ)) // SCAN_BATCH


def scan_job(path: str, workers: int, run_dir: str) -> Job:
    """One epoch over the whole file through the DataLoader, with a model that costs little."""
    vocab = len(lm_stream.VOCAB)
    return Job(
        name="bench-scan",
        layers=[
            layer(BagOfTokens, vocab, 16),
            layer(nn.Linear, 16, 32),
            layer(nn.Tanh),
            layer(nn.Linear, 32, vocab),
        ],
        balance=[2, 2],
        stages=2,
        loss_fn=next_token_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        train_data=functools.partial(TokenFile, path, SCAN_SEQ),
        data_loader={"num_workers": workers},
        input_keys="input_ids",
        target_keys="labels",
        batch_size=SCAN_BATCH,
        num_microbatches=4,
        max_steps=scan_steps(path),
        run_dir=run_dir,
        threads=1,
        microbatch_spans="off",
        hooks=[{"type": "recorder"}],
    )


# ------------------------------------------------------------------ running one


@dataclass
class Sampled:
    """What /proc showed of one process of a launch."""

    name: str = ""
    rank: str | None = None
    hwm: int = 0
    series: list[tuple[float, int]] = field(default_factory=list)
    """(wall time, VmHWM) samples."""


@dataclass
class Result:
    kind: str
    wall_s: float
    steps: dict[int, list[StepEnded]]
    """By stage, in step order."""
    workers: dict[int, Sampled]


def _write_spec(directory: Path, call: str) -> Path:
    spec = directory / "spec.py"
    spec.write_text(
        f"import sys\nsys.path[:0] = [{str(BENCH)!r}, {str(EXAMPLES)!r}]\n"
        f"import data_loading\njob = data_loading.{call}\n"
    )
    return spec


def _marked(marker: str) -> Iterator[int]:
    needle = f"{MARKER}={marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    yield int(entry)
        except OSError:
            continue


def _sample(pid: int, info: Sampled, now: float) -> None:
    with open(f"/proc/{pid}/status") as fh:
        status = dict(line.split(":\t", 1) for line in fh.read().splitlines() if ":\t" in line)
    info.name = status["Name"]  # a DataLoader worker renames itself once started
    info.hwm = max(info.hwm, int(status["VmHWM"].split()[0]) * 1024)
    info.series.append((now, info.hwm))
    if info.rank is None:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            for item in fh.read().split(b"\0"):
                if item.startswith(b"RANK="):
                    info.rank = item[5:].decode()


def launch(kind: str, spec: Path, run_dir: Path, timeout: float) -> Result:
    """``evtrain launch SPEC`` to the end, sampling its processes; its events and samples."""
    marker = secrets.token_hex(6)
    env = dict(os.environ, **{MARKER: marker})
    cmd = [sys.executable, "-m", "evtrain", "launch", str(spec), "--quiet"]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    seen: dict[int, Sampled] = {}
    try:
        while proc.poll() is None:
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"{kind}: the launch did not end within {timeout:.0f} s")
            now = time.time()
            for pid in _marked(marker):
                try:
                    _sample(pid, seen.setdefault(pid, Sampled()), now)
                except (OSError, KeyError, ValueError):
                    continue  # it ended between listing and reading
            time.sleep(0.1)
        output = proc.communicate()[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        for pid in _marked(marker):  # re-parented leftovers (forkservers)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{kind}: evtrain launch exited {proc.returncode}:\n{output}")
    steps: dict[int, list[StepEnded]] = {}
    stage_pids = set()
    for ev in read_recording(run_dir / "events.jsonl", types=("stage.started", "step.ended")):
        if isinstance(ev, StageStarted):
            stage_pids.add(ev.pid)
        elif isinstance(ev, StepEnded):
            steps.setdefault(ev.stage, []).append(ev)
    for evs in steps.values():
        evs.sort(key=lambda e: e.step)
    workers = {
        pid: s for pid, s in seen.items() if s.name == "pt_data_worker" and pid not in stage_pids
    }
    return Result(kind, wall, steps, workers)


# ------------------------------------------------------------------ figures


def peak_mib(result: Result) -> dict[str, float]:
    """Each stage's highest reported peak RSS, MiB."""
    return {
        str(s): round(max(e.peak_memory_bytes or 0 for e in evs) / MIB, 1)
        for s, evs in sorted(result.steps.items())
    }


def worker_mib(result: Result) -> dict[str, list[float]]:
    """Each stage's workers' peak RSS (VmHWM), MiB."""
    out: dict[str, list[float]] = {}
    for w in result.workers.values():
        out.setdefault(w.rank or "?", []).append(round(w.hwm / MIB, 1))
    return {k: sorted(v) for k, v in sorted(out.items())}


def total_mib(result: Result) -> dict[str, float]:
    """Each stage's peak plus its workers' (an upper bound: the peaks need not coincide)."""
    workers = worker_mib(result)
    return {s: round(v + sum(workers.get(s, [])), 1) for s, v in peak_mib(result).items()}


def read_mib_per_s(result: Result, window_bytes: int, batch: int) -> float:
    """File read per second by each reading stage, between its first and last step's end."""
    evs = result.steps[max(result.steps)]
    seconds = evs[-1].ts - evs[0].ts
    return round((len(evs) - 1) * batch * window_bytes / MIB / seconds, 1) if seconds > 0 else 0.0


def steady(evs: list[StepEnded]) -> list[StepEnded]:
    return [e for e in evs if e.step > WARMUP] or evs


def step_s(result: Result) -> float:
    """Median step time of the last stage after warmup (the stages keep one pace)."""
    last = max(result.steps)
    return statistics.median(e.duration_s for e in steady(result.steps[last]))


def outside_s(result: Result, stage: int) -> float:
    """Median step time of ``stage`` outside forward, backward and communication waits."""
    return statistics.median(
        e.duration_s - e.forward_s - e.backward_s - e.comm_wait_s
        for e in steady(result.steps[stage])
    )


def growth(result: Result) -> dict[str, Any]:
    """How much each process grew after step `BASELINE_STEP` (MiB)."""
    stages = {}
    for s, evs in sorted(result.steps.items()):
        by_step = {e.step: e.peak_memory_bytes or 0 for e in evs}
        stages[str(s)] = round((by_step[max(by_step)] - by_step[BASELINE_STEP]) / MIB, 1)
    # The time the last stage ended the baseline step; each worker's VmHWM then.
    last = max(result.steps)
    t0 = next(e.ts for e in result.steps[last] if e.step == BASELINE_STEP)
    workers: dict[str, list[float]] = {}
    for w in result.workers.values():
        at = next((hwm for t, hwm in w.series if t >= t0), w.hwm)
        workers.setdefault(w.rank or "?", []).append(round((w.hwm - at) / MIB, 1))
    return {"stages": stages, "workers": {k: sorted(v) for k, v in sorted(workers.items())}}


def write_file(path: Path, size_mb: int) -> int:
    """The built-in text's character ids repeated to ``size_mb`` MiB of uint16."""
    chunk = np.resize(np.asarray(lm_stream.encode(lm_stream.TEXT), dtype=np.uint16), MIB // 2)
    return write_tokens(path, (chunk for _ in range(size_mb)))


def describe(result: Result) -> str:
    workers = worker_mib(result)
    return (
        f"{result.kind:>6}: {1 / step_s(result):6.2f} steps/s (median step "
        f"{step_s(result) * 1000:.0f} ms), wall {result.wall_s:.0f} s, stage peak RSS "
        f"{peak_mib(result)} MiB"
        + (f", workers {workers} MiB, with workers {total_mib(result)} MiB" if workers else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=2048, help="token file size (MiB)")
    parser.add_argument("--bound-mb", type=int, default=512, help="stated per-process bound")
    parser.add_argument("--steps", type=int, default=40, help="steps of each LM run")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per stage")
    parser.add_argument("--repeats", type=int, default=3, help="stream/memory pairs")
    parser.add_argument("--no-scan", action="store_true", help="skip the whole-file epoch")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    args = parser.parse_args()
    if args.size_mb < 1 or args.steps <= WARMUP or args.repeats < 1 or args.workers < 0:
        parser.error("need --size-mb >= 1, --steps > 5, --repeats >= 1, --workers >= 0")
    scan_mib = 2 * BASELINE_STEP * SCAN_BATCH * SCAN_SEQ * 2 // MIB
    if not args.no_scan and args.size_mb < scan_mib:
        parser.error(f"the scan needs --size-mb >= {scan_mib} (or --no-scan)")
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < (args.size_mb + 512) * MIB:
        parser.error(f"{args.size_mb} MiB do not fit the {free // MIB} MiB free in /tmp")

    root = Path(tempfile.mkdtemp(prefix="evt-bench-data-"))
    try:
        tokens = root / "tokens.bin"
        began = time.monotonic()
        count = write_file(tokens, args.size_mb)
        size = tokens.stat().st_size
        print(
            f"token file: {size / MIB:.0f} MiB ({count:,} tokens) written in "
            f"{time.monotonic() - began:.1f} s; bound {args.bound_mb} MiB per process "
            f"(the file is {size / (args.bound_mb * MIB):.1f}x that)"
        )
        results: dict[str, list[Result]] = {"stream": [], "memory": []}
        for i in range(args.repeats):
            for kind in ("stream", "memory"):
                d = root / f"{kind}-{i}"
                d.mkdir()
                call = f"lm_job({kind!r}, {str(tokens)!r}, {args.steps}, {args.workers}, "
                spec = _write_spec(d, call + f"{str(d / 'run')!r})")
                result = launch(kind, spec, d / "run", args.timeout)
                results[kind].append(result)
                print(describe(result))
        scan: Result | None = None
        if not args.no_scan:
            d = root / "scan"
            d.mkdir()
            spec = _write_spec(d, f"scan_job({str(tokens)!r}, {args.workers}, {str(d / 'run')!r})")
            scan = launch("scan", spec, d / "run", args.timeout)
            print(describe(scan))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def pooled(kind: str, fn: Any) -> float:
        return statistics.median(fn(r) for r in results[kind])

    t_stream, t_memory = pooled("stream", step_s), pooled("memory", step_s)
    last = max(results["stream"][0].steps)
    outside = {
        str(s): round((pooled("stream", lambda r, s=s: outside_s(r, s))
                       - pooled("memory", lambda r, s=s: outside_s(r, s))) / t_stream, 4)
        for s in (0, last)
    }  # fmt: skip
    share = {"throughput": round(1 - t_memory / t_stream, 4), "outside_compute": outside}
    stream = results["stream"][-1]
    peaks = [v for r in results["stream"] for v in peak_mib(r).values()]
    peaks += [v for r in results["stream"] for vs in worker_mib(r).values() for v in vs]
    scan_figures: dict[str, Any] | None = None
    if scan is not None:
        peaks += list(peak_mib(scan).values())
        peaks += [v for vs in worker_mib(scan).values() for v in vs]
        scan_figures = {
            "steps": max(e.step for e in scan.steps[0]),
            "stage_peak_rss_mib": peak_mib(scan),
            "worker_peak_rss_mib": worker_mib(scan),
            "baseline_step": BASELINE_STEP,
            "growth_after_baseline_mib": growth(scan),
            "stage_total_peak_rss_mib": total_mib(scan),
            "read_mib_per_s_per_reading_stage": read_mib_per_s(scan, SCAN_SEQ * 2, SCAN_BATCH),
        }
    within = max(peaks) <= args.bound_mb
    print(
        f"data-loading share of step time: {share['throughput']:+.1%} by throughput "
        f"(median step {t_stream * 1000:.0f} ms streaming vs {t_memory * 1000:.0f} ms in "
        f"memory); outside compute and waits, streaming minus memory: "
        + ", ".join(f"stage {s} {v:+.1%}" for s, v in outside.items())
    )
    if scan_figures is not None:
        print(f"scan of the whole file: {scan_figures}")
    print(
        f"highest peak of any process: {max(peaks):.0f} MiB, bound {args.bound_mb} MiB: "
        + ("within" if within else "EXCEEDED")
    )
    print(
        json.dumps(
            {
                "file_bytes": size,
                "bound_mib": args.bound_mb,
                "per_stage_peak_rss_mib": peak_mib(stream),
                "worker_peak_rss_mib": worker_mib(stream),
                "stage_total_peak_rss_mib": total_mib(stream),
                "data_share": share,
                "runs": {
                    kind: {
                        "steps_per_s": round(1 / pooled(kind, step_s), 3),
                        "stage_peak_rss_mib": peak_mib(rs[-1]),
                        "worker_peak_rss_mib": worker_mib(rs[-1]),
                    }
                    for kind, rs in results.items()
                },
                "scan": scan_figures,
                "within_bound": within,
                "workers": args.workers,
                "steps": args.steps,
            }
        )
    )


if __name__ == "__main__":
    main()
