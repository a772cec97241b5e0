"""Training time blocked per checkpoint: asynchronous vs synchronous shard saving, one run.

    python bench/checkpoint_stall.py [--checkpoints 5] [--steps-between 6] [--device cpu]

One stage's worth of state: an MLP of 6 Linear(2048, 2048) + ReLU layers
(25.2 M fp32 parameters, 101 MB) trained with Adam (two more moments: 302 MB
of parameters plus optimizer state, plus the scheduler and RNG), saved with
`evtrain.checkpoint.writer.ShardWriter` in the same format either way:

* async: `ShardWriter.save` captures the small state (buffers, RNG, scheduler,
  hyperparameters) and returns; a background thread copies parameters and
  optimizer state into reused host buffers (pinned on CUDA, where the copies
  are queued on the stream inside ``save`` instead) while the next forward and
  backward run — ``optimizer.step()`` waits for that copy — then writes the DCP
  shard, fsyncs, hashes and records it while training continues.
  `ShardWriter.prepare` is called after the first step (as the actor does),
  so no checkpoint pays for first-touching fresh staging memory.
* sync: the same writer with ``asynchronous=False`` writes the live tensors in
  the training thread; training waits until the shard is durable.

Blocked time is what the training loop loses per checkpoint, as the writer
reports it (``CheckpointShardSaved.blocked_s``): the time inside ``save`` plus,
for async, the wait at the next ``optimizer.step()`` until the overlapped copy
of parameters and optimizer state finished (and any wait for a previous write
still in flight; checkpoints are spaced ``--steps-between`` steps apart). The two
modes alternate, checkpoint by checkpoint, in one process. The cost async
moves off the critical path is not free on a busy CPU: the step time while a
background write is in flight is reported beside the idle step time.

Best checkpoints are the same save, taken by the stages right after an
evaluation that improved the metric, so they block training exactly as
long and hold no memory of their own (no candidate snapshot is kept). What
they add is the decision: the last stage shares the metric with every stage
in one broadcast on the control group, timed here between two gloo
processes (``StepControl.share``) once per evaluation.

Prints one line per checkpoint, a summary, then one JSON object as the last line
(``async_blocked_s``, ``sync_blocked_s``: medians; ``ratio`` = async / sync;
``best_decision_s``: median time of the metric broadcast).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from evtrain.checkpoint import checkpoint_path_template, step_dir
from evtrain.checkpoint.writer import ShardWriter

WIDTH = 2048
LAYERS = 6
BATCH = 32


def build(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = nn.Sequential(*layers).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    return model, optimizer, scheduler


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, x: torch.Tensor
) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optimizer.step()
    scheduler.step()
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)


def _share_metric(rank: int, port: int, rounds: int, out: Any) -> None:
    from evtrain.stages.control import StepControl

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    control = StepControl(rank=rank, world_size=2, group=None)
    times = []
    for i in range(rounds + 20):
        dist.barrier()
        t0 = time.perf_counter()
        value = control.share(0.5 + i if rank == 1 else float("nan"), src=1)
        dt = time.perf_counter() - t0
        assert value == 0.5 + i
        if i >= 20:
            times.append(dt)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def best_decision_s(rounds: int = 200) -> float:
    """Median seconds of the best-checkpoint decision's metric broadcast, 2 gloo processes."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_share_metric, args=(r, port, rounds, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        if proc.exitcode != 0:
            raise RuntimeError(f"metric broadcast bench process exited with {proc.exitcode}")
    return float(out.get())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", type=int, default=5, help="checkpoints per mode")
    parser.add_argument(
        "--steps-between", type=int, default=6, help="training steps between two checkpoints"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    device = torch.device(args.device)
    model, optimizer, scheduler = build(device)
    x = torch.randn(BATCH, WIDTH, device=device)
    train_step(model, optimizer, scheduler, x)  # Adam state exists from here on

    params = sum(p.numel() for p in model.parameters())
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    print(
        f"model: {params / 1e6:.1f} M parameters; parameters + Adam state: "
        f"{state_bytes / 1e6:.0f} MB; device {device}"
    )

    root = Path(args.dir or tempfile.mkdtemp(prefix="evt-ckbench-"))
    root.mkdir(parents=True, exist_ok=True)
    writers = {
        "async": ShardWriter(0, 1, device=device, asynchronous=True),
        "sync": ShardWriter(0, 1, device=device, asynchronous=False),
    }
    writers["async"].prepare(model, optimizer)
    blocked: dict[str, list[float]] = {"async": [], "sync": []}
    write_s: dict[str, list[float]] = {"async": [], "sync": []}
    step_idle: list[float] = []
    step_busy: list[float] = []
    step = 1
    try:
        # Warm-up: one checkpoint each, not counted (first DCP call, page cache...).
        modes = ["async", "sync"] * (args.checkpoints + 1)
        for i, mode in enumerate(modes):
            writer = writers[mode]
            run = root / mode
            writer.save(
                checkpoint_path_template(run),
                checkpoint_id=f"{mode}-{step}",
                step=step,
                module=model,
                optimizer=optimizer,
                scheduler=scheduler,
                data_position=step,
            )
            for _ in range(args.steps_between):
                t0 = time.perf_counter()
                train_step(model, optimizer, scheduler, x)
                dt = time.perf_counter() - t0
                (step_busy if writers["async"].busy() else step_idle).append(dt)
                step += 1
            done = writer.wait()
            assert done and done[0].ok, done
            if i >= 2:
                # done.blocked_s = the time inside save() plus, for async, the wait at
                # the next optimizer step's fence for the overlapped copy.
                b = done[0].blocked_s
                blocked[mode].append(b)
                write_s[mode].append(done[0].duration_s)
                print(
                    f"{mode:5s} checkpoint at step {done[0].step:4d}: blocked "
                    f"{b * 1e3:8.1f} ms, durable after {done[0].duration_s:6.2f} s, "
                    f"{done[0].bytes / 1e6:.0f} MB "
                    + " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in writer.last_timings.items())
                )
            shutil.rmtree(step_dir(run, done[0].step), ignore_errors=True)
    finally:
        for writer in writers.values():
            writer.close()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    a = statistics.median(blocked["async"])
    s = statistics.median(blocked["sync"])
    idle = statistics.median(step_idle) if step_idle else float("nan")
    busy = statistics.median(step_busy) if step_busy else float("nan")
    print(
        f"blocked per checkpoint (median of {len(blocked['async'])}): async {a * 1e3:.1f} ms, "
        f"sync {s * 1e3:.1f} ms -> async/sync = {a / s:.3f}"
    )
    print(
        f"step time: {idle * 1e3:.1f} ms idle, {busy * 1e3:.1f} ms while an async write "
        f"is in flight ({len(step_busy)} steps)"
    )
    decision = best_decision_s()
    print(
        f"best checkpoint: blocks as long as any async save, extra host memory 0 B; "
        f"deciding costs one metric broadcast per evaluation: {decision * 1e6:.0f} us"
    )
    print(
        json.dumps(
            {
                "async_blocked_s": round(a, 5),
                "sync_blocked_s": round(s, 5),
                "ratio": round(a / s, 4),
                "async_blocked_all_s": [round(v, 5) for v in blocked["async"]],
                "sync_blocked_all_s": [round(v, 5) for v in blocked["sync"]],
                "async_durable_s": round(statistics.median(write_s["async"]), 4),
                "sync_durable_s": round(statistics.median(write_s["sync"]), 4),
                "state_bytes": state_bytes,
                "params": params,
                "step_s_idle": round(idle, 5),
                "step_s_during_async_write": round(busy, 5),
                "checkpoints_per_mode": len(blocked["async"]),
                "best_decision_s": round(decision, 6),
                "device": str(device),
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
