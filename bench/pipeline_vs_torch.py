"""evtrain's pipeline engine vs torch.distributed.pipelining, side by side in one run.

Model: an MLP of 8 Linear(512, 512) + ReLU layers, batch 256 split into
M = 8 microbatches, P = 2 stages (one process each, gloo on CPU, one torch
thread per process), SGD, MSE loss. Each contender trains a fixed number of
steps after a warm-up:

* evtrain 1F1B and GPipe — real stage workers started with
  torch.distributed.elastic, publishing their events to a real broker with
  the default event settings (microbatch spans "sampled"); a subscriber in
  this process plays the hook. Steps/s come from the last stage's StepEnded
  timestamps (first timed step's start to last step's end).
* torch.distributed.pipelining Schedule1F1B and ScheduleGPipe on the same
  layers with static shapes (input_args/output_args), also under elastic.
* sequential: one process runs the same 8 microbatches one after another.

Contenders alternate within each repeat; medians over repeats are reported.
The bubble bound is ``P * M / (M + P - 1)`` times the sequential rate.
The last line printed is one JSON object.

    python bench/pipeline_vs_torch.py [--steps 100] [--warmup 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

WIDTH = 512
LAYERS = 8
BATCH = 256
MICROBATCHES = 8
STAGES = 2

SPEC = f"""
import functools
import torch
from torch import nn
from evtrain.job import Job, layer

def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * {BATCH}, {WIDTH}, generator=g)
    return x, torch.randn(4 * {BATCH}, {WIDTH}, generator=g)

layers = []
for _ in range({LAYERS}):
    layers += [layer(nn.Linear, {WIDTH}, {WIDTH}), layer(nn.ReLU)]

job = Job(
    name="bench",
    layers=layers,
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
    train_data=data,
    batch_size={BATCH},
    num_microbatches={MICROBATCHES},
    max_steps=10,
    stages={STAGES},
    threads=1,
)
"""


def _mlp_layers(start: int, stop: int) -> nn.Sequential:
    """Layers ``start..stop-1`` of the 16-layer (Linear, ReLU) * 8 stack."""
    layers: list[nn.Module] = []
    for i in range(start, stop):
        layers.append(nn.Linear(WIDTH, WIDTH) if i % 2 == 0 else nn.ReLU())
    return nn.Sequential(*layers)


def _launch(nproc: int, entrypoint, *args):  # type: ignore[no-untyped-def]
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from evtrain.bus.address import free_port_block

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port_block()}",
        max_restarts=0,
        monitor_interval=0.1,
        run_id=uuid.uuid4().hex,
    )
    return elastic_launch(config, entrypoint)(*args)


# ------------------------------------------------------------------ torch side


def _maybe_pin() -> None:
    """Pin this process to one core (by LOCAL_RANK) when EVTRAIN_PIN_CPU=1, as evtrain does."""
    if os.environ.get("EVTRAIN_PIN_CPU") == "1":
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(os.environ.get("LOCAL_RANK", "0")) % len(cpus)]})


def torch_worker(kind: str, steps: int, warmup: int) -> float | None:
    """One rank of torch.distributed.pipelining; rank 0 returns steps/s."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    _maybe_pin()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_stage = 2 * LAYERS // world
    torch.manual_seed(rank)
    module = _mlp_layers(rank * per_stage, (rank + 1) * per_stage)
    mb = BATCH // MICROBATCHES
    stage = PipelineStage(
        module,
        rank,
        world,
        torch.device("cpu"),
        input_args=(torch.empty(mb, WIDTH),),
        output_args=torch.empty(mb, WIDTH),
        # torch 2.13: with static shapes the backward metadata must be given
        # too, or the first stage backpropagates a None output gradient.
        output_grads=(torch.empty(mb, WIDTH),),
        input_grads=(torch.empty(mb, WIDTH),),
    )
    cls = Schedule1F1B if kind == "1f1b" else ScheduleGPipe
    schedule = cls(stage, n_microbatches=MICROBATCHES, loss_fn=nn.functional.mse_loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            start = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    return steps / elapsed if rank == 0 else None


def sequential_worker(steps: int, warmup: int) -> float:
    """One process, the same 8 microbatches in sequence; returns steps/s."""
    _maybe_pin()
    torch.set_num_threads(1)
    model = _mlp_layers(0, 2 * LAYERS)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)
    xs, ys = x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        for xm, ym in zip(xs, ys, strict=True):
            (nn.functional.mse_loss(model(xm), ym) / MICROBATCHES).backward()
        optimizer.step()
        optimizer.zero_grad()
    return steps / (time.perf_counter() - start)


# ---------------------------------------------------------------- evtrain side


