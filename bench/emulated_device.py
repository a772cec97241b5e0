"""evtrain's pipeline schedules on an emulated device: P = 4 and 8 stages on a 2-core machine.

Two cores cannot run eight stages of real compute at once, but a GPU kernel
does not occupy the host's CPU either: it occupies the device. This bench
replaces every layer's compute by *sleeps* of fixed length
(`EmulatedLayer`), so P stage processes wait side by side like P GPUs and
what is left on the CPUs is mostly the engine's own work: Python, autograd,
the point-to-point messages, the optimizer, the control exchange, the
events. It measures how close each schedule comes to the step time an
ideal engine would reach on such a device, how evtrain compares with
torch.distributed.pipelining on the same layers, and where evtrain's lost
time goes.

The emulated device. `EmulatedLayer` holds a tiny real ``nn.Linear(16, 16)``
(microbatches of 2 rows), so autograd, the messages and SGD stay real, and
three kernels: forward ``--forward-ms`` (default 4), input gradient
``--input-ms`` (4), weight gradient ``--weight-ms`` (4), so a backward is
twice a forward; ``--layers-per-stage`` (2) layers per stage, one per model
chunk under interleaved and zbv (two chunks per stage: the same model and
the same work per stage under every schedule). The forward and
input-gradient kernels are one autograd node (`_Kernel`) after the linear
product: its forward sleeps the forward time, its backward the
input-gradient time; it lies on the path to the stage's input, so both
engines run it in their input half (I). The weight-gradient kernel sleeps
where each engine computes d(weight):

* torch.distributed.pipelining (and evtrain, on every linear it does not
  split) gets a weight's gradient from autograd: the weight passes through
  its own node (`_WeightKernel`), whose backward sleeps the weight-gradient
  time. torch's input half asks autograd for the input's gradient only,
  which skips that node; its weight half runs it.
* evtrain splits a backward by routing each ``nn.Linear`` through
  ``evtrain.stages.backward._DeferredLinear``, whose W computes d(weight)
  from the kept (X, dY) *without* autograd (`evtrain.stages.backward` says
  why), so no autograd node can run in it. A layer whose linear evtrain
  routed (it replaced the linear's ``forward``) calls that linear, and the
  layers wrap ``evtrain.stages.backward._weight_grads`` in the processes
  that build them so that it sleeps the layer's weight-gradient time before
  the real product: evtrain's d(weight) kernel. Nothing else of the engine
  changes, and the wrapper raises if the function is gone rather than let a
  W run without its kernel.

On the model's first chunk (no input gradient) both engines leave I empty
and run the whole backward in W, as evtrain's simulator assumes.

Contenders, for every (P, M) of ``--grid`` (default ``8x32``: P = 8, M =
32), alternating within each of ``--repeats`` repeats (the order reversed
every other repeat), ``--warmup`` untimed steps then ``--steps`` timed ones:

* evtrain ``1f1b``, ``interleaved`` (2 chunks per stage), ``zb`` and
  ``zbv``: real stage workers under torch.distributed.elastic (launched as
  bench/pipeline_vs_torch.py launches them), one torch thread each,
  publishing to a real broker with the default event settings
  (``microbatch_spans="sampled"``: spans in steps 1-5 and every 50th); a
  subscriber thread in this process drains the bus while they run (at P = 8
  the spans outgrow the bus's queues otherwise). Step time: the last
  stage's StepStarted of the first timed step to its StepEnded of the last.
* their torch twins on the same layers with static shapes (the ranks of
  bench/pipeline_vs_torch.py's ``torch_worker``), under elastic too, forked
  from this process (spawned interpreters take half a minute to start and
  to end at P = 8 on 2 cores; the timed steps are the same): Schedule1F1B,
  ScheduleInterleaved1F1B (2 stages per rank), ScheduleInterleavedZeroBubble
  with one stage per rank (ZB-H1, evtrain's ``zb`` order) and
  ScheduleZBVZeroBubble (rank r holding chunks r and 2P-1-r). Step time:
  rank 0's wall time between barriers.

The bound: each schedule's ideal step on this device is evtrain's simulator
(`evtrain.stages.simulator.simulate`) run on the instruction lists the
stages run (``lookahead=1``, ``reduce_grads=True``, as the executor builds
them), each instruction costing its chunk's kernels. The simulator
expresses all four schedules, so no closed form is used; the closed forms
(`evtrain.stages.simulator.bubble_fraction`) are printed beside it as a
check, where they hold (I = W, a backward twice a forward). It counts no
time for messages, the optimizer or Python: 1.0 is a perfect engine.

The device's own costs, measured in this process before the runs with no
stage running (``--calibration`` times each) and stated in the output:

* the sleep overshoot: ``time.sleep(0.004)`` takes longer than 4 ms (timer
  slack, the wake-up). The bound is *corrected* for it: it is what the
  device's kernels take here whatever the engine does, so leaving it out
  would charge the engine for the OS timer. Every kernel also measures its
  own overshoot inside the stages (reported with `evtrain.report`, so it
  arrives in each stage's ``StepEnded.metrics``; torch's ranks return
  theirs); what a busy stage sees beyond the quiet figure is *reported*,
  not corrected (its own line below): it is a sleeping kernel woken late
  because the stages' processes compete for the cores, partly the
  engine's CPU use, partly the emulation's density (P processes on 2
  cores).
* the layers' own compute: one chunk's forward and backward run in this
  process, timed beyond their sleeps: autograd, the tiny products, and a
  CPU woken from a sleep running them several times slower than a busy
  one (cold caches, an idle virtual CPU: the same few torch calls take
  several times as long right after a 4 ms sleep as in a tight loop).
  Both engines pay it and neither can remove it, but it is the
  emulation's rather than a GPU's. It is *reported*, not corrected: its
  size depends on how idle the CPU was (a lone process wakes from deeper
  idle than a stage among P busy ones, so this figure is an upper one),
  and the stages' own figure is in the lost-time table ("compute beyond
  the sleeps"). To isolate the engine's scheduling from it, a second
  bound (``instr``) runs the simulator with every instruction as long as
  evtrain's stages measured it (forward and backward instruction time per
  chunk and microbatch, means over the stages; the weight half's share of
  a backward from the spans): ``emu_instruction_fraction_<sched>`` =
  instr / measured step time leaves out everything inside the
  instructions and judges what is between them (messages, waits, the
  boundary).

Also stated: every contender's CPU time per step, all its processes
together (the stages' kernels report their process's CPU time; torch's
ranks return theirs), as a share of the cores. The emulation holds while
that share stays well below 1; near 1 the stages queue for the CPU and the
figures measure the machine.

Figures: ``emu_bound_fraction_<sched>`` = bound step time / measured step
time; ``emu_ratio_<sched>`` = evtrain steps/s / torch twin steps/s (medians
over repeats); ``emu_zb_bubble_realised`` (and ``emu_zbv_...``) =
(measured 1F1B step time - measured zb step time) / (simulated 1F1B step
time - simulated zb step time): the share of the bubble reduction the
simulator promises that evtrain realises.

Where evtrain's lost time goes (ms per step, mean over stages and
repeats): the measured step time minus the bound splits exactly, on every
stage, into

* sleep overshoot in the stage beyond the quiet one (the kernels' reports);
* compute beyond the sleeps: ``StepEnded.forward_s + backward_s`` less the
  kernels' actual sleeps: the layers' torch work (the calibration's figure
  is printed below it for reference) and evtrain's bookkeeping inside the
  instructions;
* waits beyond the schedule's bubble: ``StepEnded.comm_wait_s`` (receives,
  the send drain, the control exchange's wait) less the stage's idle time
  in the simulated step;
* the rest of the step: ``duration_s`` less compute and waits: the
  optimizer, loading, posting sends and receives, Python between
  instructions;
* thread hops and publishing: StepStarted to StepEnded less ``duration_s``
  (the actor's hop to the step's thread and back, the step's events);
* the actor's boundary: the rest of the step period (StepEnded to the next
  StepStarted; the period is the last stage's, so a stage's figure can dip
  slightly below zero).

The rest of the step is split further by the spans either side of each
stretch without a span (``F>recv_grad``: after a forward, before the wait
for a gradient: the activation's send and the Python around it), over the
timed steps with spans.

The waits are split by kind with the wait spans of the timed steps that
carry them (steps <= 5 at ``--warmup`` < 5): receives of activations and of
gradients, the send drain, and the control exchange (``comm_wait_s`` less
the others); the ``control`` span less the exchange's wait is the
optimizer step (and the exchange's sends), which evtrain overlaps with the
exchange. Waits beyond the bubble are also given per stage.

The step boundary's cost on the critical path, printed at the largest P:
for each boundary between two timed steps with spans, from the step's last
compute on any stage to the next step's first compute on any stage (the
control exchange makes every stage wait for the last one, so nothing
overlaps it), as a share of the step time; split on the stage that starts
the next step into: until its control exchange ended (the exchange's
latency after the last compute), until its StepEnded went out (the send
drain, the hop back to the actor's loop, publishing the step's events,
with what publishing the spans costs that stage beside it), the actor's
boundary to its StepStarted, and until its first compute (the hop to the
step's thread, posting the pass's receives, loading the batch).

    python bench/emulated_device.py [--grid 8x32,4x16] [--steps 6] [--warmup 2]
        [--repeats 1] [--forward-ms 4] [--input-ms 4] [--weight-ms 4]
        [--layers-per-stage 2] [--calibration 100] [--only evtrain_zb,torch_zb]
        [--pin]

Tables go to stdout; the last line printed is one JSON object whose
top-level keys describe the first configuration of ``--grid``:
``emu_bound_fraction_<sched>``, ``emu_ratio_<sched>``,
``emu_instruction_fraction_<sched>``, ``emu_zb_bubble_realised``,
``emu_zbv_bubble_realised``, ``sleep_overshoot_ms`` (quiet, and per
contender in the stages), ``layers_compute_ms`` (the calibration), ``cpu``
(per contender), ``lost_ms`` (the breakdown per schedule),
``between_spans_ms``, ``boundary`` (at the largest P), ``P``, ``M``,
``steps``, ``warmup``, ``repeats``, the costs, ``wall_s`` (the bench's own
wall time) and ``grid`` (every configuration in full).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline_vs_torch as pvt

import evtrain

WIDTH = 16
"""Features of the tiny linear in each layer (and of the messages between stages)."""
MICROBATCH = 2
"""Rows per microbatch: the messages stay a few hundred bytes, as the bench means to
time the engine, not the copying."""
SAMPLES = 4096
"""Rows of the data set: the batch (M x MICROBATCH rows) must fit in it."""

SCHEDULES = ("1f1b", "interleaved", "zb", "zbv")
CHUNKS = {"interleaved": 2, "zbv": 2}
"""Model chunks per stage of the chunked schedules (both sides)."""
TWINS = {
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B, 2 stages/rank",
    "zb": "ScheduleInterleavedZeroBubble, 1 stage/rank",
    "zbv": "ScheduleZBVZeroBubble, 2 stages/rank",
}
CONTENDERS = tuple(f"{side}_{s}" for s in SCHEDULES for side in ("evtrain", "torch"))
TOPICS = ("step.", "microbatch.")
"""What the bench process subscribes to: step starts and ends, and the spans."""


@dataclass(frozen=True)
class Costs:
    """The emulated device's kernel lengths (seconds per layer) and the model's depth."""

    forward_s: float
    input_s: float
    weight_s: float
    layers_per_stage: int

    @property
    def kernels(self) -> tuple[float, float, float]:
        return self.forward_s, self.input_s, self.weight_s

    def per_chunk(self, schedule: str) -> int:
        return self.layers_per_stage // CHUNKS.get(schedule, 1)


# ------------------------------------------------------------ the emulated device


class _Tally:
    """Sleep overshoot seen by this process: the torch twins read it at their end."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.cpu_at = time.process_time()
        """This process's CPU time at the last kernel's end."""

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds

    def reset(self) -> None:
        self.count, self.total = 0, 0.0

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


