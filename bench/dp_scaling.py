"""Data and pipeline parallelism vs torch DDP on two processes, then the bus's fan-in.

    python bench/dp_scaling.py [--steps 100] [--warmup 10] [--repeats 2]
        [--dp-microbatches 1] [--eval-samples 16384] [--fanin-events 192000] [--pin]

Model: bench/pipeline_vs_torch.py's MLP (8 Linear(512, 512) + ReLU), MSE
loss, SGD (lr 1e-3), a global batch of 256 from the same 1,024 random
samples, one torch thread per process, gloo, two processes per contender:

* evtrain P=2 D=1: two pipeline stages, M = 8 microbatches, 1F1B;
* evtrain P=1 D=2: two replicas of a one-stage pipeline, 128 samples each,
  ``--dp-microbatches`` microbatches per replica (default 1), gradients
  averaged by each stage's DDP reducer;
* torch DDP: plain `DistributedDataParallel` over gloo on 2 ranks started
  like torchrun (torch.distributed.elastic), 128 samples per rank in the same
  number of microbatches as evtrain's replicas (``no_sync`` on all but the
  last), the same initial weights on both ranks.

evtrain runs go through the real command line (``evtrain launch SPEC
--stages P --dp D ...`` on a spec written to a temporary directory, with only
the metrics hook), and their step rate comes from the run's own
``metrics.jsonl``: the wall-clock time at which each step ended, from the end
of step ``--warmup`` to the end of step ``--warmup + --steps``, so start-up
and warm-up are not in it. torch DDP is timed the same way (after ``--warmup``
steps to after the last, between barriers). A run counts only if it ran as
many processes as P x D (the launch's agent report lists its workers): a
launcher that ignored ``--dp`` would otherwise time one process on the whole
batch. Samples/s are steps/s times the global batch. Contenders alternate
within each repeat; medians over repeats are reported.

Then evaluation (``--eval-samples``, default 16,384; 0 skips it), two steps
with an evaluation after each, the second evaluation's duration (from
``metrics.jsonl``) counting; at D=2 the replicas share every eval set.
``eval_d2_vs_d1`` is D=2's time over D=1's at P=2 on an emulated device: four
layers whose forward sleeps ``KERNEL_MS`` (the device's time) around a tiny
Linear, so P x D = 4 processes do not compete for 2 cores.
``eval_cpu_p1_d2_vs_d1`` and ``eval_cpu_p2_d2_vs_d1`` are the same ratio for
the MLP on the CPU (at P=2, four busy processes on two cores measure the
oversubscription, not the sharing).

Then the bus: bench/fanin.py's `fanin_capacity` with 64 publishers (a burst,
then paced trials up to the first that loses events).

The last line printed is one JSON object: ``dp2_vs_ddp_ratio`` (evtrain P=1
D=2 samples/s over torch DDP's), ``p2_vs_ddp_ratio``, ``eval_d2_vs_d1``, ``fanin_publishers``,
``fanin_events_per_s`` and ``fanin_dropped`` (the fastest lossless paced
trial), the burst figures and the rest. The machine may be shared: repeat.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# bench/ is no package: its scripts import each other from here.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fanin
from pipeline_vs_torch import (
    BATCH,
    LAYERS,
    MICROBATCHES,
    WIDTH,
    _launch,
    _maybe_pin,
    _mlp_layers,
    timed_steps,
)
from pipeline_vs_torch import SPEC as PIPELINE_SPEC

PIPELINE_MICROBATCHES = MICROBATCHES
SAMPLES = 4 * BATCH  # as many samples as pipeline_vs_torch's spec holds
LAUNCH_TIMEOUT_S = 300.0

# pipeline_vs_torch's job (the model, data, loss, optimizer, batch, M = 8, one
# thread), with the metrics hook writing the metrics.jsonl the step rate is read
# from; P, D and M come from the command line (--stages, --dp, --microbatches).
SPEC = (
    PIPELINE_SPEC
    + """
import dataclasses
job = dataclasses.replace(job, name="bench-dp", hooks=[{"type": "metrics"}])
"""
)

EVAL_SPEC = (
    SPEC
    + """
def eval_data(n=EVAL_SAMPLES):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)

job = dataclasses.replace(job, name="bench-dp-eval", eval_data=eval_data)
"""
)
EMULATED_EVAL_SPEC = """
import functools
import time

import torch
from torch import nn

from evtrain.job import Job, layer


