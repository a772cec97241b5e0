"""Why a pipeline stage's replicas reduce with DDP's reducer: five ways, measured.

One stage's view, no pipeline: 2 processes (torch.multiprocessing spawn, gloo,
one torch thread each) train the same MLP (8 Linear(512, 512) + Tanh, MSE
loss, SGD). A step is M = 8 microbatches of 32 samples per process (a global
batch of 512), each forward and backward in turn, the gradients accumulated,
then one optimizer step. What differs is how the two replicas' gradients are
averaged:

* ddp-last: evtrain's own `evtrain.stages.data_parallel.Replicas` (imported,
  so this measures the real code), used as the stage executor uses it: every
  forward and every backward but the step's last under ``accumulating()``
  (DDP's ``no_sync``), the last backward armed by hand with ``arm`` (DDP's
  ``reducer.prepare_for_backward``), so DDP's bucketed all-reduces run
  during that backward.
* ddp-every: DDP wrapped naively, no ``no_sync``: every microbatch's backward
  all-reduces the (accumulated) gradients, M reductions per step.
* loop: the plain module; after the last backward, one ``all_reduce`` per
  parameter, then a division by the world size.
* flat: the plain module; after the last backward, all gradients flattened
  into one buffer, one ``all_reduce``, copied back.
* fsdp2: ``fully_shard`` on every Linear and on the root (mesh on CPU, gloo).
  Every backward but the last with ``set_requires_gradient_sync(False)``,
  ``set_reshard_after_backward(False)`` and ``set_is_last_backward(False)``,
  as torch.distributed.pipelining's stage does (``backward_maybe_with_nosync``);
  the last with all three back on, so the reduce-scatters run in the last
  backward's hooks (the stage instead finalizes after it, in
  ``perform_reduce_grad``, with the same effect on the gradients). If
  ``fully_shard`` fails here, the error is printed and the variant skipped.

First a check, each variant from the same initial weights: after
``--check-steps`` steps on different batches (lr 0.05), both replicas'
weights must equal a single-process reference trained on the full global
batch within 1e-5 (rank 0 compares). The same steps count the collectives
each variant issues per step (DDP's reducer is C++: its count is its number
of buckets, once or M times). Then the timing: all variants built once,
alternating within each of ``--repeats`` repeats (the order rotating), each
``--warmup`` untimed steps then ``--steps`` timed ones between barriers;
medians over repeats, each variant's ratio to ddp-last (of the medians, and
per repeat). Peak RSS per process comes from one short extra launch per
variant named in ``--memory`` (default ddp-last, fsdp2, and loop, the plain
module, as the baseline: most of the growth is torch's own first-step
allocations and code): a fresh pair of processes, the resident size before
the model is built and the peak (``ru_maxrss``) after a few steps.

The machine may be shared: the per-repeat ratios (neighbouring runs) are the
steadiest figure. The last line printed is one JSON object.

    python bench/dp_reducer.py [--steps 20] [--warmup 2] [--repeats 5]
        [--check-steps 3] [--memory ddp-last,loop,fsdp2] [--timeout 600]

On a quiet 2-core machine the defaults take about two minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import os
import resource
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

WIDTH = 512
LAYERS = 8
MICROBATCHES = 8
MICROBATCH = 32
WORLD = 2
LOCAL_BATCH = MICROBATCHES * MICROBATCH
GLOBAL_BATCH = WORLD * LOCAL_BATCH
POOL = 4
"""Distinct global batches; step ``i`` trains on batch ``i % POOL``."""
LR = 1e-3
CHECK_LR = 0.05
"""Large enough that a wrong reduction moves the weights far past the tolerance."""
TOLERANCE = 1e-5
MEMORY_STEPS = 3
_PARENT = "EVT_DP_REDUCER_PARENT"
"""The environment variable that tells a worker its launching process's id."""

VARIANTS = ("ddp-last", "ddp-every", "loop", "flat", "fsdp2")


def make_mlp() -> nn.Sequential:
    """The MLP, the same initial weights on every call."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """``POOL`` global batches of inputs and targets."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(POOL * GLOBAL_BATCH, WIDTH, generator=gen)
    return x, torch.randn(POOL * GLOBAL_BATCH, WIDTH, generator=gen)


