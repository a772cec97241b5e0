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

A second model checks structured stage boundaries: a small pre-LN decoder
(token + position embedding, 4 blocks of 4-head causal attention and a 4x
MLP, a LayerNorm + linear head; width 128, sequence 32, vocabulary 256) on
dict samples with a boolean padding mask that every block's attention uses.
Each layer returns ``(hidden, mask)``, so the P = 2 stages (embedding + 2
blocks | 2 blocks + head) pass that tuple across the boundary. evtrain 1F1B
(the same machinery as above) runs against torch.distributed.pipelining's
PipelineStage + Schedule1F1B on the same layers split the same way; M = 8
microbatches of 4 sequences, one thread per process, cross-entropy over the
unpadded tokens.

Contenders alternate within each repeat; medians over repeats are reported.
The bubble bound is ``P * M / (M + P - 1)`` times the sequential rate.
The last line printed is one JSON object.

    python bench/pipeline_vs_torch.py [--steps 100] [--warmup 10] [--repeats 3]
        [--transformer-steps 30] [--transformer-warmup 3]
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
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
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


# ------------------------------------------ transformer with tuple boundaries

# Smaller than a "real" decoder on purpose: at width 256, sequence 64 and
# microbatch 8 one step of this model takes about a second in one thread on
# this kind of 2-core machine, too long for several alternating repeats;
# these sizes keep a pipelined step under 100 ms, near the MLP case's.
T_WIDTH = 128
T_HEADS = 4
T_SEQ = 32
T_VOCAB = 256
T_BLOCKS = 4
T_MICROBATCH = 4
T_BATCH = T_MICROBATCH * MICROBATCHES
T_SAMPLES = 4 * T_BATCH
T_BALANCE = (3, 3)
"""Layers per stage: embedding + 2 blocks | 2 blocks + head, given to both contenders."""


