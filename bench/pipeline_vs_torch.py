"""evtrain's pipeline engine vs torch.distributed.pipelining, side by side in one run.

Model: an MLP of 8 Linear(512, 512) + ReLU layers, batch 256 split into M
microbatches over P stages (one process each, gloo on CPU, one torch thread
per process), SGD, MSE loss. Each contender trains a fixed number of steps
after a warm-up:

* evtrain 1F1B, zero bubble ("zb", ZB-H1), interleaved 1F1B (two model
  chunks per stage) and zero bubble in a V ("zbv", ZB-V: two chunks per
  stage) over the grid of (P, M) configurations (``--grid``,
  default P = 2, 4 and M = 8, 16), and GPipe at
  P = 2, M = 8 — real stage workers started with torch.distributed.elastic,
  publishing their events to a real broker with the default event settings
  (microbatch spans "sampled"); a subscriber in this process plays the hook.
  Steps/s come from the last stage's StepEnded timestamps (first timed
  step's start to last step's end).
* their torch twins on the same layers with static shapes
  (input_args/output_args), also under elastic: Schedule1F1B,
  ScheduleInterleavedZeroBubble given one stage per rank (which orders
  ZB-H1 as evtrain does), ScheduleInterleaved1F1B given two stages per rank
  (the model in 2P chunks, as evtrain splits it), ScheduleZBVZeroBubble
  (rank r holding chunks r and 2P-1-r; evtrain places the same V turned
  around, the same work on every process) and ScheduleGPipe.
* sequential: one process runs the same M microbatches one after another.

The bubble bound of a schedule is P times the sequential rate times one
minus its bubble fraction with a backward twice a forward
(`evtrain.stages.schedules.bubble_fraction`: ``(P-1)/(M+P-1)`` for 1F1B,
``(P-1)/(3M+P-1)`` for zero bubble, ``(P-1)/(2M+P-1)`` for interleaved over
two chunks, ``(P-1)/(6M+P-1)`` for zbv at M >= 2P-1); P = 4 on 2 cores cannot
reach it by construction (four stages share two cores), so there the ratios
to torch are the figures that mean something. "Removes X of 1F1B's lost
time" compares the time per step beyond P stages computing all the time
(the bubble, and every other cost of running a pipeline: the 1F1B order
itself runs each forward and backward slower than the sequential
all-forwards-then-all-backwards on a CPU, messages, the optimizer, Python).
"Removes X of 1F1B's idle time" compares the bubble itself: the time the
stages spent blocked on each other, summed over the stages (each stage's
``StepEnded.comm_wait_s``: point-to-point waits and the step boundary's
control exchange), per step.

The same decoder given as one model measures what running a model's own
forward costs: its plain forward run as written (stand-ins for the other
stage's units, ``evtrain_unmodified``) against the same decoder written to
the pruning rules (``evtrain_rules``, ``pruned_forward=True``), and Hugging
Face's ``LlamaForCausalLM`` of the same size, unmodified, at P = 2 against
one process training it on the same microbatches (``single_hf_llama``);
torch's tracer (``pipeline()``) is tried on that model and the summary says
whether it splits it (``torch_tracer_hf_llama``).

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

Contenders alternate within each repeat (the order reversed every other
repeat); medians over repeats are reported. The last line printed is one
JSON object: its top-level keys describe P = 2, M = 8 (``ratio_1f1b``,
``bound_fraction_1f1b``, ``ratio_zb``, ``bound_fraction_zb``,
``ratio_interleaved``, ``ratio_zbv``, ``zb_idle_recovered``...), ``grid``
has every configuration.

    python bench/pipeline_vs_torch.py [--steps 100] [--warmup 10] [--repeats 3]
        [--grid 2x8,2x16,4x8,4x16] [--transformer-steps 30] [--transformer-warmup 3]
        [--only evtrain_zbv,torch_zbv,...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


class Decoder(nn.Module):
    """The same decoder as one model with a plain forward, as its author would write it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed: nn.Module | None = Embed()
        self.blocks = nn.ModuleList(Block() for _ in range(T_BLOCKS))
        self.head: nn.Module | None = Head()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        assert self.embed is not None and self.head is not None
        hidden, mask = self.embed(input_ids, attention_mask)
        for block in self.blocks:
            hidden, mask = block(hidden, mask)
        return self.head(hidden, mask)