def local_microbatches(
    data: tuple[torch.Tensor, torch.Tensor], step: int, rank: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This replica's share of step ``step``'s global batch, in M microbatches."""
    first = (step % POOL) * GLOBAL_BATCH + rank * LOCAL_BATCH
    xs = data[0][first : first + LOCAL_BATCH].split(MICROBATCH)
    ys = data[1][first : first + LOCAL_BATCH].split(MICROBATCH)
    return list(zip(xs, ys, strict=True))


# -------------------------------------------------------------------- variants


class Variant:
    """One way to train a replica; ``step`` is one optimizer step over M microbatches."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def microbatch(self, x: torch.Tensor, y: torch.Tensor, last: bool) -> None:
        (F.mse_loss(self.model(x), y) / MICROBATCHES).backward()

    def reduce(self) -> None:
        """After the step's last backward: average the gradients if not done yet."""

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for m, (x, y) in enumerate(batches):
            self.microbatch(x, y, m == len(batches) - 1)
        self.reduce()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter's whole value (collective where they are sharded)."""
        return [p.detach() for p in self.model.parameters()]

    def buckets(self) -> int | None:
        """DDP's bucket count (its all-reduces are invisible from Python); None otherwise."""
        return None


class DdpLast(Variant):
    """evtrain's Replicas: accumulate under no_sync, arm the last backward by hand."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        from evtrain.stages.data_parallel import Replicas

        group = dist.group.WORLD
        assert group is not None
        self.replicas = Replicas(model, group, torch.device("cpu"))
        super().__init__(self.replicas.module, lr)

    def microbatch(self, x: torch.Tensor, y: torch.Tensor, last: bool) -> None:
        with self.replicas.accumulating():
            loss = F.mse_loss(self.replicas.module(x), y) / MICROBATCHES
        if last:
            self.replicas.arm([loss])
            loss.backward()
        else:
            with self.replicas.accumulating():
                loss.backward()

    def buckets(self) -> int | None:
        return _ddp_buckets(self.replicas.ddp)


class DdpEvery(Variant):
    """DDP as wrapped naively: every backward reduces."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        self.ddp = nn.parallel.DistributedDataParallel(model)
        super().__init__(self.ddp, lr)

    def buckets(self) -> int | None:
        return _ddp_buckets(self.ddp)


def _ddp_buckets(ddp: nn.parallel.DistributedDataParallel) -> int:
    # The reducer's current buckets: after the first reducing backward, rebuilt
    # in the order the gradients became ready (DDP's logging data is only
    # refreshed by forwards outside no_sync, so it is stale for ddp-last).
    return len(ddp.reducer._get_zeros_like_grad_buckets())


class Loop(Variant):
    """One all-reduce per parameter after the last backward."""

    def reduce(self) -> None:
        for p in self.model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad.div_(WORLD)


class Flat(Variant):
    """One all-reduce of all gradients in one flat buffer after the last backward."""

    def reduce(self) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(WORLD)
        for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(synced)


class Fsdp2(Variant):
    """fully_shard on every Linear and the root; gradients synced in the last backward only."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model.children():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        self.fsdp = fully_shard(model, mesh=mesh)
        super().__init__(model, lr)

    def microbatch(self, x: torch.Tensor, y: torch.Tensor, last: bool) -> None:
        self.fsdp.set_is_last_backward(last)
        self.fsdp.set_reshard_after_backward(last)
        self.fsdp.set_requires_gradient_sync(last)
        super().microbatch(x, y, last)

    def full_parameters(self) -> list[torch.Tensor]:
        from torch.distributed.tensor import DTensor

        return [
            p.full_tensor().detach() if isinstance(p, DTensor) else p.detach()
            for p in self.model.parameters()
        ]


FACTORIES: dict[str, Callable[[nn.Module, float], Variant]] = {
    "ddp-last": DdpLast,
    "ddp-every": DdpEvery,
    "loop": Loop,
    "flat": Flat,
    "fsdp2": Fsdp2,
}


# ----------------------------------------------------------- collective count

_COUNTED = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor")


@contextlib.contextmanager
def counting_collectives(counts: dict[str, int]) -> Iterator[None]:
    """Count the Python-level collectives called through ``torch.distributed`` inside."""
    originals = {name: getattr(dist, name) for name in _COUNTED if hasattr(dist, name)}

    def counter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapped

    for name, fn in originals.items():
        setattr(dist, name, counter(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


# ---------------------------------------------------------------- the workers


def _init(rank: int, port: int) -> None:
    _end_with_parent()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))


def _end_with_parent() -> None:
    """Have the kernel end this process when the launching process dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(os.environ.get(_PARENT, os.getppid())):
        os._exit(1)  # it died before the request above


def reference(data: tuple[torch.Tensor, torch.Tensor], steps: int) -> torch.Tensor:
    """One process, the whole global batch in one pass per step; the final flat weights."""
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=CHECK_LR)
    for i in range(steps):
        first = (i % POOL) * GLOBAL_BATCH
        x, y = data[0][first : first + GLOBAL_BATCH], data[1][first : first + GLOBAL_BATCH]
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check(
    names: list[str], data: tuple[torch.Tensor, torch.Tensor], steps: int, rank: int
) -> dict[str, Any]:
    """Each variant against the single-process reference, and its collectives per step."""
    expected = reference(data, steps) if rank == 0 else None
    out: dict[str, Any] = {}
    for name in names:
        variant = FACTORIES[name](make_mlp(), CHECK_LR)
        counts: dict[str, int] = {}
        for i in range(steps):
            batches = local_microbatches(data, i, rank)
            with counting_collectives(counts) if i == steps - 1 else contextlib.nullcontext():
                variant.step(batches)
        flat = torch.cat([p.reshape(-1) for p in variant.full_parameters()])
        gathered = [torch.empty_like(flat) for _ in range(WORLD)]
        dist.all_gather(gathered, flat)
        if rank == 0:
            assert expected is not None
            error = max(float((g - expected).abs().max()) for g in gathered)
            buckets = variant.buckets()
            if buckets is not None:
                counts["ddp_bucket_all_reduce"] = buckets * (
                    MICROBATCHES if name == "ddp-every" else 1
                )
            out[name] = {"max_abs_error": error, "ok": error <= TOLERANCE, "collectives": counts}
        del variant
    return out