class Kernel(nn.Module):
    \"\"\"A tiny Linear whose forward also occupies an emulated device for KERNEL_MS: the
    process sleeps, so four such processes share two cores without slowing each other.\"\"\"

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        time.sleep(KERNEL_MS / 1000)
        return self.linear(x)


def data(n):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 16, generator=g), torch.randn(n, 16, generator=g)


job = Job(
    name="bench-dp-eval-emulated",
    layers=[layer(Kernel) for _ in range(4)],
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
    train_data=functools.partial(data, 1024),
    eval_data=functools.partial(data, EVAL_SAMPLES),
    batch_size=256,
    num_microbatches=8,
    max_steps=2,
    stages=2,
    threads=1,
    hooks=[{"type": "metrics"}],
)
"""
KERNEL_MS = 1.0
"""Emulated device time of one layer's forward on one microbatch (32 samples)."""
EVAL_CONFIGS = {
    "p2_d1_emulated": (2, 1),
    "p2_d2_emulated": (2, 2),
    "p1_d1": (1, 1),
    "p1_d2": (1, 2),
    "p2_d1": (2, 1),
    "p2_d2": (2, 2),
}
"""Evaluation contenders: (P, D); ``_emulated`` ones run EMULATED_EVAL_SPEC."""


# ------------------------------------------------------------------ torch DDP