class RulesDecoder(Decoder):
    """The same decoder written to the pruning rules (``pruned_forward=True``)."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        # A later stage receives (hidden, mask) in place of the two inputs.
        value: Any = (input_ids, attention_mask)
        if self.embed is not None:
            value = self.embed(*value)
        for block in self.blocks:
            value = block(*value)
        return value if self.head is None else self.head(*value)


def hf_llama() -> nn.Module:
    """Hugging Face's LlamaForCausalLM sized like the decoder, unmodified."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=T_VOCAB,
        hidden_size=T_WIDTH,
        intermediate_size=4 * T_WIDTH,
        num_hidden_layers=T_BLOCKS,
        num_attention_heads=T_HEADS,
        num_key_value_heads=T_HEADS,
        max_position_embeddings=T_SEQ,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def hf_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return transformer_loss(output.logits, labels)


def model_spec(factory: str, loss: str, pruned: bool) -> str:
    """A job spec of the decoder given as one model (``factory`` in this file)."""
    return f"""
import functools
import sys
import torch
sys.path.append({str(Path(__file__).resolve().parent)!r})
import pipeline_vs_torch as bench
from evtrain.job import Job

job = Job(
    name="bench-{factory}",
    model=bench.{factory},
    pruned_forward={pruned},
    split_points=["{"blocks.2" if "Decoder" in factory else "model.layers.2"}"],
    loss_fn=bench.{loss},
    optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
    train_data=bench.transformer_samples,
    input_keys=("input_ids", "attention_mask"),
    target_keys="labels",
    batch_size={T_BATCH},
    num_microbatches={MICROBATCHES},
    max_steps=10,
    stages={STAGES},
    threads=1,
)
"""


MODEL_SPECS = {
    "evtrain_unmodified": model_spec("Decoder", "transformer_loss", False),
    "evtrain_rules": model_spec("RulesDecoder", "transformer_loss", True),
    "evtrain_hf_llama": model_spec("hf_llama", "hf_loss", False),
}
"""The decoder as one model: its plain forward as written, the same decoder written
to the pruning rules, and Hugging Face's Llama as written."""


def single_hf_llama_worker(steps: int, warmup: int) -> float:
    """One process trains the Hugging Face Llama on the same microbatches; steps/s."""
    _maybe_pin()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = hf_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = transformer_samples()
    batch = {k: v[:T_BATCH].split(T_MICROBATCH) for k, v in data.items()}
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        for ids, mask, labels in zip(*batch.values(), strict=True):
            out = model(input_ids=ids, attention_mask=mask)
            (hf_loss(out, labels) / MICROBATCHES).backward()
        optimizer.step()
        optimizer.zero_grad()
    return steps / (time.perf_counter() - start)