def main_worker(rank: int, port: int, args: dict[str, Any], result: str) -> None:
    """Both ranks: the check, then alternating timed runs; rank 0 writes ``result``."""
    _init(rank, port)
    names: list[str] = args["variants"]
    data = make_data()
    checked = check(names, data, args["check_steps"], rank)
    variants = {name: FACTORIES[name](make_mlp(), LR) for name in names}
    rates: dict[str, list[float]] = {name: [] for name in names}
    step = 0
    for repeat in range(args["repeats"]):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in order:
            variant = variants[name]
            for _ in range(args["warmup"]):
                variant.step(local_microbatches(data, step, rank))
                step += 1
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args["steps"]):
                variant.step(local_microbatches(data, step, rank))
                step += 1
            dist.barrier()
            rate = args["steps"] / (time.perf_counter() - start)
            rates[name].append(rate)
            if rank == 0:
                print(f"repeat {repeat + 1}/{args['repeats']}  {name:10s} {rate:7.2f} steps/s")
                sys.stdout.flush()
    if rank == 0:
        Path(result).write_text(json.dumps({"check": checked, "rates": rates}))
    dist.destroy_process_group()


_VARIANT_MODULES = (
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "evtrain.stages.data_parallel",
)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def memory_worker(rank: int, port: int, name: str, result: str) -> None:
    """A fresh pair of processes, one variant: resident size before the model, peak after."""
    _init(rank, port)
    # Every variant's modules imported first, so "before" is the same baseline for all.
    for module in _VARIANT_MODULES:
        importlib.import_module(module)
    data = make_data()
    before = _rss_kib()
    variant = FACTORIES[name](make_mlp(), LR)
    for i in range(MEMORY_STEPS):
        variant.step(local_microbatches(data, i, rank))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    Path(f"{result}.{rank}").write_text(json.dumps({"before_kib": before, "peak_kib": peak}))
    dist.destroy_process_group()


# --------------------------------------------------------------------- launch


def free_port() -> int:
    from evtrain.bus.address import free_port_block

    return free_port_block()


