"""Memory per process against step time: every shard mode at P=2 x D = 1, 2, 4.

    python bench/memory_scaling.py [--width 1024] [--layers 64] [--steps 3] [--warmup 2]
        [--dps 1,2,4] [--modes none,optimizer,grads,full]

Model: ``--layers`` Linear(W, W) + GELU layers (W = ``--width``; the defaults
make 33.6M parameters, 134 MB in fp32, per stage of two), MSE loss, AdamW,
a global batch of 64 in M = 4 microbatches, one torch thread per process,
gloo. Each contender is a real ``evtrain launch SPEC --stages 2 --dp D
--shard MODE`` (``none`` is DDP; a shard mode needs D > 1); what it holds and
how fast it steps come from the run's own metrics.jsonl:

* ``state_bytes``: the parameters and optimizer state a process holds
  between steps (its shards), counted tensor by tensor by the stage;
* ``rss_bytes``: the process's peak resident memory (``ru_maxrss``), the
  largest over the run's processes;
* ``held_bytes``: ``rss_bytes`` less the peak of the same launch with a
  one-unit-wide model (the interpreter, torch, gloo's buffers): what the
  model's parameters, gradients, optimizer state and activations took at
  their peak in the step — on the CPU there is no allocator to ask. Every
  process runs with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at 128 KiB, so
  a freed tensor's memory goes back to the system at once: with the default
  (a threshold that grows with what was freed) the heap keeps FSDP's
  all-gather buffers after their release, and the peak measures the
  allocator's caching instead of what was live;
* ``step_s``: seconds per step from the end of step ``--warmup`` to the end
  of the last.

The peer is torch's own FSDP2 on the same model without a pipeline: D
processes (torch.distributed.elastic, as torchrun), ``fully_shard`` on every
Linear and on the model, the whole model per process, the same batch and
microbatches (gradients reduced in the last one's backward); the same
figures, its baseline the same run with a one-unit-wide model.

P x D processes share the machine's cores, so at D = 4 step times measure
8 processes on whatever cores there are: compare modes at the same D.

The last line printed is one JSON object: ``bytes_per_process_d1`` and
``bytes_per_process_d4_<mode>`` (``held_bytes``), their ratios
``held_d4_<mode>_vs_d1`` (goals: ``full`` <= 0.35, ``optimizer`` <= 0.5),
``state_d4_<mode>_vs_d1`` and ``step_time_<mode>_vs_ddp`` (at D = 4).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp_scaling import _checked, _launch_evtrain, step_times
from pipeline_vs_torch import _launch, timed_steps

BATCH = 64
MICROBATCHES = 4

SPEC = """
import functools

import torch
from torch import nn

from evtrain.job import Job, layer

WIDTH, LAYERS = {width}, {layers}


def data(n):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def block():
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())