_TALLY = _Tally()


def _device_sleep(seconds: float) -> None:
    """One kernel: the device is busy for ``seconds``; the CPU is free meanwhile."""
    if seconds <= 0:
        return
    start = time.perf_counter()
    time.sleep(seconds)
    over = time.perf_counter() - start - seconds
    _TALLY.add(over)
    cpu, _TALLY.cpu_at = _TALLY.cpu_at, time.process_time()
    # Inside an evtrain stage these land in the step's StepEnded.metrics (means over
    # the step's kernels); elsewhere they do nothing. The CPU deltas chain from
    # kernel to kernel, so their sum over a step is the process's CPU time per step
    # period (every thread: the step's, the event loop's, gloo's).
    evtrain.report({"emu_overshoot_s": over, "emu_cpu_s": _TALLY.cpu_at - cpu})


class _Kernel(torch.autograd.Function):
    """The forward kernel (in forward) and the input-gradient kernel (in backward)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, forward_s: float, input_s: float) -> torch.Tensor:
        ctx.input_s = input_s
        _device_sleep(forward_s)
        return y.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _device_sleep(ctx.input_s)
        return grad, None, None


class _WeightKernel(torch.autograd.Function):
    """The weight-gradient kernel, on the weight's own path: autograd runs it only
    when it is asked for the weight's gradient."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, weight_s: float) -> torch.Tensor:
        ctx.weight_s = weight_s
        return weight.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _device_sleep(ctx.weight_s)
        return grad, None


_WEIGHT_KERNEL_ATTR = "_emulated_weight_s"