def torch_tracer_on_hf_llama() -> str:
    """Whether torch.distributed.pipelining's tracer splits the same model: "ok", or why not."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    model = hf_llama()
    data = transformer_samples()
    args = (data["input_ids"][:T_MICROBATCH],)
    kwargs = {"attention_mask": data["attention_mask"][:T_MICROBATCH]}
    try:
        pipeline(
            model,
            mb_args=args,
            mb_kwargs=kwargs,
            split_spec={"model.layers.2": SplitPoint.BEGINNING},
        )
    except Exception as exc:
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return "ok"


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


def timed_steps(step: Callable[[int], None], warmup: int, steps: int) -> float:
    """Seconds per step of ``step(i)`` over ``steps`` steps after ``warmup`` untimed
    ones, between barriers of the default group, so every rank times the same span."""
    for i in range(warmup):
        step(i)
    dist.barrier()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    dist.barrier()
    return (time.perf_counter() - start) / steps


def torch_worker(kind: str, microbatches: int, steps: int, warmup: int) -> float | None:
    """One rank of torch.distributed.pipelining (one stage per rank); rank 0 returns steps/s.

    ``kind``: ``1f1b`` (Schedule1F1B), ``gpipe`` (ScheduleGPipe), ``zb``
    (ScheduleInterleavedZeroBubble with its one local stage: ZB-H1's order) or
    ``interleaved`` (ScheduleInterleaved1F1B over `VIRTUAL_STAGES` local stages
    per rank, rank r holding stages r, r + P, ...) or ``zbv``
    (ScheduleZBVZeroBubble, rank r holding stages r and 2P - 1 - r).
    """
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    _maybe_pin()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = CHUNKS.get(kind, 1)
    per_stage = 2 * LAYERS // (world * chunks)
    torch.manual_seed(rank)
    mb = BATCH // microbatches
    stages, modules = [], []
    held = [rank, 2 * world - 1 - rank] if kind == "zbv" else range(rank, world * chunks, world)
    for index in held:
        module = _mlp_layers(index * per_stage, (index + 1) * per_stage)
        modules.append(module)
        stages.append(
            PipelineStage(
                module,
                index,
                world * chunks,
                torch.device("cpu"),
                # torch 2.13 takes requires_grad from these examples: without it on
                # a later stage's input, that stage skips its input gradient and the
                # first stage trains on zeros (less work than evtrain's real training).
                input_args=(torch.empty(mb, WIDTH, requires_grad=index > 0),),
                output_args=torch.empty(mb, WIDTH, requires_grad=True),
                output_grads=(torch.empty(mb, WIDTH),),
                input_grads=(torch.empty(mb, WIDTH),),
            )
        )
    loss = nn.functional.mse_loss
    schedule: Any
    if kind == "zb":
        schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=microbatches, loss_fn=loss)
    elif kind == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss)
    elif kind == "zbv":
        schedule = ScheduleZBVZeroBubble(stages, n_microbatches=microbatches, loss_fn=loss)
    else:
        cls = Schedule1F1B if kind == "1f1b" else ScheduleGPipe
        schedule = cls(stages[0], n_microbatches=microbatches, loss_fn=loss)
    optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)

    def step(_: int) -> None:
        if kind == "zbv" and rank == 0:  # the V's two ends
            schedule.step(x, target=y, losses=[])
        elif rank == 0:
            schedule.step(x)
        elif rank == world - 1 and kind != "zbv":
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()

    step_s = timed_steps(step, warmup, steps)
    dist.destroy_process_group()
    return 1 / step_s if rank == 0 else None


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

    def step(i: int) -> None:
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

    step_s = timed_steps(step, warmup, steps)
    dist.destroy_process_group()
    return 1 / step_s if first else None


def sequential_worker(microbatches: int, steps: int, warmup: int) -> float:
    """One process, the same microbatches in sequence; returns steps/s."""
    _maybe_pin()
    torch.set_num_threads(1)
    model = _mlp_layers(0, 2 * LAYERS)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)
    xs, ys = x.chunk(microbatches), y.chunk(microbatches)
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        for xm, ym in zip(xs, ys, strict=True):
            (nn.functional.mse_loss(model(xm), ym) / microbatches).backward()
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


def run_events(
    spec: Path, overrides: dict[str, str], stages: int, run_id: str, topics: tuple[str, ...]
) -> list[Any]:
    """Launch evtrain's stage workers with a live bus; the events of ``topics`` they
    published (a subscriber in this process plays the hook)."""
    from evtrain.bus import Broker, BusAddress, Subscriber
    from evtrain.stages.entry import worker_main
    from evtrain.stages.worker import WorkerConfig

    address = BusAddress.new_ipc()
    with Broker(address), _removing(address.location):
        sub = Subscriber(address.endpoint("events_out"), topics=topics)
        config = WorkerConfig(
            spec_path=str(spec), overrides=overrides, bus=str(address), run_id=run_id
        )
        _launch(stages, worker_main, config.encode())
        events: list[Any] = []
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 0.5:
            batch = sub.drain()
            if batch:
                events.extend(batch)
                quiet_since = time.monotonic()
            time.sleep(0.01)
        sub.close()
    return events


def run_evtrain(
    spec: Path,
    schedule: str,
    steps: int,
    warmup: int,
    label: str = "",
    *,
    stages: int = STAGES,
    microbatches: int = MICROBATCHES,
    virtual_stages: int = 1,
) -> tuple[float, float]:
    """Launch evtrain's stage workers with a live bus: steps/s from the last
    stage's StepEnded events, and the seconds per step the stages spent blocked
    on each other (their ``comm_wait_s``, summed over the stages, timed steps)."""
    from evtrain.events import StepEnded, StepStarted

    overrides = {
        "schedule": schedule,
        "steps": str(warmup + steps),
        "stages": str(stages),
        "microbatches": str(microbatches),
        "virtual_stages": str(virtual_stages),
    }
    events = run_events(spec, overrides, stages, f"bench-{label or schedule}", ("step.",))
    last = stages - 1
    started = {e.step: e.ts for e in events if isinstance(e, StepStarted) and e.stage == last}
    ended = {e.step: e.ts for e in events if isinstance(e, StepEnded) and e.stage == last}
    first, final = warmup + 1, warmup + steps
    if first not in started or final not in ended:
        raise RuntimeError(f"missing step events ({len(events)} received)")
    waits = [
        e.comm_wait_s
        for e in events
        if isinstance(e, StepEnded) and first <= e.step <= final and e.replica == 0
    ]
    if len(waits) != stages * steps:
        raise RuntimeError(f"{len(waits)} step ends of {stages} stages x {steps} steps")
    return steps / (ended[final] - started[first]), sum(waits) / steps


# ------------------------------------------------------------------------ main


SCHEDULES = ("1f1b", "zb", "interleaved", "zbv")
"""The schedules timed over the whole grid, each against its torch twin."""
VIRTUAL_STAGES = 2
"""Model chunks per stage for interleaved, on both sides."""
CHUNKS = {"interleaved": VIRTUAL_STAGES, "zbv": 2}
"""Model chunks per stage of the chunked schedules."""
TWINS = {
    "1f1b": "Schedule1F1B",
    "zb": "ScheduleInterleavedZeroBubble, 1 stage/rank",
    "interleaved": f"ScheduleInterleaved1F1B, {VIRTUAL_STAGES} stages/rank",
    "zbv": "ScheduleZBVZeroBubble, 2 stages/rank",
}
HEADLINE = (STAGES, MICROBATCHES)
"""The configuration the summary's top-level keys describe (P=2, M=8)."""
KINDS = (
    *(f"{side}_{s}" for s in SCHEDULES for side in ("evtrain", "torch")),
    "evtrain_gpipe",
    "torch_gpipe",
    "sequential",
    "evtrain_transformer",
    "torch_transformer",
    *MODEL_SPECS,
    "single_hf_llama",
)
HEADLINE_ONLY = {
    "evtrain_gpipe",
    "torch_gpipe",
    "evtrain_transformer",
    "torch_transformer",
    *MODEL_SPECS,
    "single_hf_llama",
}


def _grid(text: str) -> list[tuple[int, int]]:
    configs = []
    for item in text.split(","):
        p, _, m = item.strip().partition("x")
        if not (p.isdigit() and m.isdigit()) or int(p) < 2 or BATCH % int(m):
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected PxM with P >= 2 and M dividing {BATCH}, e.g. 2x8"
            )
        configs.append((int(p), int(m)))
    return configs