def ddp_worker(steps: int, warmup: int, microbatches: int) -> float | None:
    """One rank of plain DDP on the MLP; rank 0 returns steps/s."""
    _maybe_pin()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # DDP broadcasts rank 0's weights anyway; this keeps them equal
    model = nn.parallel.DistributedDataParallel(_mlp_layers(0, 2 * LAYERS))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(SAMPLES, WIDTH, generator=gen), torch.randn(SAMPLES, WIDTH, generator=gen)
    local = BATCH // world

    def step(i: int) -> None:
        first = (i % (SAMPLES // BATCH)) * BATCH + rank * local
        xs = x[first : first + local].chunk(microbatches)
        ys = y[first : first + local].chunk(microbatches)
        for m, (xm, ym) in enumerate(zip(xs, ys, strict=True)):
            # Gradients are reduced once per step, with the last microbatch's backward.
            sync = m == microbatches - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                (nn.functional.mse_loss(model(xm), ym) / microbatches).backward()
        optimizer.step()
        optimizer.zero_grad()

    step_s = timed_steps(step, warmup, steps)
    dist.destroy_process_group()
    return 1 / step_s if rank == 0 else None


def run_ddp(steps: int, warmup: int, microbatches: int) -> dict[str, Any]:
    rate = float(_launch(2, ddp_worker, steps, warmup, microbatches)[0])
    return {"ran": True, "steps_per_s": rate, "samples_per_s": rate * BATCH, "processes": 2}


# ------------------------------------------------------------------ evtrain


def evtrain_command() -> list[str]:
    """The installed ``evtrain`` script next to this interpreter, else ``python -m evtrain``."""
    script = Path(sys.executable).with_name("evtrain")
    return [str(script)] if script.exists() else [sys.executable, "-m", "evtrain"]


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop the launch and everything it started (its own process group)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)  # the launcher stops its workers at a step boundary
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def launched_processes(run_dir: Path) -> int | None:
    """How many stage workers the run's last attempt started (None if not recorded)."""
    try:
        record = json.loads((run_dir / "run.json").read_text())
        reports = Path(record["reports"])
        agent = json.loads((reports / "agent.json").read_text())
        return len(agent["attempts"][-1]["workers"])
    except (OSError, KeyError, IndexError, TypeError, ValueError):
        return None


def step_times(run_dir: Path) -> dict[int, float]:
    """Wall-clock end time of every step in the run's metrics.jsonl."""
    times = {}
    with (run_dir / "metrics.jsonl").open() as f:
        for line in f:
            record = json.loads(line)
            if record.get("type") == "step":
                times[int(record["step"])] = float(record["time"])
    return times


def _launch_evtrain(
    spec: Path, run_dir: Path, log_path: Path, *args: str
) -> tuple[int | None, str]:
    """``evtrain launch SPEC -q --run-dir RUN_DIR ARGS``: its exit status (None: timed
    out) and the last lines of its output."""
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [*evtrain_command(), "launch", str(spec), "-q", "--run-dir", str(run_dir), *args]
    with log_path.open("wb") as log:
        # A session of its own: Ctrl-C here does not reach the workers half-way, and
        # _end_group stops the whole launch in order whatever happens.
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _end_group(proc)
    tail = log_path.read_text(errors="replace").strip().splitlines()[-6:]
    return rc, " | ".join(tail)


def _checked(run_dir: Path, rc: int | None, tail: str, result: dict[str, Any]) -> str | None:
    """Why the launch does not count (failed, or not P x D processes), or None."""
    if rc != 0:
        why = "timed out" if rc is None else f"exit status {rc}"
        return f"launch {why}: {tail}"
    processes = launched_processes(run_dir)
    result["processes"] = processes
    if processes != result["stages"] * result["dp"]:
        return (
            f"the launch ran {processes} stage process(es), not P x D = "
            f"{result['stages'] * result['dp']}: data parallelism was not in effect"
        )
    return None


def run_evtrain(
    spec: Path,
    work: Path,
    label: str,
    stages: int,
    dp: int,
    microbatches: int,
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    """One ``evtrain launch``; steps/s between the ends of steps ``warmup`` and ``warmup + steps``.

    Returns ``ran: False`` with the reason when the launch failed or did not
    start P x D processes.
    """
    run_dir = work / label
    rc, tail = _launch_evtrain(
        spec,
        run_dir,
        work / f"{label}.log",
        *("--stages", str(stages), "--dp", str(dp), "--microbatches", str(microbatches)),
        *("--steps", str(warmup + steps)),
    )
    result: dict[str, Any] = {
        "ran": False,
        "stages": stages,
        "dp": dp,
        "microbatches": microbatches,
    }
    reason = _checked(run_dir, rc, tail, result)
    if reason is not None:
        return {**result, "reason": reason}
    times = step_times(run_dir)
    first, last = warmup, warmup + steps
    if first not in times or last not in times:
        return {**result, "reason": f"metrics.jsonl lacks step {first} or {last}"}
    rate = steps / (times[last] - times[first])
    return {**result, "ran": True, "steps_per_s": rate, "samples_per_s": rate * BATCH}


def run_evaluation(spec: Path, work: Path, label: str, stages: int, dp: int) -> dict[str, Any]:
    """One ``evtrain launch`` of two steps evaluating after each; the second
    evaluation's duration (the first pays for first use)."""
    run_dir = work / label
    rc, tail = _launch_evtrain(
        spec,
        run_dir,
        work / f"{label}.log",
        *("--stages", str(stages), "--dp", str(dp), "--steps", "2", "--eval-every", "1"),
    )
    result: dict[str, Any] = {"ran": False, "stages": stages, "dp": dp}
    reason = _checked(run_dir, rc, tail, result)
    if reason is not None:
        return {**result, "reason": reason}
    with (run_dir / "metrics.jsonl").open() as f:
        evals = [r for r in map(json.loads, f) if r.get("type") == "eval"]
    if len(evals) < 2:
        return {**result, "reason": f"metrics.jsonl holds {len(evals)} evaluation(s), not 2"}
    loss = evals[-1]["metrics"]["loss"]
    return {**result, "ran": True, "eval_s": float(evals[-1]["duration_s"]), "loss": loss}


# ------------------------------------------------------------------------ main


def evaluation_part(samples: int, repeats: int) -> dict[str, Any]:
    """Evaluation of ``samples`` samples at D=1 and D=2, medians over ``repeats``: the
    replicas share every eval set. On the emulated device (P=2) and on the CPU (the
    MLP at P=1 and P=2)."""
    print()
    print(f"evaluation of {samples} samples, batches of {BATCH}, after each of 2 steps:")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in EVAL_CONFIGS}
    with tempfile.TemporaryDirectory(prefix="evt-dp-eval-", dir="/tmp") as tmp:
        work = Path(tmp)
        cpu, emulated = work / "eval_spec.py", work / "eval_emulated_spec.py"
        text = EVAL_SPEC.replace("EVAL_SAMPLES", str(samples)).replace("WIDTH", str(WIDTH))
        cpu.write_text(text)
        text = EMULATED_EVAL_SPEC.replace("EVAL_SAMPLES", str(samples))
        emulated.write_text(text.replace("KERNEL_MS", str(KERNEL_MS)))
        for repeat in range(repeats):
            for name, (stages, dp) in EVAL_CONFIGS.items():
                spec = emulated if name.endswith("_emulated") else cpu
                result = run_evaluation(spec, work, f"eval-{name}-{repeat}", stages, dp)
                runs[name].append(result)
                line = (
                    f"{result['eval_s']:6.3f} s  (loss {result['loss']:.6f})"
                    if result["ran"]
                    else f"did not run: {result['reason']}"
                )
                print(f"repeat {repeat + 1}/{repeats}  eval {name:15s} {line}", flush=True)
    seconds = {
        name: statistics.median(r["eval_s"] for r in rs if r["ran"])
        for name, rs in runs.items()
        if any(r["ran"] for r in rs)
    }

    def ratio(a: str, b: str) -> float | None:
        return round(seconds[a] / seconds[b], 3) if a in seconds and b in seconds else None

    out = {
        "eval_d2_vs_d1": ratio("p2_d2_emulated", "p2_d1_emulated"),
        "eval_cpu_p1_d2_vs_d1": ratio("p1_d2", "p1_d1"),
        "eval_cpu_p2_d2_vs_d1": ratio("p2_d2", "p2_d1"),
        "eval_samples": samples,
        **{f"eval_s_{name}": round(value, 4) for name, value in seconds.items()},
    }
    print(
        f"evaluation time D=2 / D=1: emulated device P=2 {out['eval_d2_vs_d1']}; CPU P=1 "
        f"{out['eval_cpu_p1_d2_vs_d1']}, P=2 {out['eval_cpu_p2_d2_vs_d1']} "
        f"({os.cpu_count()} cores)"
    )
    return out


def main() -> None:
    fanin.exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=2, help="alternating repeats")
    parser.add_argument(
        "--dp-microbatches",
        type=int,
        default=1,
        help="microbatches per replica for evtrain P=1 D=2 and torch DDP (default 1)",
    )
    parser.add_argument(
        "--fanin-events",
        type=int,
        default=fanin.TOTAL_EVENTS,
        help="events per fan-in trial over 64 publishers (0: skip the fan-in part)",
    )
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=16384,
        help="samples of the evaluation part's eval set (0: skip the evaluation part)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin every worker process to its own core (EVTRAIN_PIN_CPU=1), all contenders",
    )
    args = parser.parse_args()
    if args.pin:
        os.environ["EVTRAIN_PIN_CPU"] = "1"
    if (BATCH // 2) % args.dp_microbatches:
        parser.error(f"--dp-microbatches must divide the replica batch {BATCH // 2}")

    configs = {
        "evtrain_p2_d1": (2, 1, PIPELINE_MICROBATCHES),
        "evtrain_p1_d2": (1, 2, args.dp_microbatches),
    }
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in [*configs, "torch_ddp"]}
    print(
        f"MLP {LAYERS}x Linear({WIDTH}), global batch {BATCH}, SGD, 1 thread per process, "
        f"2 processes each; {args.steps} timed steps after {args.warmup}; "
        f"{os.cpu_count()} cores",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="evt-dp-", dir="/tmp") as tmp:
        work = Path(tmp)
        spec = work / "dp_spec.py"
        spec.write_text(SPEC)
        for repeat in range(args.repeats):
            for name in results:
                runs = results[name]
                if runs and not runs[0]["ran"]:
                    continue  # refused or failed once: the same launch would again
                if name == "torch_ddp":
                    result = run_ddp(args.steps, args.warmup, args.dp_microbatches)
                else:
                    stages, dp, m = configs[name]
                    label = f"{name}-{repeat}"
                    result = run_evtrain(spec, work, label, stages, dp, m, args.steps, args.warmup)
                runs.append(result)
                if result["ran"]:
                    line = (
                        f"{result['steps_per_s']:6.2f} steps/s "
                        f"{result['samples_per_s']:8.0f} samples/s  "
                        f"({result['processes']} processes)"
                    )
                else:
                    line = f"did not run: {result['reason']}"
                print(f"repeat {repeat + 1}/{args.repeats}  {name:14s} {line}", flush=True)

    def median(name: str, key: str) -> float | None:
        values = [r[key] for r in results[name] if r["ran"]]
        return statistics.median(values) if values else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a / b

    def rounded(x: float | None, digits: int = 3) -> float | None:
        return None if x is None else round(x, digits)

    print()
    print(f"{'contender':14s} {'steps/s':>8s} {'samples/s':>10s}  config")
    notes = {
        "evtrain_p2_d1": f"P=2 D=1, M={PIPELINE_MICROBATCHES}, 1F1B",
        "evtrain_p1_d2": f"P=1 D=2, M={args.dp_microbatches} per replica",
        "torch_ddp": f"DDP 2 ranks, gloo, M={args.dp_microbatches} per rank",
    }
    for name in results:
        steps_s, samples_s = median(name, "steps_per_s"), median(name, "samples_per_s")
        if steps_s is None or samples_s is None:
            print(f"{name:14s} {'n/a':>8s} {'n/a':>10s}  {notes[name]} (did not run)")
        else:
            print(f"{name:14s} {steps_s:8.2f} {samples_s:10.0f}  {notes[name]}")
    ddp = median("torch_ddp", "samples_per_s")
    dp2 = median("evtrain_p1_d2", "samples_per_s")
    p2 = median("evtrain_p2_d1", "samples_per_s")
    dp2_ratio, p2_ratio = ratio(dp2, ddp), ratio(p2, ddp)
    fmt = {k: "n/a" if v is None else f"{v:.3f}" for k, v in (("dp2", dp2_ratio), ("p2", p2_ratio))}
    print(f"evtrain P=1 D=2 / torch DDP samples/s {fmt['dp2']}")
    print(f"evtrain P=2 D=1 / torch DDP samples/s {fmt['p2']}")
    dp2_runs = results["evtrain_p1_d2"]
    dp2_reason = next((r["reason"] for r in dp2_runs if not r["ran"]), None)
    if dp2_reason:
        print(f"evtrain P=1 D=2 not measured: {dp2_reason}")

    summary: dict[str, Any] = {
        "dp2_vs_ddp_ratio": rounded(dp2_ratio),
        "p2_vs_ddp_ratio": rounded(p2_ratio),
        "dp2_ran": bool(dp2_runs) and all(r["ran"] for r in dp2_runs),
        "dp2_reason": dp2_reason,
        "evtrain_p1_d2_steps_per_s": rounded(median("evtrain_p1_d2", "steps_per_s")),
        "evtrain_p1_d2_samples_per_s": rounded(dp2, 1),
        "evtrain_p2_d1_steps_per_s": rounded(median("evtrain_p2_d1", "steps_per_s")),
        "evtrain_p2_d1_samples_per_s": rounded(p2, 1),
        "torch_ddp_steps_per_s": rounded(median("torch_ddp", "steps_per_s")),
        "torch_ddp_samples_per_s": rounded(ddp, 1),
        "dp2_vs_ddp_per_repeat": [
            round(e["samples_per_s"] / t["samples_per_s"], 3)
            for e, t in zip(dp2_runs, results["torch_ddp"], strict=False)
            if e["ran"]
        ],
        "global_batch": BATCH,
        "pipeline_microbatches": PIPELINE_MICROBATCHES,
        "dp_microbatches": args.dp_microbatches,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
    }

    if args.eval_samples:
        summary.update(evaluation_part(args.eval_samples, args.repeats))

    if args.fanin_events:
        print()
        print("bus fan-in, 64 publishers (bench/fanin.py):")
        print(fanin.HEADER, flush=True)
        cap = fanin.fanin_capacity(
            64, args.fanin_events, report=lambda t: print(fanin.describe(t), flush=True)
        )
        bound = "" if cap["limit_found"] else " or more (no paced trial lost events)"
        print(
            f"one broker kept up with {cap['events_per_s']:,} events/s{bound} from 64 publishers "
            f"({cap['dropped']} dropped, broker {cap['broker_cpu_us_per_event']:.2f} us CPU per "
            f"event); burst ceiling {cap['burst_events_per_s']:,} events/s "
            f"({cap['burst_dropped']:,} dropped by design)"
        )
        summary.update(
            {
                "fanin_publishers": cap["publishers"],
                "fanin_events_per_s": cap["events_per_s"],
                "fanin_dropped": cap["dropped"],
                "fanin_limit_found": cap["limit_found"],
                "fanin_sent": cap["sent"],
                "fanin_received": cap["received"],
                "fanin_broker_cpu_us_per_event": cap["broker_cpu_us_per_event"],
                "fanin_broker_rss_peak_kib": cap["broker_rss_peak_kib"],
                "fanin_broker_kib_per_publisher": cap["broker_kib_per_publisher"],
                "fanin_burst_events_per_s": cap["burst_events_per_s"],
                "fanin_burst_dropped": cap["burst_dropped"],
                "fanin_burst_broker_cpu_us_per_event": cap["burst_broker_cpu_us_per_event"],
            }
        )
    else:
        summary.update(
            {"fanin_publishers": None, "fanin_events_per_s": None, "fanin_dropped": None}
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