job = Job(
    name="bench-memory",
    layers=[layer(block) for _ in range(LAYERS)],
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
    train_data=functools.partial(data, 4 * {batch}),
    batch_size={batch},
    num_microbatches={microbatches},
    max_steps=4,
    stages=2,
    threads=1,
    microbatch_spans="off",
    hooks=[{{"type": "metrics"}}],
)
"""


def per_process(run_dir: Path, last: int) -> dict[str, int]:
    """The largest ``state_bytes`` and ``peak_memory_bytes`` over the processes at step ``last``."""
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("type") != "step" or record["step"] != last:
            continue
        places = list(record["stages"].values())
        for stages in record.get("replicas", {}).values():
            places.extend(stages.values())
        return {
            "state_bytes": max(int(p["state_bytes"] or 0) for p in places),
            "rss_bytes": max(int(p["peak_memory_bytes"] or 0) for p in places),
        }
    raise RuntimeError(f"{run_dir}/metrics.jsonl has no step {last}")


def run_evtrain(
    work: Path, label: str, width: int, layers: int, dp: int, mode: str, steps: int, warmup: int
) -> dict[str, Any]:
    spec = work / f"{label}.py"
    spec.write_text(SPEC.format(width=width, layers=layers, batch=BATCH, microbatches=MICROBATCHES))
    run_dir = work / label
    last = warmup + steps
    args = ["--dp", str(dp), "--steps", str(last)]
    if mode != "none":
        args += ["--shard", mode]
    rc, tail = _launch_evtrain(spec, run_dir, work / f"{label}.log", *args)
    result: dict[str, Any] = {"ran": False, "stages": 2, "dp": dp, "mode": mode}
    reason = _checked(run_dir, rc, tail, result)
    if reason is not None:
        return {**result, "reason": reason}
    times = step_times(run_dir)
    result.update(per_process(run_dir, last))
    result["step_s"] = (times[last] - times[warmup]) / steps
    result["ran"] = True
    return result


# ------------------------------------------------------------------ torch FSDP2


def fsdp_worker(width: int, layers: int, steps: int, warmup: int) -> dict[str, float]:
    """One rank of torch FSDP2 on the whole model; every rank returns its figures."""
    from torch.distributed.fsdp import fully_shard

    from evtrain.stages.update import state_bytes_of  # what evtrain's stages count, counted alike

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers))
    )
    if world > 1:
        for block in model:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, width, generator=gen), torch.randn(BATCH, width, generator=gen)
    local = BATCH // world

    def step(_: int) -> None:
        xs = x[rank * local : (rank + 1) * local].chunk(MICROBATCHES)
        ys = y[rank * local : (rank + 1) * local].chunk(MICROBATCHES)
        for m, (xm, ym) in enumerate(zip(xs, ys, strict=True)):
            if world > 1:
                model.set_requires_gradient_sync(m == MICROBATCHES - 1)  # type: ignore[operator]
            (nn.functional.mse_loss(model(xm), ym) / MICROBATCHES).backward()
        optimizer.step()
        optimizer.zero_grad()

    step_s = timed_steps(step, warmup, steps)
    held = state_bytes_of(list(model.parameters()), optimizer)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.destroy_process_group()
    return {"step_s": step_s, "state_bytes": held, "rss_bytes": rss}


def run_fsdp(width: int, layers: int, dp: int, steps: int, warmup: int) -> dict[str, Any]:
    ranks = _launch(dp, fsdp_worker, width, layers, steps, warmup)
    figures = list(ranks.values())
    return {
        "ran": True,
        "dp": dp,
        "step_s": max(f["step_s"] for f in figures),
        "state_bytes": max(f["state_bytes"] for f in figures),
        "rss_bytes": max(f["rss_bytes"] for f in figures),
    }


# ------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=64, help="layers of the whole model")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dps", default="1,2,4")
    parser.add_argument("--modes", default="none,optimizer,grads,full")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # see the docstring
    dps = [int(d) for d in args.dps.split(",")]
    modes = args.modes.split(",")
    out: dict[str, Any] = {"width": args.width, "layers": args.layers}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="evtrain-memory-") as tmp:
        work = Path(tmp)
        for dp in dps:
            base = run_evtrain(work, f"base-d{dp}", 1, args.layers, dp, "none", 1, 1)
            if not base["ran"]:
                sys.exit(f"baseline D={dp}: {base['reason']}")
            for mode in modes:
                if mode != "none" and dp == 1:
                    continue
                label = f"{mode}-d{dp}"
                r = run_evtrain(
                    work, label, args.width, args.layers, dp, mode, args.steps, args.warmup
                )
                if r["ran"]:
                    r["held_bytes"] = r["rss_bytes"] - base["rss_bytes"]
                results[label] = r
                print(json.dumps({label: r}), flush=True)
            if dp > 1:
                peer = run_fsdp(args.width, args.layers, dp, args.steps, args.warmup)
                peer["held_bytes"] = (
                    peer["rss_bytes"] - run_fsdp(1, args.layers, dp, 1, 1)["rss_bytes"]
                )
                results[f"torch-fsdp2-d{dp}"] = peer
                print(json.dumps({f"torch-fsdp2-d{dp}": peer}), flush=True)
    one = results.get("none-d1", {})
    if one.get("ran"):
        out["bytes_per_process_d1"] = one["held_bytes"]
        out["state_bytes_d1"] = one["state_bytes"]
    ddp4 = results.get("none-d4", {})
    for mode in modes:
        r = results.get(f"{mode}-d4", {})
        if not r.get("ran"):
            continue
        out[f"bytes_per_process_d4_{mode}"] = r["held_bytes"]
        if one.get("ran"):
            out[f"held_d4_{mode}_vs_d1"] = round(r["held_bytes"] / one["held_bytes"], 3)
            out[f"state_d4_{mode}_vs_d1"] = round(r["state_bytes"] / one["state_bytes"], 3)
        if ddp4.get("ran"):
            out[f"step_time_{mode}_vs_ddp"] = round(r["step_s"] / ddp4["step_s"], 3)
    out["cpus"] = os.cpu_count()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