def _bound(kind: str, P: int, M: int, sequential: float | None) -> float | None:
    """The bubble bound: P stages computing all the time but for the schedule's bubble."""
    from evtrain.stages.simulator import bubble_fraction

    if sequential is None:
        return None
    return P * sequential * (1 - bubble_fraction(P, M, kind, CHUNKS.get(kind, 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats")
    parser.add_argument(
        "--grid",
        type=_grid,
        default=_grid("2x8,2x16,4x8,4x16"),
        help="comma-separated PxM configurations for the schedules (default: "
        "2x8,2x16,4x8,4x16); GPipe and the decoder run at 2x8 only",
    )
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated subset of contenders ({', '.join(KINDS)}) for quick "
        "checks; the summary then has null for the others",
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

    chosen = [n for n in args.only.split(",") if n] or list(KINDS)
    unknown = set(chosen) - set(KINDS)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(KINDS)}")
    grid: list[tuple[int, int]] = list(dict.fromkeys([HEADLINE, *args.grid]))
    runs: list[tuple[str, int, int]] = []
    for P, M in grid:
        for kind in KINDS:
            if kind not in chosen or (kind in HEADLINE_ONLY and (P, M) != HEADLINE):
                continue
            if kind == "sequential" and any(k == kind and m == M for k, _, m in runs):
                continue  # one process: the same for every P
            runs.append((kind, P, M))
    results: dict[tuple[str, int, int], list[float]] = {r: [] for r in runs}
    idle: dict[tuple[str, int, int], list[float]] = {r: [] for r in runs if r[0] != "sequential"}
    with tempfile.TemporaryDirectory(prefix="evt-bench-") as tmp:
        spec = Path(tmp) / "bench_spec.py"
        spec.write_text(SPEC)
        transformer_spec = Path(tmp) / "bench_transformer_spec.py"
        transformer_spec.write_text(TRANSFORMER_SPEC)
        t_steps, t_warmup = args.transformer_steps, args.transformer_warmup
        model_specs = {}
        for kind, text in MODEL_SPECS.items():
            model_specs[kind] = Path(tmp) / f"bench_{kind}_spec.py"
            model_specs[kind].write_text(text)
        for repeat in range(args.repeats):
            # Reversed every other repeat: slow drift of the machine's load cancels.
            for kind, P, M in runs if repeat % 2 == 0 else runs[::-1]:
                if kind == "evtrain_transformer":
                    rate, waited = run_evtrain(
                        transformer_spec, "1f1b", t_steps, t_warmup, "transformer"
                    )
                    idle[kind, P, M].append(waited)
                elif kind == "torch_transformer":
                    rate = float(_launch(P, torch_transformer_worker, t_steps, t_warmup)[0])
                elif kind in model_specs:
                    rate, waited = run_evtrain(model_specs[kind], "1f1b", t_steps, t_warmup, kind)
                    idle[kind, P, M].append(waited)
                elif kind == "single_hf_llama":
                    rate = float(_launch(1, single_hf_llama_worker, t_steps, t_warmup)[0])
                elif kind.startswith("evtrain_"):
                    schedule = kind.split("_")[1]
                    rate, waited = run_evtrain(
                        spec,
                        schedule,
                        args.steps,
                        args.warmup,
                        stages=P,
                        microbatches=M,
                        virtual_stages=CHUNKS.get(schedule, 1),
                    )
                    idle[kind, P, M].append(waited)
                elif kind.startswith("torch_"):
                    out = _launch(P, torch_worker, kind.split("_")[1], M, args.steps, args.warmup)
                    rate = float(out[0])
                else:
                    rate = float(_launch(1, sequential_worker, M, args.steps, args.warmup)[0])
                results[kind, P, M].append(rate)
                print(
                    f"repeat {repeat + 1}/{args.repeats}  P={P} M={M:<3d} {kind:19s} "
                    f"{rate:6.2f} steps/s",
                    flush=True,
                )
    tracer = torch_tracer_on_hf_llama() if "evtrain_hf_llama" in chosen else None
    _report(results, idle, grid, args, tracer)


def _report(
    results: dict[tuple[str, int, int], list[float]],
    idle: dict[tuple[str, int, int], list[float]],
    grid: list[tuple[int, int]],
    args: argparse.Namespace,
    tracer: str | None,
) -> None:
    def med(kind: str, P: int, M: int) -> float | None:
        if kind == "sequential":  # run once per M, at the first P that has it
            values = next((v for (k, _, m), v in results.items() if k == kind and m == M), None)
        else:
            values = results.get((kind, P, M))
        return statistics.median(values) if values else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a / b

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    def rounded(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    def per_repeat(a: str, b: str, P: int, M: int) -> list[float]:
        pairs = zip(results.get((a, P, M), []), results.get((b, P, M), []), strict=False)
        return [round(x / y, 3) for x, y in pairs]

    print()
    print(f"{'contender':19s} {'P':>2s} {'M':>3s} {'median':>8s} {'best':>8s}  runs (steps/s)")
    for (kind, P, M), values in results.items():
        runs = " ".join(f"{v:.2f}" for v in values)
        print(
            f"{kind:19s} {P:2d} {M:3d} {statistics.median(values):8.2f} {max(values):8.2f}  {runs}"
        )
    print()
    rows = []
    for P, M in grid:
        sequential = med("sequential", P, M)
        ideal = None if sequential is None else P * sequential
        row: dict[str, Any] = {"stages": P, "microbatches": M}
        for schedule in SCHEDULES:
            ours, theirs = med(f"evtrain_{schedule}", P, M), med(f"torch_{schedule}", P, M)
            bound = _bound(schedule, P, M, sequential)
            row[f"evtrain_{schedule}_steps_per_s"] = rounded(ours)
            row[f"torch_{schedule}_steps_per_s"] = rounded(theirs)
            row[f"ratio_{schedule}"] = rounded(ratio(ours, theirs))
            row[f"ratio_{schedule}_per_repeat"] = per_repeat(
                f"evtrain_{schedule}", f"torch_{schedule}", P, M
            )
            row[f"bound_{schedule}_steps_per_s"] = rounded(bound)
            row[f"bound_fraction_{schedule}"] = rounded(ratio(ours, bound))
            print(
                f"P={P} M={M:<3d} evtrain/torch {schedule:5s} {fmt(ratio(ours, theirs))}  "
                f"(twin: {TWINS[schedule]}; per repeat: "
                f"{' '.join(map(str, row[f'ratio_{schedule}_per_repeat']))})  "
                f"bubble bound {fmt(bound)} steps/s, reached {fmt(ratio(ours, bound))}"
            )
        one = med("evtrain_1f1b", P, M)
        one_idle = statistics.median(idle.get(("evtrain_1f1b", P, M)) or [math.nan])
        for name in ("zb", "zbv"):
            rate = med(f"evtrain_{name}", P, M)
            recovered = None
            if ideal is not None and one is not None and rate is not None and 1 / one > 1 / ideal:
                # Time per step beyond P stages computing all the time: what the bubble
                # (and the pipeline's overheads) cost; the share of it zero bubble removes.
                recovered = 1 - (1 / rate - 1 / ideal) / (1 / one - 1 / ideal)
            waited = statistics.median(idle.get((f"evtrain_{name}", P, M)) or [math.nan])
            idle_recovered = 1 - waited / one_idle if one_idle > 0 else math.nan
            row[f"{name}_bubble_recovered"] = rounded(recovered)
            row[f"{name}_idle_recovered"] = (
                None if math.isnan(idle_recovered) else rounded(idle_recovered)
            )
            print(
                f"P={P} M={M:<3d} {name} removes {fmt(recovered)} of 1F1B's lost time and "
                f"{fmt(row[f'{name}_idle_recovered'])} of its idle time "
                f"({1e3 * waited:.1f} vs {1e3 * one_idle:.1f} ms blocked per step, all stages)"
            )
        rows.append(row)

    P, M = HEADLINE
    headline = rows[0]
    ratio_1f1b = headline["ratio_1f1b"]
    ratio_gpipe = ratio(med("evtrain_gpipe", P, M), med("torch_gpipe", P, M))
    each = headline["ratio_1f1b_per_repeat"]
    best = {
        k: max(results[k, P, M]) if results.get((k, P, M)) else None
        for k in ("evtrain_1f1b", "torch_1f1b")
    }
    best_ratio_1f1b = ratio(best["evtrain_1f1b"], best["torch_1f1b"])
    print()
    print(f"evtrain/torch 1F1B  {fmt(ratio_1f1b)}  (per repeat: {' '.join(map(str, each))})")
    print(f"evtrain/torch 1F1B, best runs {fmt(best_ratio_1f1b)}")
    print(f"evtrain/torch ZB    {fmt(headline['ratio_zb'])}")
    print(f"evtrain/torch interleaved {fmt(headline['ratio_interleaved'])}")
    print(f"evtrain/torch ZBV   {fmt(headline['ratio_zbv'])}")
    print(f"evtrain/torch GPipe {fmt(ratio_gpipe)}")
    ratio_transformer = ratio(med("evtrain_transformer", P, M), med("torch_transformer", P, M))
    per_repeat_transformer = per_repeat("evtrain_transformer", "torch_transformer", P, M)
    print(
        f"decoder, (hidden, mask) boundary: evtrain {fmt(med('evtrain_transformer', P, M))}, "
        f"torch {fmt(med('torch_transformer', P, M))} steps/s"
    )
    print(
        f"evtrain/torch 1F1B decoder {fmt(ratio_transformer)}  "
        f"(per repeat: {' '.join(map(str, per_repeat_transformer))})"
    )
    unmodified = ratio(med("evtrain_unmodified", P, M), med("evtrain_rules", P, M))
    hf_single = ratio(med("evtrain_hf_llama", P, M), med("single_hf_llama", P, M))
    print(
        f"decoder as one model, plain forward / pruning rules {fmt(unmodified)}  (per repeat: "
        f"{' '.join(map(str, per_repeat('evtrain_unmodified', 'evtrain_rules', P, M)))})"
    )
    print(
        f"Hugging Face Llama as written, P={P} / one process {fmt(hf_single)}; "
        f"torch's tracer on it: {tracer}"
    )
    summary = {
        "evtrain_1f1b_steps_per_s": headline["evtrain_1f1b_steps_per_s"],
        "torch_1f1b_steps_per_s": headline["torch_1f1b_steps_per_s"],
        "evtrain_gpipe_steps_per_s": rounded(med("evtrain_gpipe", P, M)),
        "torch_gpipe_steps_per_s": rounded(med("torch_gpipe", P, M)),
        "sequential_steps_per_s": rounded(med("sequential", P, M)),
        "ratio_1f1b": ratio_1f1b,
        "ratio_gpipe": rounded(ratio_gpipe),
        "ratio_1f1b_per_repeat": each,
        "ratio_1f1b_median_of_repeats": rounded(statistics.median(each)) if each else None,
        "ratio_1f1b_best": rounded(best_ratio_1f1b),
        "bound_steps_per_s": headline["bound_1f1b_steps_per_s"],
        "bound_fraction_1f1b": headline["bound_fraction_1f1b"],
        "ratio_zb": headline["ratio_zb"],
        "bound_fraction_zb": headline["bound_fraction_zb"],
        "zb_bubble_recovered": headline["zb_bubble_recovered"],
        "zb_idle_recovered": headline["zb_idle_recovered"],
        "ratio_interleaved": headline["ratio_interleaved"],
        "bound_fraction_interleaved": headline["bound_fraction_interleaved"],
        "ratio_zbv": headline["ratio_zbv"],
        "bound_fraction_zbv": headline["bound_fraction_zbv"],
        "zbv_bubble_recovered": headline["zbv_bubble_recovered"],
        "zbv_idle_recovered": headline["zbv_idle_recovered"],
        "evtrain_transformer_steps_per_s": rounded(med("evtrain_transformer", P, M)),
        "torch_transformer_steps_per_s": rounded(med("torch_transformer", P, M)),
        "ratio_transformer_tuple": rounded(ratio_transformer),
        "ratio_transformer_tuple_per_repeat": per_repeat_transformer,
        "ratio_unmodified_vs_rules": rounded(unmodified),
        "ratio_unmodified_vs_rules_per_repeat": per_repeat(
            "evtrain_unmodified", "evtrain_rules", P, M
        ),
        "ratio_hf_llama_vs_single": rounded(hf_single),
        "evtrain_hf_llama_steps_per_s": rounded(med("evtrain_hf_llama", P, M)),
        "single_hf_llama_steps_per_s": rounded(med("single_hf_llama", P, M)),
        "torch_tracer_hf_llama": tracer,
        "grid": rows,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "transformer_steps": args.transformer_steps,
        "transformer_warmup": args.transformer_warmup,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