def launch(fn: Callable[..., None], args: tuple[Any, ...], timeout: float) -> None:
    """Spawn WORLD processes running ``fn(rank, port, *args)``; all end before this returns.

    A failure in one process ends the others (and raises here); so does the
    timeout, or an interrupt of this process.
    """
    os.environ[_PARENT] = str(os.getpid())
    context = mp.start_processes(
        fn, args=(free_port(), *args), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} still running after {timeout:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
        for process in context.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


def last_error_line(error: BaseException) -> str:
    """The exception's own message: for a child's failure, its traceback's last line."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else repr(error)


# ------------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant and repeat")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each timing")
    parser.add_argument("--repeats", type=int, default=5, help="alternating repeats")
    parser.add_argument("--check-steps", type=int, default=3, help="steps of the correctness check")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset (ddp-last always)"
    )
    parser.add_argument(
        "--memory",
        default="ddp-last,loop,fsdp2",
        help="variants whose peak RSS is measured in fresh processes ('' for none)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    args = parser.parse_args()
    chosen = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    names = [n for n in VARIANTS if n in chosen or n == "ddp-last"]
    # A plain kill of this process still ends the workers (launch's finally).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    begun = time.monotonic()
    load_before = os.getloadavg()[0]  # the machine may be shared: say how busy it was

    measured = [n for n in args.memory.split(",") if n in names]
    probed = measured + (["fsdp2"] if "fsdp2" in names and "fsdp2" not in measured else [])
    fsdp2_error: str | None = None
    memory: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="evt-dpr-") as tmp:
        # The fsdp2 launch doubles as the check that fully_shard works here at all.
        for name in probed:
            path = Path(tmp) / f"memory-{name}"
            try:
                launch(memory_worker, (name, str(path)), args.timeout)
            except Exception as error:
                if name != "fsdp2":
                    raise
                fsdp2_error = last_error_line(error)
                print(f"fsdp2: skipped, fully_shard failed on CPU/gloo: {fsdp2_error}")
                names.remove("fsdp2")
                continue
            if name in measured:
                ranks = [json.loads(Path(f"{path}.{r}").read_text()) for r in range(WORLD)]
                memory[name] = {
                    "before_mib": max(r["before_kib"] for r in ranks) / 1024,
                    "peak_mib": max(r["peak_kib"] for r in ranks) / 1024,
                }
        settings = {
            "variants": names,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "check_steps": args.check_steps,
        }
        result = Path(tmp) / "result.json"
        launch(main_worker, (settings, str(result)), args.timeout)
        outcome = json.loads(result.read_text())
    checked: dict[str, Any] = outcome["check"]
    rates: dict[str, list[float]] = outcome["rates"]

    med = {name: statistics.median(values) for name, values in rates.items()}
    base = rates["ddp-last"]
    per_repeat = {
        name: [v / b for v, b in zip(values, base, strict=True)] for name, values in rates.items()
    }
    print()
    print(
        f"{'variant':10s} {'median':>8s} {'min':>8s} {'max':>8s} {'vs ddp-last':>12s} "
        f"{'per-repeat ratio (median)':>26s}  {'reference':>12s}  collectives/step"
    )
    for name in names:
        values = rates[name]
        c = checked[name]
        counts = ", ".join(f"{k} {v}" for k, v in sorted(c["collectives"].items())) or "-"
        verdict = f"{'ok' if c['ok'] else 'WRONG'} {c['max_abs_error']:.0e}"
        print(
            f"{name:10s} {med[name]:8.2f} {min(values):8.2f} {max(values):8.2f} "
            f"{med[name] / med['ddp-last']:12.3f} "
            f"{statistics.median(per_repeat[name]):26.3f}  {verdict:>12s}  {counts}"
        )
    for name, m in memory.items():
        print(
            f"peak RSS per process, {name:9s}: {m['peak_mib']:7.1f} MiB "
            f"({m['peak_mib'] - m['before_mib']:+.1f} MiB over the {m['before_mib']:.1f} MiB "
            "before the model was built)"
        )
    if fsdp2_error is not None:
        print(f"fsdp2 not run: {fsdp2_error}")
    wrong = [name for name in names if not checked[name]["ok"]]
    if wrong:
        print(f"WRONG: {', '.join(wrong)} differ from the single-process reference")
    elapsed = time.monotonic() - begun
    load_after = os.getloadavg()[0]
    print(
        f"took {elapsed:.0f} s; 1-minute load average "
        f"{load_before:.2f} before, {load_after:.2f} after"
    )

    def rounded(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    def ratio(name: str) -> float | None:
        return rounded(med[name] / med["ddp-last"]) if name in med else None

    summary: dict[str, Any] = {
        f"{name.replace('-', '_')}_steps_per_s": rounded(med.get(name)) for name in VARIANTS
    }
    summary.update(
        ddp_every_vs_last=ratio("ddp-every"),
        loop_vs_ddp=ratio("loop"),
        flat_vs_ddp=ratio("flat"),
        fsdp2_vs_ddp=ratio("fsdp2"),
        ratio_per_repeat={
            name.replace("-", "_"): [round(r, 3) for r in values]
            for name, values in per_repeat.items()
            if name != "ddp-last"
        },
        steps_per_s_runs={
            name.replace("-", "_"): [round(v, 3) for v in values] for name, values in rates.items()
        },
        matches_reference={name.replace("-", "_"): checked[name]["ok"] for name in names},
        max_abs_error={name.replace("-", "_"): checked[name]["max_abs_error"] for name in names},
        fsdp2_error=fsdp2_error,
        peak_rss_mib={
            name.replace("-", "_"): round(m["peak_mib"], 1) for name, m in memory.items()
        },
        peak_rss_growth_mib={
            name.replace("-", "_"): round(m["peak_mib"] - m["before_mib"], 1)
            for name, m in memory.items()
        },
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        seconds=round(elapsed, 1),
        load_average_before=round(load_before, 2),
        load_average_after=round(load_after, 2),
    )
    print(json.dumps(summary))
    return 0 if not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