class Embed(nn.Module):
    """Token + learned position embedding; passes the padding mask on."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(T_VOCAB, T_WIDTH)
        self.pos = nn.Embedding(T_SEQ, T_WIDTH)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tok(input_ids) + self.pos.weight, attention_mask


class Block(nn.Module):
    """Pre-LN causal self-attention and MLP; padded keys are masked out."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(T_WIDTH)
        self.qkv = nn.Linear(T_WIDTH, 3 * T_WIDTH)
        self.proj = nn.Linear(T_WIDTH, T_WIDTH)
        self.ln2 = nn.LayerNorm(T_WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(T_WIDTH, 4 * T_WIDTH), nn.GELU(), nn.Linear(4 * T_WIDTH, T_WIDTH)
        )

    def forward(
        self, hidden: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = hidden.shape
        q, k, v = (
            t.view(b, s, T_HEADS, T_WIDTH // T_HEADS).transpose(1, 2)
            for t in self.qkv(self.ln1(hidden)).chunk(3, dim=-1)
        )
        # Built on the input's device: evtrain surveys the layers on meta.
        causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
        own = torch.eye(s, dtype=torch.bool, device=mask.device)
        # A position always sees itself, so a row is never fully masked (NaN).
        allowed = causal & mask[:, None, None, :] | own
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        hidden = hidden + self.proj(attn.transpose(1, 2).reshape(b, s, T_WIDTH))
        return hidden + self.mlp(self.ln2(hidden)), mask


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection; the mask ends here."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(T_WIDTH)
        self.out = nn.Linear(T_WIDTH, T_VOCAB, bias=False)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(hidden))


def transformer_layers() -> list[Callable[[], nn.Module]]:
    """The decoder's layers in order, as zero-argument factories."""
    return [Embed, *([Block] * T_BLOCKS), Head]


def transformer_samples() -> dict[str, torch.Tensor]:
    """Random token sequences of random length, padded; labels are the next token."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, T_VOCAB, (T_SAMPLES, T_SEQ), generator=g)
    lengths = torch.randint(T_SEQ // 4, T_SEQ + 1, (T_SAMPLES,), generator=g)
    mask = torch.arange(T_SEQ)[None, :] < lengths[:, None]
    labels = torch.roll(ids, -1, dims=1).masked_fill(~mask, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def transformer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the unpadded tokens of one microbatch."""
    return F.cross_entropy(logits.reshape(-1, T_VOCAB), labels.reshape(-1), ignore_index=-100)


# The spec imports the model from this file, so both contenders build the
# very same classes.
TRANSFORMER_SPEC = f"""
import functools
import sys
import torch
sys.path.append({str(Path(__file__).resolve().parent)!r})
import pipeline_vs_torch as bench
from evtrain.job import Job, layer

job = Job(
    name="bench-transformer",
    layers=[layer(f) for f in bench.transformer_layers()],
    loss_fn=bench.transformer_loss,
    optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
    train_data=bench.transformer_samples,
    input_keys=("input_ids", "attention_mask"),
    target_keys="labels",
    batch_size={T_BATCH},
    num_microbatches={MICROBATCHES},
    balance={list(T_BALANCE)},
    max_steps=10,
    stages={STAGES},
    threads=1,
)
"""


class _Chain(nn.Module):
    """Layers applied in turn by evtrain's calling convention (a tuple becomes positional args)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        value: torch.Tensor | tuple[torch.Tensor, ...] = args
        for module in self.layers:
            value = module(*value) if isinstance(value, tuple) else module(value)
        return value


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
        # torch 2.13 takes requires_grad from these examples: without it on a later
        # stage's input, that stage skips its input gradient and the first stage
        # trains on zeros (less work than the real training evtrain does).
        input_args=(torch.empty(mb, WIDTH, requires_grad=rank > 0),),
        output_args=torch.empty(mb, WIDTH, requires_grad=True),
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


def torch_transformer_worker(steps: int, warmup: int) -> float | None:
    """One rank of PipelineStage + Schedule1F1B on the decoder; rank 0 returns steps/s."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    _maybe_pin()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    start = sum(T_BALANCE[:rank])
    torch.manual_seed(rank)
    factories = transformer_layers()[start : start + T_BALANCE[rank]]
    module = _Chain([f() for f in factories])
    mb = T_MICROBATCH
    # Static shapes, as for the MLP, but torch 2.13 takes each boundary
    # tensor's requires_grad from these examples: an example hidden state
    # without it makes the next stage's receive buffer a non-grad tensor, so
    # that stage skips its input gradient and the first stage silently
    # backpropagates zeros. With the flags as at run time, torch derives the
    # gradient metadata itself: a slot for the hidden state, none for the bool
    # mask (requires_grad False), so the mask travels forward only and no
    # zero gradient is sent back for it. The mask needs no kwargs detour: the
    # tuple (hidden, mask) is the stage's positional output and the next
    # stage's positional input.
    hidden = torch.empty(mb, T_SEQ, T_WIDTH, requires_grad=True)
    mask = torch.empty(mb, T_SEQ, dtype=torch.bool)
    ids = torch.empty(mb, T_SEQ, dtype=torch.long)
    stage = PipelineStage(
        module,
        rank,
        world,
        torch.device("cpu"),
        input_args=(ids, mask) if first else (hidden, mask),
        output_args=torch.empty(mb, T_SEQ, T_VOCAB, requires_grad=True) if last else (hidden, mask),
    )
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=transformer_loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    data = transformer_samples()
    batch = {k: v[:T_BATCH] for k, v in data.items()}
    t0 = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        if first:
            schedule.step(batch["input_ids"], batch["attention_mask"])
        elif last:
            schedule.step(target=batch["labels"], losses=[])
        else:
            schedule.step()
        if i == 0 and not any(
            bool(p.grad.any()) for p in module.parameters() if p.grad is not None
        ):
            # The failure mode above is silent; refuse to time a peer that
            # does not train every stage.
            raise RuntimeError(f"torch stage {rank} got no gradient")
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    dist.destroy_process_group()
    return steps / elapsed if first else None


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


def run_evtrain(spec: Path, schedule: str, steps: int, warmup: int, label: str = "") -> float:
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
            run_id=f"bench-{label or schedule}",
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
    parser.add_argument(
        "--transformer-steps",
        type=int,
        default=30,
        help="timed steps per contender on the decoder with tuple boundaries",
    )
    parser.add_argument(
        "--transformer-warmup", type=int, default=3, help="untimed decoder steps first"
    )
    args = parser.parse_args()
    os.environ.setdefault("EVTRAIN_LOG_LEVEL", "warning")
    if args.pin:
        os.environ["EVTRAIN_PIN_CPU"] = "1"

    names = (
        "evtrain_1f1b",
        "torch_1f1b",
        "evtrain_gpipe",
        "torch_gpipe",
        "sequential",
        "evtrain_transformer",
        "torch_transformer",
    )
    chosen = [n for n in args.only.split(",") if n] or list(names)
    unknown = set(chosen) - set(names)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(names)}")
    results: dict[str, list[float]] = {k: [] for k in names if k in chosen}
    with tempfile.TemporaryDirectory(prefix="evt-bench-") as tmp:
        spec = Path(tmp) / "bench_spec.py"
        spec.write_text(SPEC)
        transformer_spec = Path(tmp) / "bench_transformer_spec.py"
        transformer_spec.write_text(TRANSFORMER_SPEC)
        t_steps, t_warmup = args.transformer_steps, args.transformer_warmup
        for repeat in range(args.repeats):
            for name in results:
                if name == "evtrain_transformer":
                    rate = run_evtrain(transformer_spec, "1f1b", t_steps, t_warmup, "transformer")
                elif name == "torch_transformer":
                    out = _launch(STAGES, torch_transformer_worker, t_steps, t_warmup)
                    rate = float(out[0])
                elif name.startswith("evtrain_"):
                    rate = run_evtrain(spec, name.split("_")[1], args.steps, args.warmup)
                elif name.startswith("torch_"):
                    out = _launch(STAGES, torch_worker, name.split("_")[1], args.steps, args.warmup)
                    rate = float(out[0])
                else:
                    rate = float(_launch(1, sequential_worker, args.steps, args.warmup)[0])
                results[name].append(rate)
                print(
                    f"repeat {repeat + 1}/{args.repeats}  {name:19s} {rate:6.2f} steps/s",
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
    print(f"{'contender':19s} {'median':>8s} {'best':>8s}  runs (steps/s)")
    for name, values in results.items():
        runs = " ".join(f"{v:.2f}" for v in values)
        print(f"{name:19s} {statistics.median(values):8.2f} {max(values):8.2f}  {runs}")
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
    ratio_transformer = ratio(med["evtrain_transformer"], med["torch_transformer"])
    per_repeat_transformer = [
        e / t
        for e, t in zip(
            results.get("evtrain_transformer", []),
            results.get("torch_transformer", []),
            strict=False,
        )
    ]
    each_transformer = " ".join(f"{r:.3f}" for r in per_repeat_transformer)
    print(
        f"decoder, (hidden, mask) boundary: evtrain {fmt(med['evtrain_transformer'])}, "
        f"torch {fmt(med['torch_transformer'])} steps/s"
    )
    print(f"evtrain/torch 1F1B decoder {fmt(ratio_transformer)}  (per repeat: {each_transformer})")

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
        "evtrain_transformer_steps_per_s": rounded(med["evtrain_transformer"]),
        "torch_transformer_steps_per_s": rounded(med["torch_transformer"]),
        "ratio_transformer_tuple": rounded(ratio_transformer),
        "ratio_transformer_tuple_per_repeat": [round(r, 3) for r in per_repeat_transformer],
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "transformer_steps": t_steps,
        "transformer_warmup": t_warmup,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