@contextlib.contextmanager
def _removing(directory: str) -> Iterator[None]:
    try:
        yield
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_evtrain(spec: Path, schedule: str, steps: int, warmup: int) -> float:
    """Launch evtrain's stage workers with a live bus; steps/s from StepEnded events."""
    from evtrain.bus import Broker, BusAddress, Subscriber
    from evtrain.events import StepEnded, StepStarted
    from evtrain.stages.worker import WorkerConfig, worker_main

    address = BusAddress.new_ipc()
    with Broker(address), _removing(address.location):
        sub = Subscriber(address.endpoint("events_out"), topics=("step.",))
        config = WorkerConfig(
            spec_path=str(spec),
            overrides={"schedule": schedule, "steps": str(warmup + steps)},
            bus=str(address),
            run_id=f"bench-{schedule}",
        )
        _launch(STAGES, worker_main, config.encode())
        events = []
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 0.5:
            batch = sub.drain()
            if batch:
                events.extend(batch)
                quiet_since = time.monotonic()
            time.sleep(0.01)
        sub.close()
    last = STAGES - 1
    started = {e.step: e.ts for e in events if isinstance(e, StepStarted) and e.stage == last}
    ended = {e.step: e.ts for e in events if isinstance(e, StepEnded) and e.stage == last}
    first, final = warmup + 1, warmup + steps
    if first not in started or final not in ended:
        raise RuntimeError(f"missing step events ({len(events)} received)")
    return steps / (ended[final] - started[first])


# ------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated subset of contenders to run (for quick checks; "
        "the summary then has null for the others)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin every worker process to its own core (EVTRAIN_PIN_CPU=1), all contenders",
    )
    args = parser.parse_args()
    os.environ.setdefault("EVTRAIN_LOG_LEVEL", "warning")
    if args.pin:
        os.environ["EVTRAIN_PIN_CPU"] = "1"

    names = ("evtrain_1f1b", "torch_1f1b", "evtrain_gpipe", "torch_gpipe", "sequential")
    chosen = [n for n in args.only.split(",") if n] or list(names)
    unknown = set(chosen) - set(names)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(names)}")
    results: dict[str, list[float]] = {k: [] for k in names if k in chosen}
    with tempfile.TemporaryDirectory(prefix="evt-bench-") as tmp:
        spec = Path(tmp) / "bench_spec.py"
        spec.write_text(SPEC)
        for repeat in range(args.repeats):
            for name in results:
                if name.startswith("evtrain_"):
                    rate = run_evtrain(spec, name.split("_")[1], args.steps, args.warmup)
                elif name.startswith("torch_"):
                    out = _launch(STAGES, torch_worker, name.split("_")[1], args.steps, args.warmup)
                    rate = float(out[0])
                else:
                    rate = float(_launch(1, sequential_worker, args.steps, args.warmup)[0])
                results[name].append(rate)
                print(
                    f"repeat {repeat + 1}/{args.repeats}  {name:14s} {rate:6.2f} steps/s",
                    flush=True,
                )

    med = {k: statistics.median(results[k]) if results.get(k) else None for k in names}

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a / b

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    bound = (
        None
        if med["sequential"] is None
        else STAGES * MICROBATCHES / (MICROBATCHES + STAGES - 1) * med["sequential"]
    )
    print()
    print(f"{'contender':14s} {'median':>8s} {'best':>8s}  runs (steps/s)")
    for name, values in results.items():
        runs = " ".join(f"{v:.2f}" for v in values)
        print(f"{name:14s} {statistics.median(values):8.2f} {max(values):8.2f}  {runs}")
    ratio_1f1b = ratio(med["evtrain_1f1b"], med["torch_1f1b"])
    ratio_gpipe = ratio(med["evtrain_gpipe"], med["torch_gpipe"])
    per_repeat = [
        e / t
        for e, t in zip(
            results.get("evtrain_1f1b", []), results.get("torch_1f1b", []), strict=False
        )
    ]
    each = " ".join(f"{r:.3f}" for r in per_repeat)
    best = {k: max(v) if v else None for k, v in ((k, results.get(k)) for k in names)}
    best_ratio_1f1b = ratio(best["evtrain_1f1b"], best["torch_1f1b"])
    print(f"evtrain/torch 1F1B  {fmt(ratio_1f1b)}  (per repeat: {each})")
    print(f"evtrain/torch 1F1B, best runs {fmt(best_ratio_1f1b)}")
    print(f"evtrain/torch GPipe {fmt(ratio_gpipe)}")
    fraction = ratio(med["evtrain_1f1b"], bound)
    print(f"bubble bound {fmt(bound)} steps/s; evtrain 1F1B reaches {fmt(fraction)} of it")

    def rounded(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    summary = {
        "evtrain_1f1b_steps_per_s": rounded(med["evtrain_1f1b"]),
        "torch_1f1b_steps_per_s": rounded(med["torch_1f1b"]),
        "evtrain_gpipe_steps_per_s": rounded(med["evtrain_gpipe"]),
        "torch_gpipe_steps_per_s": rounded(med["torch_gpipe"]),
        "sequential_steps_per_s": rounded(med["sequential"]),
        "ratio_1f1b": rounded(ratio_1f1b),
        "ratio_gpipe": rounded(ratio_gpipe),
        "ratio_1f1b_per_repeat": [round(r, 3) for r in per_repeat],
        "ratio_1f1b_median_of_repeats": rounded(statistics.median(per_repeat))
        if per_repeat
        else None,
        "ratio_1f1b_best": rounded(best_ratio_1f1b),
        "bound_steps_per_s": rounded(bound),
        "bound_fraction_1f1b": rounded(fraction),
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