def _install_weight_kernel() -> None:
    """Make evtrain's d(weight) of a routed linear sleep the layer's weight-gradient time.

    `evtrain.stages.backward._DeferredLinear` and ``SplitBackward.weight_half``
    call the module-level ``_weight_grads(layer, x, dy)``; wrapping it is the
    one place where evtrain's W computes a linear's weight gradient. Layers
    other than ours (no attribute) pass through untouched. Raises if evtrain
    no longer has that function, rather than silently timing a W without its
    kernel.
    """
    from evtrain.stages import backward

    original = backward._weight_grads
    if getattr(original, "_emulated", False):
        return

    def weight_grads(layer: nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> None:
        _device_sleep(layer.__dict__.get(_WEIGHT_KERNEL_ATTR, 0.0))
        original(layer, x, dy)

    weight_grads._emulated = True  # type: ignore[attr-defined]
    backward._weight_grads = weight_grads


class EmulatedLayer(nn.Module):
    """A layer of the emulated device: a tiny real linear and three kernels of fixed length.

    Forward sleeps ``forward_s``; the backward sleeps ``input_s`` in the part
    that computes the input's gradient and ``weight_s`` in the part that
    computes the weight's (see the module docstring for how each engine
    splits them).
    """

    def __init__(
        self, forward_s: float, input_s: float, weight_s: float, width: int = WIDTH
    ) -> None:
        super().__init__()
        self.forward_s, self.input_s, self.weight_s = forward_s, input_s, weight_s
        self.linear = nn.Linear(width, width)
        # Read by the wrapped _weight_grads (the instance dict: nn.Module's
        # __getattr__ is not consulted there).
        self.linear.__dict__[_WEIGHT_KERNEL_ATTR] = weight_s
        _install_weight_kernel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        if "forward" in linear.__dict__:
            # evtrain's SplitBackward routed this linear (zb/zbv, a chunk whose
            # input takes a gradient): its W runs the wrapped _weight_grads.
            y = linear(x)
        else:
            weight = _WeightKernel.apply(linear.weight, self.weight_s)
            y = F.linear(x, weight, linear.bias)
        out: torch.Tensor = _Kernel.apply(y, self.forward_s, self.input_s)
        return out


def samples() -> tuple[torch.Tensor, torch.Tensor]:
    """The data set: random inputs and regression targets."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(SAMPLES, WIDTH, generator=g), torch.randn(SAMPLES, WIDTH, generator=g)


@dataclass(frozen=True)
class Calibration:
    """The device's own costs, measured in this process before the runs (no stage running)."""

    overshoot: dict[float, float]
    """Per kernel length: the mean time a sleep of it takes beyond its length."""
    compute: dict[int, tuple[float, float]]
    """Per layers in a chunk: the seconds a chunk's forward and its whole backward take
    beyond their kernels' sleeps: autograd, the tiny products, and a CPU woken from a
    sleep running them slower than a busy one would."""


def calibrate(costs: Costs, count: int) -> Calibration:
    """Sleep ``count`` times per kernel length, and run ``count`` microbatches through
    one chunk of every size the schedules use, with plain autograd."""
    overshoot = {}
    for seconds in sorted({s for s in costs.kernels if s > 0}):
        total = 0.0
        for _ in range(count):
            start = time.perf_counter()
            time.sleep(seconds)
            total += time.perf_counter() - start - seconds
        overshoot[seconds] = total / count
    torch.set_num_threads(1)
    compute = {}
    for per in sorted({costs.per_chunk(s) for s in SCHEDULES}):
        chunk = nn.Sequential(*(EmulatedLayer(*costs.kernels) for _ in range(per)))
        x = torch.randn(MICROBATCH, WIDTH, requires_grad=True)
        forward = backward = 0.0
        # The first passes pay for autograd's and the allocator's first use.
        for i in range(-3, count):
            if i == 0:
                forward = backward = 0.0
            _TALLY.reset()
            start = time.perf_counter()
            y = chunk(x)
            middle = time.perf_counter()
            slept_forward = _TALLY.total
            torch.autograd.backward([y], [torch.ones_like(y)])
            end = time.perf_counter()
            forward += middle - start - slept_forward - per * costs.forward_s
            backward += (
                end
                - middle
                - (_TALLY.total - slept_forward)
                - per * (costs.input_s + costs.weight_s)
            )
        compute[per] = (forward / count, backward / count)
    _TALLY.reset()
    return Calibration(overshoot, compute)


# -------------------------------------------------------------------- evtrain side


def spec_text(schedule: str, P: int, M: int, costs: Costs, run_dir: str) -> str:
    """The job spec of one evtrain contender: P x layers_per_stage emulated layers."""
    V = CHUNKS.get(schedule, 1)
    per_chunk = costs.per_chunk(schedule)
    return f"""
import functools
import sys
import torch
from torch import nn
sys.path.append({str(Path(__file__).resolve().parent)!r})
import emulated_device as emu
from evtrain.job import Job, layer

job = Job(
    name="bench-emulated-{schedule}",
    layers=[
        layer(emu.EmulatedLayer, {costs.forward_s!r}, {costs.input_s!r}, {costs.weight_s!r})
        for _ in range({P * costs.layers_per_stage})
    ],
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
    train_data=emu.samples,
    batch_size={M * MICROBATCH},
    num_microbatches={M},
    max_steps=10,
    stages={P},
    virtual_stages={V},
    schedule={schedule!r},
    balance={[per_chunk] * (P * V)},
    threads=1,
    run_dir={run_dir!r},
)
"""


def run_stages(spec: Path, stages: int, steps: int, run_id: str) -> list[Any]:
    """evtrain's stage workers on a live bus (as pipeline_vs_torch's ``run_events``),
    drained by a thread while they run: at P = 8 the sampled spans alone outgrow
    the broker's and the subscriber's queues."""
    from evtrain.bus import Broker, BusAddress, Subscriber
    from evtrain.stages.worker import WorkerConfig, worker_main

    address = BusAddress.new_ipc()
    events: list[Any] = []
    missing: list[int] = []
    connected, finished = threading.Event(), threading.Event()

    def drain() -> None:
        sub = Subscriber(address.endpoint("events_out"), topics=TOPICS)
        connected.set()
        try:
            quiet_since = time.monotonic()
            while not finished.is_set() or time.monotonic() - quiet_since < 0.5:
                batch = sub.drain()
                if batch:
                    events.extend(batch)
                    quiet_since = time.monotonic()
                else:
                    time.sleep(0.02)
            missing.append(sub.gaps.total_missing)
        finally:
            sub.close()

    config = WorkerConfig(
        spec_path=str(spec), overrides={"steps": str(steps)}, bus=str(address), run_id=run_id
    )
    with Broker(address), pvt._removing(address.location):
        thread = threading.Thread(target=drain, name="bench-drain", daemon=True)
        thread.start()
        connected.wait()
        try:
            pvt._launch(stages, worker_main, config.encode())
        finally:
            finished.set()
            thread.join()
    if missing and missing[0]:
        raise RuntimeError(f"the subscriber missed {missing[0]} events; figures would be wrong")
    return events


@dataclass
class StageFigures:
    """One stage's means per timed step (seconds)."""

    duration: float
    forward: float
    backward: float
    comm_wait: float
    overshoot: float | None
    """Mean overshoot of the stage's kernels (its own reports)."""
    cpu: float | None
    """The stage process's CPU time per step (its kernels' reports)."""
    around: float
    """StepStarted to StepEnded beyond ``duration_s``: the actor's thread hops and
    publishing the step's events (spans included, when it has them)."""
    publish_spans: float | None
    """``around`` in the timed steps with spans less in those without: what
    publishing a step's spans costs the stage."""
    spans: dict[str, float] | None
    """Waits by kind and the optimizer, over the timed steps with spans."""
    gaps: dict[str, float] | None
    """Time per step between consecutive spans, by the two spans' kinds (``F>recv_grad``):
    the instructions that have no span of their own (sends, loads, posting receives)
    and the Python around them; over the timed steps with spans."""


@dataclass(frozen=True)
class Boundary:
    """The step boundary on the critical path: from the step's last compute on any
    stage to the next step's first compute on any stage (seconds), split on the stage
    that starts the next step."""

    gap: float
    stage: int
    exchange: float
    """Until that stage's control exchange ended (its ``control`` span's end)."""
    to_end: float
    """Then until its StepEnded went out: the send drain, the hop back to the actor's
    loop, publishing the step's spans."""
    actor: float
    """Then until its next StepStarted went out."""
    start: float
    """Then until its first compute: the hop to the step's thread, posting the pass's
    receives, loading the batch."""
    publish_spans: float | None
    """What publishing a step's spans costs that stage (`StageFigures.publish_spans`)."""


@dataclass
class EvtrainRun:
    step_s: float
    stages: list[StageFigures]
    boundaries: list[Boundary]
    """Every boundary between two timed steps with spans."""


def _stage_spans(events: Sequence[Any], comm_wait: float) -> dict[str, float]:
    from evtrain.events import MicrobatchBackward, MicrobatchWait

    waits: dict[str, float] = defaultdict(float)
    backward = weight = 0.0
    for e in events:
        if isinstance(e, MicrobatchWait):
            waits[e.op] += e.end - e.start
        elif isinstance(e, MicrobatchBackward):
            backward += e.end - e.start
            weight += e.end - e.start if e.part == "weight" else 0.0
    accounted = waits["recv_act"] + waits["recv_grad"] + waits["send"] + waits["reduce"]
    control_wait = max(comm_wait - accounted, 0.0)
    return {
        "recv_act": waits["recv_act"],
        "recv_grad": waits["recv_grad"],
        "send_drain": waits["send"],
        "control_wait": control_wait,
        # The control span runs from the exchange's start over the optimizer
        # (overlapped with the exchange) to the exchange's end.
        "optimizer": max(waits["control"] - control_wait, 0.0),
        "backward_all": backward,
        "backward_weight": weight,
    }


def _span_label(e: Any) -> str:
    from evtrain.events import MicrobatchBackward, MicrobatchForward

    if isinstance(e, MicrobatchForward):
        return "F"
    if isinstance(e, MicrobatchBackward):
        return {"input": "I", "weight": "W"}.get(e.part, "B")
    return str(e.op)


def _span_gaps(events: Sequence[Any]) -> dict[str, float]:
    gaps: dict[str, float] = defaultdict(float)
    ordered = sorted(events, key=lambda e: e.start)
    for a, b in itertools.pairwise(ordered):
        if b.start > a.end:
            gaps[f"{_span_label(a)}>{_span_label(b)}"] += b.start - a.end
    return gaps


def evtrain_figures(
    events: Sequence[Any], P: int, steps: int, warmup: int, kernels_per_step: int
) -> EvtrainRun:
    """Step time, per-stage means and the boundaries from one run's events."""
    from evtrain.events import MicrobatchBackward, MicrobatchForward, StepEnded, StepStarted

    first, final = warmup + 1, warmup + steps
    timed = range(first, final + 1)
    starts = {
        (e.stage, e.step): e.ts for e in events if isinstance(e, StepStarted) and e.replica == 0
    }
    ends: dict[tuple[int, int], Any] = {
        (e.stage, e.step): e for e in events if isinstance(e, StepEnded) and e.replica == 0
    }
    if any((s, k) not in ends or (s, k) not in starts for s in range(P) for k in timed):
        raise RuntimeError(f"missing step events of timed steps ({len(events)} received)")
    step_s = (ends[P - 1, final].ts - starts[P - 1, first]) / steps
    spans: dict[tuple[int, int], list[Any]] = defaultdict(list)
    for e in events:
        if hasattr(e, "start") and hasattr(e, "microbatch"):
            spans[e.stage, e.step].append(e)
    if not any(spans.get((s, k)) for s in range(P) for k in timed):
        print("warning: no timed step carries spans (--warmup >= 5): waits are not split")

    figures = []
    for s in range(P):
        mine = [ends[s, k] for k in timed]
        around = {k: ends[s, k].ts - starts[s, k] - ends[s, k].duration_s for k in timed}
        with_spans = [k for k in timed if spans.get((s, k))]
        plain = [around[k] for k in timed if k not in with_spans]
        rich = [around[k] for k in with_spans]
        reports = [e.metrics["emu_overshoot_s"] for e in mine if "emu_overshoot_s" in e.metrics]
        cpu = [kernels_per_step * e.metrics["emu_cpu_s"] for e in mine if "emu_cpu_s" in e.metrics]
        split = [_stage_spans(spans[s, k], ends[s, k].comm_wait_s) for k in with_spans]
        gaps = [_span_gaps(spans[s, k]) for k in with_spans]
        figures.append(
            StageFigures(
                duration=statistics.fmean(e.duration_s for e in mine),
                forward=statistics.fmean(e.forward_s for e in mine),
                backward=statistics.fmean(e.backward_s for e in mine),
                comm_wait=statistics.fmean(e.comm_wait_s for e in mine),
                overshoot=statistics.fmean(reports) if reports else None,
                cpu=statistics.fmean(cpu) if cpu else None,
                around=statistics.fmean(around.values()),
                publish_spans=statistics.fmean(rich) - statistics.fmean(plain)
                if rich and plain
                else None,
                spans={key: statistics.fmean(d[key] for d in split) for key in split[0]}
                if split
                else None,
                gaps={
                    key: sum(g.get(key, 0.0) for g in gaps) / len(gaps)
                    for key in {k for g in gaps for k in g}
                }
                if gaps
                else None,
            )
        )

    def compute(stage: int, step: int) -> list[Any]:
        return [
            e
            for e in spans.get((stage, step), [])
            if isinstance(e, MicrobatchForward | MicrobatchBackward)
        ]

    boundaries = []
    for k in timed:
        if k + 1 not in timed or not all(compute(s, k) and compute(s, k + 1) for s in range(P)):
            continue
        last = max(e.end for s in range(P) for e in compute(s, k))
        first, stage = min((e.start, s) for s in range(P) for e in compute(s, k + 1))
        control = [e.end for e in spans[stage, k] if getattr(e, "op", "") == "control"]
        if not control:
            continue
        ended, started = ends[stage, k].ts, starts[stage, k + 1]
        boundaries.append(
            Boundary(
                gap=first - last,
                stage=stage,
                exchange=control[0] - last,
                to_end=ended - control[0],
                actor=started - ended,
                start=first - started,
                publish_spans=figures[stage].publish_spans,
            )
        )
    return EvtrainRun(step_s, figures, boundaries)


def run_evtrain(
    tmp: Path, schedule: str, P: int, M: int, costs: Costs, steps: int, warmup: int
) -> EvtrainRun:
    """One evtrain contender: launch, collect, measure."""
    tag = uuid.uuid4().hex[:8]
    spec = tmp / f"emu_{schedule}_{P}x{M}_{tag}.py"
    spec.write_text(spec_text(schedule, P, M, costs, str(tmp / "runs")))
    events = run_stages(spec, P, warmup + steps, f"bench-emulated-{schedule}-{tag}")
    kernels = M * costs.layers_per_stage * sum(1 for k in costs.kernels if k > 0)
    return evtrain_figures(events, P, steps, warmup, kernels)


# ---------------------------------------------------------------------- torch side


def torch_twin(
    kind: str,
    microbatches: int,
    steps: int,
    warmup: int,
    kernels: tuple[float, float, float],
    layers_per_stage: int,
) -> tuple[float | None, float | None, float]:
    """One rank of torch.distributed.pipelining on the emulated layers (the shapes of
    pipeline_vs_torch's ``torch_worker``): rank 0's steps/s, and every rank's mean
    kernel overshoot and CPU time per step over the timed steps."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    pvt._maybe_pin()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = CHUNKS.get(kind, 1)
    per_chunk = layers_per_stage // chunks
    torch.manual_seed(rank)
    mb = MICROBATCH
    stages: list[Any] = []
    modules: list[nn.Module] = []
    held = [rank, 2 * world - 1 - rank] if kind == "zbv" else range(rank, world * chunks, world)
    for index in held:
        module = nn.Sequential(*(EmulatedLayer(*kernels) for _ in range(per_chunk)))
        modules.append(module)
        stages.append(
            PipelineStage(
                module,
                index,
                world * chunks,
                torch.device("cpu"),
                # requires_grad as at run time (see pipeline_vs_torch's torch_worker):
                # without it a later stage would skip its input gradient.
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
        schedule = Schedule1F1B(stages[0], n_microbatches=microbatches, loss_fn=loss)
    optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=1e-3)
    x, y = samples()
    x, y = x[: microbatches * mb], y[: microbatches * mb]
    start = cpu = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            _TALLY.reset()
            start, cpu = time.perf_counter(), time.process_time()
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
    cpu = time.process_time() - cpu
    dist.barrier()
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    return (steps / elapsed if rank == 0 else None), _TALLY.mean(), cpu / steps


@dataclass
class TorchRun:
    step_s: float
    overshoot: float | None
    cpu: float
    """CPU time per step, summed over the ranks."""


def _launch_forked(nproc: int, entrypoint: Callable[..., Any], *args: Any) -> dict[int, Any]:
    """pipeline_vs_torch's ``_launch``, its workers forked from this process.

    Eight spawned interpreters importing torch on two cores take about half a
    minute to start and to end (evtrain's fast exit aside), more than the timed
    steps; forked ones share the imports. A torch rank uses nothing of this
    process's state but the functions it runs, so the timed steps are the same.
    """
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
        start_method="fork",
    )
    return elastic_launch(config, entrypoint)(*args)


def run_torch(kind: str, P: int, M: int, costs: Costs, steps: int, warmup: int) -> TorchRun:
    out = _launch_forked(
        P, torch_twin, kind, M, steps, warmup, costs.kernels, costs.layers_per_stage
    )
    rate = out[0][0]
    overshoots = [o for _, o, _ in out.values() if o is not None]
    return TorchRun(
        1 / rate,
        statistics.fmean(overshoots) if overshoots else None,
        sum(c for _, _, c in out.values()),
    )


# ------------------------------------------------------------------------ the bound


@dataclass(frozen=True)
class Bound:
    step_s: float
    """The bound: the kernels with the quiet overshoot."""
    idle_s: tuple[float, ...]
    """Each stage's idle time in that simulated step."""
    nominal_step_s: float
    """The kernels alone."""
    closed_form_s: float | None
    """Work per stage over one minus the closed-form bubble fraction (default costs)."""


def _simulate(schedule: str, P: int, M: int, f: float, b: float, w: float) -> Any:
    """evtrain's simulator on the instruction lists the executor builds: forward ``f``,
    backward ``b`` of which its weight half ``w`` (seconds per instruction)."""
    from evtrain.stages.executor import DEFAULT_LOOKAHEAD
    from evtrain.stages.simulator import simulate

    return simulate(
        schedule,
        P,
        M,
        f,
        b,
        weight_cost=min(w, b),
        reduce_grads=True,
        lookahead=DEFAULT_LOOKAHEAD,
        virtual_stages=CHUNKS.get(schedule, 1),
    )


def simulate_bound(schedule: str, P: int, M: int, costs: Costs, cal: Calibration) -> Bound:
    """The schedule's ideal step on the device: each instruction costs its chunk's
    kernels (with their quiet overshoot, and without for the nominal figure)."""
    from evtrain.stages.simulator import bubble_fraction

    V = CHUNKS.get(schedule, 1)
    per = costs.per_chunk(schedule)

    def run(overshoot: dict[float, float]) -> Any:
        def kernel(s: float) -> float:
            return per * (s + overshoot.get(s, 0.0)) if s > 0 else 0.0

        f, i, w = (kernel(s) for s in costs.kernels)
        return _simulate(schedule, P, M, f, i + w, w)

    real, nominal = run(cal.overshoot), run({})
    closed = None
    f, i, w = costs.kernels
    if i == w and f > 0 and abs(i + w - 2 * f) < 1e-12:
        work = M * costs.layers_per_stage * (f + i + w)
        closed = work / (1 - bubble_fraction(P, M, schedule, V))
    return Bound(
        step_s=real.makespan,
        idle_s=tuple(real.makespan - b for b in real.busy),
        nominal_step_s=nominal.makespan,
        closed_form_s=closed,
    )


def instruction_bound(schedule: str, P: int, M: int, runs: Sequence[EvtrainRun]) -> float | None:
    """The same simulation with every instruction as long as evtrain's stages measured
    it (means over stages and runs): what a perfect scheduler reaches with these
    instructions. Its gap to the measured step is messages, waits and the boundary."""
    if not runs:
        return None
    n = M * CHUNKS.get(schedule, 1)
    stages = [st for r in runs for st in r.stages]
    f = statistics.fmean(st.forward for st in stages) / n
    b = statistics.fmean(st.backward for st in stages) / n
    shares = [
        st.spans["backward_weight"] / st.spans["backward_all"]
        for st in stages
        if st.spans is not None and st.spans["backward_all"] > 0
    ]
    w = b * statistics.fmean(shares) if shares else b / 2
    return float(_simulate(schedule, P, M, f, b, w).makespan)


# ----------------------------------------------------------------- lost-time table


LOST_ROWS = (
    ("overshoot_extra", "sleep overshoot in stage, beyond quiet"),
    ("compute_extra", "compute beyond the sleeps"),
    ("wait_extra", "waits beyond the schedule's bubble"),
    ("other_in_step", "rest of the step (optimizer, loads, sends, Python)"),
    ("around_step", "thread hops, publishing the step's events"),
    ("actor_boundary", "the actor's boundary (StepEnded to StepStarted)"),
)
WAIT_ROWS = (
    ("idle_sim", "schedule's own idle (simulated)"),
    ("comm_wait", "all waits (comm_wait_s)"),
    ("recv_act", "  receive activations"),
    ("recv_grad", "  receive gradients"),
    ("send_drain", "  send drain"),
    ("control_wait", "  control exchange"),
    ("optimizer", "optimizer (+ exchange sends), in the control span"),
)


def lost_time(
    run: EvtrainRun, bound: Bound, schedule: str, M: int, costs: Costs, cal: Calibration
) -> dict[str, Any]:
    """Per stage, step time minus bound, split as the module docstring says (seconds)."""
    kernels = [s for s in costs.kernels if s > 0]
    sleeps = M * costs.layers_per_stage * len(kernels)
    nominal = M * costs.layers_per_stage * sum(kernels)
    quiet_over = M * costs.layers_per_stage * sum(cal.overshoot[s] for s in kernels)
    layers = M * CHUNKS.get(schedule, 1) * sum(cal.compute[costs.per_chunk(schedule)])
    per_stage = []
    for st, idle in zip(run.stages, bound.idle_s, strict=True):
        stage_over = sleeps * st.overshoot if st.overshoot is not None else quiet_over
        compute = st.forward + st.backward - nominal - stage_over
        row = {
            "overshoot_extra": stage_over - quiet_over,
            "compute_extra": compute,
            "compute_layers": layers,
            "wait_extra": st.comm_wait - idle,
            "other_in_step": st.duration - st.forward - st.backward - st.comm_wait,
            "around_step": st.around,
            "actor_boundary": run.step_s - st.duration - st.around,
            "idle_sim": idle,
            "comm_wait": st.comm_wait,
        }
        if st.spans is not None:
            row.update({k: st.spans[k] for k, _ in WAIT_ROWS if k in st.spans})
        per_stage.append(row)
    keys = {k for row in per_stage for k in row}
    mean = {
        k: statistics.fmean(row[k] for row in per_stage if k in row)
        for k in keys
        if all(k in row for row in per_stage)
    }
    return {"mean": mean, "per_stage": per_stage}


def cpu_table(
    evtrain_runs: dict[tuple[str, int, int], list[EvtrainRun]],
    torch_runs: dict[tuple[str, int, int], list[TorchRun]],
    P: int,
    M: int,
) -> dict[str, dict[str, float]]:
    """CPU time per step of every contender's stages, and their share of the cores.

    The emulation holds only while the cores keep up: a share near 1 means the
    stages queue for the CPU and the figures above measure the machine.
    """
    cores = len(os.sched_getaffinity(0))
    out: dict[str, dict[str, float]] = {}
    for schedule in SCHEDULES:
        for side, runs in (
            ("evtrain", evtrain_runs.get((schedule, P, M), [])),
            ("torch", torch_runs.get((schedule, P, M), [])),
        ):
            cpu, step = [], []
            for r in runs:
                if isinstance(r, EvtrainRun):
                    if any(st.cpu is None for st in r.stages):
                        continue
                    cpu.append(sum(st.cpu or 0.0 for st in r.stages))
                else:
                    cpu.append(r.cpu)
                step.append(r.step_s)
            if cpu:
                mean_cpu, mean_step = statistics.fmean(cpu), statistics.fmean(step)
                out[f"{side}_{schedule}"] = {
                    "cpu_ms_per_step": round(1e3 * mean_cpu, 1),
                    "share_of_cores": round(mean_cpu / (cores * mean_step), 3),
                }
    print(
        f"CPU per step, all stages (ms) and its share of the {cores} cores: "
        + ", ".join(
            f"{k} {v['cpu_ms_per_step']:.0f} ({v['share_of_cores']:.0%})" for k, v in out.items()
        )
    )
    return out


def print_lost(lost: dict[str, dict[str, Any]], P: int, M: int) -> None:
    """The lost-time table: one column per schedule."""
    names = list(lost)
    print()
    print(f"evtrain's lost time per step at P={P} M={M} (ms, mean over stages)")
    print(f"{'':52s}" + "".join(f"{n:>12s}" for n in names))

    def line(label: str, key: str) -> None:
        values = [lost[n]["mean"].get(key) for n in names]
        print(f"{label:52s}" + "".join(_ms(v, 12) for v in values))

    line("measured step", "step")
    line("bound", "bound")
    line("lost = measured - bound", "lost")
    for key, label in LOST_ROWS:
        line(f"  {label}", key)
    line("    (the layers' compute alone, one quiet process)", "compute_layers")
    print("waits, by kind (timed steps with spans for the kinds):")
    for key, label in WAIT_ROWS:
        line(f"  {label}", key)
    print("waits beyond the bubble, per stage (ms):")
    for n in names:
        print(f"  {n:12s} " + " ".join(f"{1e3 * v:7.1f}" for v in lost[n]["wait_extra_per_stage"]))
    print(
        "between spans (instructions without a span: sends, loads, posting receives, "
        "and the Python around them), by the spans either side; ms per step:"
    )
    for n in names:
        gaps = sorted(lost[n]["gaps"].items(), key=lambda kv: -kv[1])
        top = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in gaps[:5])
        print(f"  {n:12s} all {1e3 * sum(lost[n]['gaps'].values()):6.1f}: {top}")


# ------------------------------------------------------------------------------ main


def _grid(text: str) -> list[tuple[int, int]]:
    from evtrain.errors import UsageError
    from evtrain.schedule_names import check_virtual_stages

    configs = []
    for item in text.split(","):
        p, _, m = item.strip().partition("x")
        if not (p.isdigit() and m.isdigit()) or int(p) < 2 or int(m) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: expected PxM with P >= 2, e.g. 8x32")
        P, M = int(p), int(m)
        if M * MICROBATCH > SAMPLES:
            raise argparse.ArgumentTypeError(f"{item!r}: M at most {SAMPLES // MICROBATCH}")
        for schedule in SCHEDULES:
            try:
                check_virtual_stages(schedule, P, M, CHUNKS.get(schedule, 1))
            except UsageError as exc:
                raise argparse.ArgumentTypeError(f"{item!r}: {exc}") from None
        configs.append((P, M))
    return configs


def _ms(x: float | None, width: int = 9) -> str:
    return f"{'n/a':>{width}s}" if x is None else f"{1e3 * x:{width}.1f}"


def _num(x: float | None, width: int = 9) -> str:
    return f"{'n/a':>{width}s}" if x is None else f"{x:{width}.3f}"


def _rounded(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def main() -> None:
    wall_start = time.perf_counter()
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--grid", type=_grid, default=_grid("8x32"), help="PxM,... (8x32)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per contender (6)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    parser.add_argument("--repeats", type=int, default=1, help="alternating repeats (1)")
    parser.add_argument("--forward-ms", type=float, default=4.0, help="forward kernel (4)")
    parser.add_argument("--input-ms", type=float, default=4.0, help="input-gradient kernel (4)")
    parser.add_argument("--weight-ms", type=float, default=4.0, help="weight-gradient kernel (4)")
    parser.add_argument(
        "--layers-per-stage", type=int, default=2, help="layers per stage, even (2)"
    )
    parser.add_argument(
        "--calibration",
        type=int,
        default=100,
        help="quiet sleeps per kernel length and microbatches per chunk size (100)",
    )
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated contenders ({', '.join(CONTENDERS)}) for quick checks; "
        "the others are n/a",
    )
    parser.add_argument(
        "--pin", action="store_true", help="pin every worker to a core (EVTRAIN_PIN_CPU=1)"
    )
    args = parser.parse_args()
    if args.layers_per_stage < 2 or args.layers_per_stage % 2:
        parser.error("--layers-per-stage must be even (two chunks per stage) and >= 2")
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1, --warmup >= 0")
    chosen = [c for c in args.only.split(",") if c] or list(CONTENDERS)
    if set(chosen) - set(CONTENDERS):
        parser.error(f"unknown contenders {sorted(set(chosen) - set(CONTENDERS))}")
    os.environ.setdefault("EVTRAIN_LOG_LEVEL", "warning")
    if args.pin:
        os.environ["EVTRAIN_PIN_CPU"] = "1"
    costs = Costs(
        args.forward_ms / 1e3, args.input_ms / 1e3, args.weight_ms / 1e3, args.layers_per_stage
    )
    grid: list[tuple[int, int]] = list(dict.fromkeys(args.grid))

    cal = calibrate(costs, args.calibration)
    print(
        f"the device, quiet (this process, mean of {args.calibration}): sleep overshoot "
        + ", ".join(f"{1e3 * s:g} ms +{1e6 * o:.0f} us" for s, o in cal.overshoot.items())
        + "; the layers' compute beyond the sleeps, forward / backward of a chunk of "
        + ", ".join(
            f"{per} layer(s) {1e6 * f:.0f} / {1e6 * b:.0f} us"
            for per, (f, b) in cal.compute.items()
        ),
        flush=True,
    )
    bounds = {(s, P, M): simulate_bound(s, P, M, costs, cal) for P, M in grid for s in SCHEDULES}

    runs = [(kind, P, M) for P, M in grid for kind in CONTENDERS if kind in chosen]
    evtrain_runs: dict[tuple[str, int, int], list[EvtrainRun]] = defaultdict(list)
    torch_runs: dict[tuple[str, int, int], list[TorchRun]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="evt-emu-") as tmpdir:
        tmp = Path(tmpdir)
        for repeat in range(args.repeats):
            # Reversed every other repeat: slow drift of the machine's load cancels.
            for kind, P, M in runs if repeat % 2 == 0 else runs[::-1]:
                side, schedule = kind.split("_", 1)
                step_s: float
                launched = time.perf_counter()
                if side == "evtrain":
                    ev = run_evtrain(tmp, schedule, P, M, costs, args.steps, args.warmup)
                    evtrain_runs[schedule, P, M].append(ev)
                    step_s = ev.step_s
                else:
                    tr = run_torch(schedule, P, M, costs, args.steps, args.warmup)
                    torch_runs[schedule, P, M].append(tr)
                    step_s = tr.step_s
                bound = bounds[schedule, P, M]
                print(
                    f"repeat {repeat + 1}/{args.repeats}  P={P} M={M:<3d} {kind:19s} "
                    f"{1 / step_s:6.3f} steps/s  {1e3 * step_s:7.1f} ms/step  "
                    f"(bound {1e3 * bound.step_s:.1f}; {time.perf_counter() - launched:.0f} s "
                    "with the launch)",
                    flush=True,
                )
    report(grid, bounds, evtrain_runs, torch_runs, costs, cal, args, wall_start)


def report(
    grid: list[tuple[int, int]],
    bounds: dict[tuple[str, int, int], Bound],
    evtrain_runs: dict[tuple[str, int, int], list[EvtrainRun]],
    torch_runs: dict[tuple[str, int, int], list[TorchRun]],
    costs: Costs,
    cal: Calibration,
    args: argparse.Namespace,
    wall_start: float,
) -> None:
    def step_time(schedule: str, P: int, M: int, side: str) -> float | None:
        runs: Sequence[EvtrainRun | TorchRun] = (
            evtrain_runs.get((schedule, P, M), [])
            if side == "evtrain"
            else torch_runs.get((schedule, P, M), [])
        )
        # The median rate's step time: rates are what the repeats vary in.
        rate = _median([1 / r.step_s for r in runs])
        return None if rate is None else 1 / rate

    def overshoot(schedule: str, P: int, M: int, side: str) -> float | None:
        if side == "evtrain":
            values = [
                st.overshoot
                for r in evtrain_runs.get((schedule, P, M), [])
                for st in r.stages
                if st.overshoot is not None
            ]
        else:
            values = [
                r.overshoot for r in torch_runs.get((schedule, P, M), []) if r.overshoot is not None
            ]
        return statistics.fmean(values) if values else None

    rows: list[dict[str, Any]] = []
    for P, M in grid:
        row: dict[str, Any] = {"P": P, "M": M}
        print()
        print(
            f"P={P} M={M}: {costs.layers_per_stage} layers/stage, kernels "
            f"F {1e3 * costs.forward_s:g} / I {1e3 * costs.input_s:g} / "
            f"W {1e3 * costs.weight_s:g} ms per layer"
        )
        print(
            f"{'schedule':12s} {'evtrain':>8s} {'torch':>8s} {'ratio':>6s} {'bound':>8s} "
            f"{'nominal':>8s} {'closed':>8s} {'instr':>8s} {'fraction':>8s} {'torch':>6s} "
            f"{'instr':>6s}"
        )
        for schedule in SCHEDULES:
            bound = bounds[schedule, P, M]
            ours = step_time(schedule, P, M, "evtrain")
            theirs = step_time(schedule, P, M, "torch")
            ratio = None if ours is None or theirs is None else theirs / ours
            fraction = None if ours is None else bound.step_s / ours
            torch_fraction = None if theirs is None else bound.step_s / theirs
            instr = instruction_bound(schedule, P, M, evtrain_runs.get((schedule, P, M), []))
            instr_fraction = None if ours is None or instr is None else instr / ours
            row[f"evtrain_{schedule}_step_ms"] = _rounded(None if ours is None else 1e3 * ours, 2)
            row[f"torch_{schedule}_step_ms"] = _rounded(None if theirs is None else 1e3 * theirs, 2)
            row[f"bound_{schedule}_step_ms"] = round(1e3 * bound.step_s, 2)
            row[f"bound_nominal_{schedule}_step_ms"] = round(1e3 * bound.nominal_step_s, 2)
            row[f"bound_instructions_{schedule}_step_ms"] = _rounded(
                None if instr is None else 1e3 * instr, 2
            )
            row[f"emu_ratio_{schedule}"] = _rounded(ratio)
            row[f"emu_bound_fraction_{schedule}"] = _rounded(fraction)
            row[f"torch_bound_fraction_{schedule}"] = _rounded(torch_fraction)
            row[f"emu_instruction_fraction_{schedule}"] = _rounded(instr_fraction)
            row[f"emu_ratio_{schedule}_per_repeat"] = [
                round(t.step_s / e.step_s, 3)
                for e, t in zip(
                    evtrain_runs.get((schedule, P, M), []),
                    torch_runs.get((schedule, P, M), []),
                    strict=False,
                )
            ]
            print(
                f"{schedule:12s} {_ms(ours, 8)} {_ms(theirs, 8)} {_num(ratio, 6)} "
                f"{_ms(bound.step_s, 8)} {_ms(bound.nominal_step_s, 8)} "
                f"{_ms(bound.closed_form_s, 8)} {_ms(instr, 8)} "
                f"{_num(fraction, 8)} {_num(torch_fraction, 6)} {_num(instr_fraction, 6)}"
            )
        print(
            "ms per step; ratio: evtrain / torch steps/s (twins: "
            + "; ".join(f"{s} {t}" for s, t in TWINS.items())
            + ").\nbound: evtrain's simulator on the stages' instruction lists, the kernels "
            "with their quiet overshoot; nominal: the kernels alone; closed: from the "
            "closed-form bubble (default costs only); instr: the simulator with every "
            "instruction as long as evtrain's stages measured it. fraction: bound / evtrain; "
            "torch: bound / torch; instr: instr / evtrain."
        )
        one_ms, one_sim = step_time("1f1b", P, M, "evtrain"), bounds["1f1b", P, M].step_s
        for name in ("zb", "zbv"):
            ms, sim = step_time(name, P, M, "evtrain"), bounds[name, P, M].step_s
            promised = one_sim - sim
            realised = (
                None if one_ms is None or ms is None or promised <= 0 else (one_ms - ms) / promised
            )
            row[f"emu_{name}_bubble_realised"] = _rounded(realised)
            print(
                f"{name} vs 1f1b: the simulator promises {_ms(promised, 0).strip()} ms/step "
                f"less, evtrain realises {_num(realised, 0).strip()} of it"
            )

        over = {
            f"{side}_{s}": round(1e3 * o, 4)
            for s in SCHEDULES
            for side in ("evtrain", "torch")
            if (o := overshoot(s, P, M, side)) is not None
        }
        row["sleep_overshoot_ms_in_stages"] = over
        print(
            "sleep overshoot in the stages (mean per kernel, us): "
            + ", ".join(f"{k} {1e3 * v:.0f}" for k, v in over.items())
        )
        row["cpu"] = cpu_table(evtrain_runs, torch_runs, P, M)

        lost: dict[str, dict[str, Any]] = {}
        for schedule in SCHEDULES:
            runs = evtrain_runs.get((schedule, P, M), [])
            if not runs:
                continue
            parts = [lost_time(r, bounds[schedule, P, M], schedule, M, costs, cal) for r in runs]
            keys = set.intersection(*(set(p["mean"]) for p in parts))
            mean = {k: statistics.fmean(p["mean"][k] for p in parts) for k in keys}
            mean["step"] = statistics.fmean(r.step_s for r in runs)
            mean["bound"] = bounds[schedule, P, M].step_s
            mean["lost"] = mean["step"] - mean["bound"]
            per_stage_wait = [
                statistics.fmean(p["per_stage"][s]["wait_extra"] for p in parts) for s in range(P)
            ]
            stage_gaps = [st.gaps for r in runs for st in r.stages if st.gaps is not None]
            kinds = {k for g in stage_gaps for k in g}
            lost[schedule] = {
                "mean": mean,
                "gaps": {
                    k: sum(g.get(k, 0.0) for g in stage_gaps) / len(stage_gaps) for k in kinds
                },
                "wait_extra_per_stage": per_stage_wait,
                "outside_step_per_stage": [
                    statistics.fmean(
                        p["per_stage"][s]["around_step"] + p["per_stage"][s]["actor_boundary"]
                        for p in parts
                    )
                    for s in range(P)
                ],
            }
        if lost:
            print_lost(lost, P, M)
        row["lost_ms"] = {
            n: {k: round(1e3 * v, 2) for k, v in sorted(d["mean"].items())} for n, d in lost.items()
        }
        row["between_spans_ms"] = {
            n: {
                k: round(1e3 * v, 2)
                for k, v in sorted(d["gaps"].items(), key=lambda kv: -kv[1])
                if v >= 1e-4
            }
            for n, d in lost.items()
        }
        row["lost_ms_per_stage"] = {
            n: {
                "wait_extra": [round(1e3 * v, 2) for v in d["wait_extra_per_stage"]],
                "outside_step": [round(1e3 * v, 2) for v in d["outside_step_per_stage"]],
            }
            for n, d in lost.items()
        }

        boundary: dict[str, Any] = {}
        for schedule in SCHEDULES:
            runs = evtrain_runs.get((schedule, P, M), [])
            crossings = [b for r in runs for b in r.boundaries]
            step = step_time(schedule, P, M, "evtrain")
            if not crossings or step is None:
                continue
            gap = statistics.fmean(b.gap for b in crossings)
            publish = [b.publish_spans for b in crossings if b.publish_spans is not None]
            boundary[schedule] = {
                "critical_ms": round(1e3 * gap, 2),
                "share_of_step": round(gap / step, 4),
                **{
                    f"{part}_ms": round(
                        1e3 * statistics.fmean(getattr(b, part) for b in crossings), 2
                    )
                    for part in ("exchange", "to_end", "actor", "start")
                },
                "publish_spans_ms": _rounded(1e3 * statistics.fmean(publish), 2)
                if publish
                else None,
                "stages": sorted({b.stage for b in crossings}),
            }
        row["boundary"] = boundary
        rows.append(row)

    P, M = max(grid)
    largest = next(r for r in rows if (r["P"], r["M"]) == (P, M))
    print()
    print(f"the step boundary at P={P} M={M} (evtrain, timed steps with spans)")
    print(
        f"{'schedule':12s} {'critical':>9s} {'share':>7s} {'exchange':>9s} {'to end':>9s} "
        f"{'actor':>9s} {'start':>9s} {'spans':>9s}  next step starts on stage(s)"
    )
    for schedule, b in largest["boundary"].items():
        print(
            f"{schedule:12s} {b['critical_ms']:9.2f} {b['share_of_step']:7.1%} "
            f"{b['exchange_ms']:9.2f} {b['to_end_ms']:9.2f} {b['actor_ms']:9.2f} "
            f"{b['start_ms']:9.2f} {_num(b['publish_spans_ms'])}  {b['stages']}"
        )
    print(
        "ms; critical: the step's last compute on any stage to the next step's first "
        "compute on any stage; on the stage that starts the next step: exchange: until its "
        "control exchange ended; to end: then until its StepEnded (send drain, hop back to "
        "the actor, publishing the step's events); actor: then until its StepStarted; start: "
        "then until its first compute (hop to the step's thread, posting receives, loading); "
        "spans: of 'to end', what publishing a step's spans costs that stage (the boundaries "
        "are measured in steps with spans)"
    )

    headline = rows[0]
    summary: dict[str, Any] = {
        **{f"emu_bound_fraction_{s}": headline[f"emu_bound_fraction_{s}"] for s in SCHEDULES},
        **{f"emu_ratio_{s}": headline[f"emu_ratio_{s}"] for s in SCHEDULES},
        **{
            f"emu_instruction_fraction_{s}": headline[f"emu_instruction_fraction_{s}"]
            for s in SCHEDULES
        },
        "emu_zb_bubble_realised": headline["emu_zb_bubble_realised"],
        "emu_zbv_bubble_realised": headline["emu_zbv_bubble_realised"],
        "sleep_overshoot_ms": {
            "quiet": {f"{1e3 * s:g}": round(1e3 * o, 4) for s, o in cal.overshoot.items()},
            "in_stages": headline["sleep_overshoot_ms_in_stages"],
        },
        "layers_compute_ms": {
            f"{per}_per_chunk": {"forward": round(1e3 * f, 3), "backward": round(1e3 * b, 3)}
            for per, (f, b) in cal.compute.items()
        },
        "cpu": headline["cpu"],
        "lost_ms": headline["lost_ms"],
        "between_spans_ms": headline["between_spans_ms"],
        "boundary": largest["boundary"],
        "boundary_P": P,
        "P": headline["P"],
        "M": headline["M"],
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "kernels_ms": {
            "forward": 1e3 * costs.forward_s,
            "input": 1e3 * costs.input_s,
            "weight": 1e3 * costs.weight_s,
        },
        "layers_per_stage": costs.layers_per_stage,
        "wall_s": round(time.perf_counter() - wall_start, 1),
        "grid": rows,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
