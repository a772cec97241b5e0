"""evtrain's pipeline schedules on an emulated device: P = 4 and 8 stages on a 2-core machine.

Two cores cannot run eight stages of real compute at once, but a GPU does
not run its kernels on the host's CPU either. This bench gives every stage
process an emulated device (`Device`): a stream that runs kernels of fixed
length in launch order while the host goes on, as a CUDA stream does. What
is left on the CPUs is the engines' own work (Python, autograd on tiny
tensors, the messages, the optimizer, the control exchange, the events),
and it costs device time only where the host falls behind its device. The
bench measures how close each schedule comes to the step time of an ideal
engine on such a device, how evtrain compares with
torch.distributed.pipelining on the same layers, and where evtrain's lost
device time goes.

The emulated device. `EmulatedLayer` holds a tiny real ``nn.Linear(16, 16)``
(microbatches of 2 rows, float64), so autograd, the messages and SGD stay
real, and three kernels: forward ``--forward-ms`` (default 4), input
gradient ``--input-ms`` (4), weight gradient ``--weight-ms`` (4), so a
backward is twice a forward; ``--layers-per-stage`` (2) layers per stage, one
per model chunk under interleaved and zbv (two chunks per stage: the same
model and the same work per stage under every schedule).

* A launch returns at once; the kernel runs on the device from the later of
  the device's end of its previous kernel, the launch and the kernel's
  inputs being ready, and the device's clock advances by its length.
* Messages are stream-ordered, as NCCL's are: an activation or a gradient
  carries the device time at which it is ready in one extra column, which
  the consumer's kernel waits for on its device. The host sends the values
  at once (the tiny products are computed on the host), so a message's
  host-to-host latency costs device time only when the consumer's host is
  not ahead.
* The host waits for its device once per step, where each engine does on a
  GPU: evtrain at the start of its optimizer step (`WeightUpdate.step`, where
  ``float()`` of the step's loss and gradient norm needs the device), the
  torch twin after ``schedule.step()`` (where a training loop reads the
  step's loss). The bench wraps evtrain's private ``WeightUpdate.step`` for
  that, and ``evtrain.stages.backward._weight_grads`` (evtrain's d(weight)
  of a linear it splits, computed without autograd, so no autograd node can
  launch the weight kernel there); both wrappers raise if the function is
  gone rather than time an engine without its kernels.

Where each kernel runs: the forward and input-gradient kernels are one
autograd node (`_Kernel`) after the linear product, on the path to the
stage's input, so both engines run them in their input half (I). The
weight-gradient kernel runs where each engine computes d(weight): a node on
the weight's own path (`_WeightKernel`) for torch and for evtrain's
unsplit backward, the wrapped ``_weight_grads`` for evtrain's split one. On
the model's first chunk (no input gradient) both engines run the whole
backward in W, as evtrain's simulator assumes.

Contenders, for every (P, M) of ``--grid`` (default ``8x32``: P = 8, M =
32), alternating within each of ``--repeats`` repeats (the order reversed
every other repeat), ``--warmup`` untimed steps then ``--steps`` timed ones:

* evtrain ``1f1b``, ``interleaved`` (2 chunks per stage), ``zb`` and
  ``zbv``: real stage workers under torch.distributed.elastic, one torch
  thread each, publishing to a real broker with the default event settings
  (``microbatch_spans="sampled"``), drained by a thread in this process.
  Step time: the last stage's StepStarted of the first timed step to its
  StepEnded of the last.
* their torch twins on the same layers with static shapes, forked from this
  process under elastic: Schedule1F1B, ScheduleInterleaved1F1B (2 stages per
  rank), ScheduleInterleavedZeroBubble with one stage per rank (ZB-H1,
  evtrain's ``zb`` order) and ScheduleZBVZeroBubble (rank r holding chunks r
  and 2P-1-r). Step time: rank 0's wall time between barriers.

The bound: each schedule's ideal step on this device is evtrain's simulator
(`evtrain.stages.simulator.simulate`) on the instruction lists the stages
run, each instruction costing its chunk's kernels; the closed forms
(`evtrain.stages.simulator.bubble_fraction`) are printed beside it as a
check where they hold. It counts no time for messages, the optimizer, the
step boundary or the host: 1.0 is a perfect engine.

Figures: ``emu_bound_fraction_<sched>`` = bound / measured step time;
``emu_ratio_<sched>`` = evtrain steps/s / torch twin steps/s (medians over
repeats); ``emu_zb_bubble_realised`` (and ``emu_zbv_...``) = (measured 1F1B
step - measured zb step) / (simulated 1F1B step - simulated zb step): the
share of the bubble reduction the simulator promises that evtrain realises.

Where the lost time goes, per stage and step (both engines' devices report
it): the device's period is its kernels plus its idle time, and the idle
time splits by what each kernel waited for: its inputs (a peer's device:
the schedule's bubble, and a peer that is late), the host that launched it
late within the step, and, before the step's first kernel, the step
boundary. Lost = measured step - bound = input waits beyond the bubble
(the simulated idle time) + host late + the boundary.

The boundary on the critical path (evtrain, every pair of timed steps):
from the last kernel's end on any device to the next step's first launch,
on the stage holding the model's first chunk (stage 0; P - 1 under zbv),
split on that stage into the exchange (until its StepEnded: the
host's wake-up, the control exchange, publishing the step's events; its
``control`` span's end splits it where the step has spans), the actor's hop
(StepEnded to StepStarted) and the start (StepStarted to the first launch:
the hop to the step's thread, posting receives, loading the batch).
``--exchange PxMxD`` (default ``8x8x4``: 32 processes) runs evtrain's 1F1B
once more with D replicas of the pipeline, its kernels ``--exchange-scale``
(4) times as long (32 hosts on 2 cores keep ahead of their devices only
with longer kernels; the run's CPU share is printed), and prints the
exchange's cost (its upper bound above: to stage 0's StepEnded) and its
share of the step there (``emu_exchange_share_<N>``); ``--exchange ''``
skips it.

Also stated: the sleep overshoot of the host's one wait per step (quiet, in
this process), the host's own time per microbatch and chunk (a quiet
calibration), and every contender's CPU time per step, all its processes
together, as a share of the cores: the emulation holds while that share
stays well below 1, so that the hosts keep ahead of their devices.

    python bench/emulated_device.py [--grid 8x32,4x16] [--steps 6] [--warmup 5]
        [--repeats 1] [--forward-ms 4] [--input-ms 4] [--weight-ms 4]
        [--layers-per-stage 2] [--calibration 100] [--exchange 8x8x4]
        [--exchange-scale 4]
        [--only evtrain_zb,torch_zb] [--pin]

Tables go to stdout; the last line printed is one JSON object whose
top-level keys describe the first configuration of ``--grid``:
``emu_bound_fraction_<sched>``, ``emu_ratio_<sched>``,
``emu_zb_bubble_realised``, ``emu_zbv_bubble_realised``, ``lost_ms`` (per
engine and schedule), ``boundary``, ``emu_exchange_share_<N>``, ``cpu``,
``calibration``, ``P``, ``M``, the settings, ``wall_s`` (the bench's own wall
time) and ``grid`` (every configuration in full).
"""

from __future__ import annotations

import argparse
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
"""Features of the tiny linear in each layer; messages carry one more column: the time."""
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
TALLIES = ("busy", "input_wait", "host_late", "boundary", "overshoot", "cpu")
"""What a device accounts per step (seconds): its kernels, its idle time by cause, the
host's wake-up beyond the device's end, and the process's CPU time."""


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


class Device:
    """This process's emulated device: one stream, kernels in launch order.

    ``free_at`` is the ``time.perf_counter`` at which the last launched kernel
    ends. Each launch accounts the device's idle time before its kernel: the
    part until the kernel's inputs were ready (``input_wait``) and the part
    after both the device and the inputs were ready, until the host launched
    it (``host_late``; ``boundary`` for the step's first kernel).
    """

    def __init__(self) -> None:
        self.free_at = 0.0
        self.step: dict[str, float] = dict.fromkeys(TALLIES, 0.0)
        self.first_launch = 0.0
        self.cpu_at = time.process_time()
        self.timed: list[dict[str, float]] = []
        """Every synced step's tallies (the torch twins read them at their end)."""

    def launch(self, seconds: float, ready: float = 0.0) -> float:
        """Run a kernel of ``seconds`` once ``ready``; the device time it ends at."""
        now = time.perf_counter()
        free = self.free_at or now
        start = max(free, now, ready)
        self.step["input_wait"] += max(0.0, ready - free)
        late = max(0.0, now - max(free, ready))
        if self.first_launch:
            self.step["host_late"] += late
        else:
            self.step["boundary"] += late
            self.first_launch = time.time()
        self.step["busy"] += seconds
        self.free_at = start + seconds
        return self.free_at

    def sync(self) -> dict[str, float]:
        """The host waits for the device; the step's tallies, then a new step."""
        wait = self.free_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
            self.step["overshoot"] = time.perf_counter() - self.free_at
        cpu = time.process_time()
        self.step["cpu"], self.cpu_at = cpu - self.cpu_at, cpu
        # Wall-clock times, as the events carry: the offset read now, as the wall
        # clock may be adjusted during a run.
        figures = {
            **self.step,
            "device_end": self.free_at + time.time() - time.perf_counter(),
            "first_launch": self.first_launch,
        }
        self.timed.append(figures)
        self.step = dict.fromkeys(TALLIES, 0.0)
        self.first_launch = 0.0
        return figures


DEVICE = Device()


def _stamp(t: torch.Tensor, ready: float) -> torch.Tensor:
    """``t`` with the time column appended."""
    return torch.cat([t, t.new_full((t.shape[0], 1), ready)], dim=1)


def _ready(t: torch.Tensor) -> float:
    return float(t.detach()[:, WIDTH].max())


class _Arrive(torch.autograd.Function):
    """A layer's input: drops the time column going forward (the layer's kernel waits
    for it) and stamps the input gradient's ready time coming back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x[:, :WIDTH].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        # Autograd runs this after the layer's other backward nodes (the latest
        # created run first), so the stamp follows its weight kernel too, as a
        # GPU's stream-ordered send after the whole backward does.
        return _stamp(grad, DEVICE.free_at)


class _Kernel(torch.autograd.Function):
    """The forward kernel (in forward) and the input-gradient kernel (in backward)."""

    @staticmethod
    def forward(
        ctx: Any, y: torch.Tensor, ready: float, forward_s: float, input_s: float
    ) -> torch.Tensor:
        ctx.input_s = input_s
        if y.is_meta:  # evtrain's shape survey
            return _stamp(y, 0.0)
        return _stamp(y, DEVICE.launch(forward_s, ready))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        DEVICE.launch(ctx.input_s, _ready(grad))
        return grad[:, :WIDTH], None, None, None


class _WeightKernel(torch.autograd.Function):
    """The weight-gradient kernel, on the weight's own path: autograd runs it only
    when it is asked for the weight's gradient."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, weight_s: float) -> torch.Tensor:
        ctx.weight_s = weight_s
        return weight.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        DEVICE.launch(ctx.weight_s)
        return grad, None


_WEIGHT_KERNEL_ATTR = "_emulated_weight_s"


def _install_evtrain_hooks() -> None:
    """Launch the weight kernel in evtrain's d(weight) of a split linear, and wait for
    the device at the start of its optimizer step (see the module docstring)."""
    from evtrain.stages import backward, update

    original = backward._weight_grads
    if getattr(original, "_emulated", False):
        return

    def weight_grads(layer: nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> None:
        DEVICE.launch(layer.__dict__.get(_WEIGHT_KERNEL_ATTR, 0.0))
        original(layer, x, dy)

    weight_grads._emulated = True  # type: ignore[attr-defined]
    backward._weight_grads = weight_grads

    step = update.WeightUpdate.step

    def synced_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        evtrain.report({f"emu_{k}": v for k, v in DEVICE.sync().items()})
        return step(self, *args, **kwargs)

    update.WeightUpdate.step = synced_step  # type: ignore[method-assign]


class EmulatedLayer(nn.Module):
    """A layer of the emulated device: a tiny real linear and three kernels of fixed length.

    Forward launches ``forward_s``; the backward launches ``input_s`` in the
    part that computes the input's gradient and ``weight_s`` in the part that
    computes the weight's. Takes and returns ``WIDTH + 1`` columns: the last
    is the device time at which the values are ready.
    """

    def __init__(
        self, forward_s: float, input_s: float, weight_s: float, width: int = WIDTH
    ) -> None:
        super().__init__()
        self.forward_s, self.input_s, self.weight_s = forward_s, input_s, weight_s
        self.linear = nn.Linear(width, width, dtype=torch.float64)
        # Read by the wrapped _weight_grads (the instance dict: nn.Module's
        # __getattr__ is not consulted there).
        self.linear.__dict__[_WEIGHT_KERNEL_ATTR] = weight_s
        _install_evtrain_hooks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ready = 0.0 if x.is_meta else _ready(x)
        x = _Arrive.apply(x) if x.requires_grad else x[:, :WIDTH]
        linear = self.linear
        if "forward" in linear.__dict__:
            # evtrain's SplitBackward routed this linear (zb/zbv, a chunk whose
            # input takes a gradient): its W runs the wrapped _weight_grads.
            y = linear(x)
        else:
            weight = _WeightKernel.apply(linear.weight, self.weight_s)
            y = F.linear(x, weight, linear.bias)
        out: torch.Tensor = _Kernel.apply(y, ready, self.forward_s, self.input_s)
        return out


def samples() -> tuple[torch.Tensor, torch.Tensor]:
    """The data set: random inputs (ready at once) and regression targets."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, WIDTH, generator=g, dtype=torch.float64)
    y = torch.randn(SAMPLES, WIDTH, generator=g, dtype=torch.float64)
    return _stamp(x, 0.0), y


def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the values (not the time column)."""
    return F.mse_loss(out[:, :WIDTH], target)


@dataclass(frozen=True)
class Calibration:
    """The device's own costs, measured in this process before the runs (no stage running)."""

    overshoot: float
    """The mean time a host's wait for its device takes beyond the device's end."""
    host: dict[int, tuple[float, float]]
    """Per layers in a chunk: the host's seconds for a chunk's forward and its whole
    backward (autograd, the tiny products, the launches)."""


def calibrate(costs: Costs, count: int) -> Calibration:
    """Run ``count`` microbatches through one chunk of every size the schedules use,
    waiting for the device after each (the quiet wake-up)."""
    torch.set_num_threads(1)
    host = {}
    over: list[float] = []
    for per in sorted({costs.per_chunk(s) for s in SCHEDULES}):
        chunk = nn.Sequential(*(EmulatedLayer(*costs.kernels) for _ in range(per)))
        x = samples()[0][:MICROBATCH].requires_grad_(True)
        forward = backward = 0.0
        # The first passes pay for autograd's and the allocator's first use.
        for i in range(-3, count):
            start = time.perf_counter()
            y = chunk(x)
            middle = time.perf_counter()
            torch.autograd.backward([y], [torch.zeros_like(y)])
            end = time.perf_counter()
            over.append(DEVICE.sync()["overshoot"])
            if i >= 0:
                forward += middle - start
                backward += end - middle
        host[per] = (forward / count, backward / count)
    DEVICE.timed.clear()
    return Calibration(statistics.fmean(over[3:]), host)


# -------------------------------------------------------------------- evtrain side


def spec_text(schedule: str, P: int, M: int, D: int, costs: Costs, run_dir: str) -> str:
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
    loss_fn=emu.loss,
    optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
    train_data=emu.samples,
    batch_size={M * MICROBATCH * D},
    num_microbatches={M},
    max_steps=10,
    stages={P},
    data_parallel={D},
    virtual_stages={V},
    schedule={schedule!r},
    balance={[per_chunk] * (P * V)},
    threads=1,
    run_dir={run_dir!r},
)
"""


def run_stages(spec: Path, processes: int, steps: int, run_id: str) -> list[Any]:
    """evtrain's stage workers on a live bus (as pipeline_vs_torch's ``run_events``),
    drained by a thread while they run: at P = 8 the sampled spans alone outgrow
    the broker's and the subscriber's queues."""
    from evtrain.bus import Broker, BusAddress, Subscriber
    from evtrain.stages.entry import worker_main
    from evtrain.stages.worker import WorkerConfig

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
            pvt._launch(processes, worker_main, config.encode())
        finally:
            finished.set()
            thread.join()
    if missing and missing[0]:
        raise RuntimeError(f"the subscriber missed {missing[0]} events; figures would be wrong")
    return events


@dataclass(frozen=True)
class Boundary:
    """One step boundary on the critical path (seconds): from the last kernel's end on
    any device to the next step's first launch, split on the stage that makes it (the
    one holding the model's first chunk: stage 0, or P - 1 under zbv)."""

    gap: float
    exchange: float
    """Until that stage's StepEnded: the wake-up, the control exchange, the step's events."""
    control: float | None
    """Of ``exchange``, until that stage's control span ended (steps with spans)."""
    actor: float
    """StepEnded to the next StepStarted: the actor's loop."""
    start: float
    """StepStarted to the first launch: the hop to the step's thread, posting the
    pass's receives, loading the batch."""


@dataclass
class Run:
    """One contender's run: its step time and its devices' tallies per step (means over
    the timed steps, per process)."""

    step_s: float
    devices: list[dict[str, float]]
    boundaries: list[Boundary]


def evtrain_run(
    events: Sequence[Any], schedule: str, P: int, D: int, steps: int, warmup: int
) -> Run:
    """Step time, device tallies and boundaries from one run's events."""
    from evtrain.events import MicrobatchWait, StepEnded, StepStarted
    from evtrain.stages.schedules import chunk_place

    entry = chunk_place(schedule, P, 0)[0]
    """The stage that starts every step: it holds the model's first chunk."""

    first, final = warmup + 1, warmup + steps
    timed = range(first, final + 1)
    starts = {(e.stage, e.replica, e.step): e.ts for e in events if isinstance(e, StepStarted)}
    ends: dict[tuple[int, int, int], Any] = {
        (e.stage, e.replica, e.step): e for e in events if isinstance(e, StepEnded)
    }
    places = [(s, r) for s in range(P) for r in range(D)]
    if any((*p, k) not in ends or (*p, k) not in starts for p in places for k in timed):
        raise RuntimeError(f"missing step events of timed steps ({len(events)} received)")
    step_s = (ends[P - 1, 0, final].ts - starts[P - 1, 0, first]) / steps

    def tally(place: tuple[int, int], k: int, key: str) -> float:
        return float(ends[(*place, k)].metrics[f"emu_{key}"])

    devices = [
        {key: statistics.fmean(tally(p, k, key) for k in timed) for key in TALLIES} for p in places
    ]
    control_end = {
        (e.stage, e.replica, e.step): e.end
        for e in events
        if isinstance(e, MicrobatchWait) and e.op == "control"
    }
    boundaries = []
    for k in timed:
        if k + 1 not in timed:
            continue
        device_end = max(tally(p, k, "device_end") for p in places)
        launch = tally((entry, 0), k + 1, "first_launch")
        ended, started = ends[entry, 0, k].ts, starts[entry, 0, k + 1]
        control = control_end.get((entry, 0, k))
        boundaries.append(
            Boundary(
                gap=launch - device_end,
                exchange=ended - device_end,
                control=None if control is None else control - device_end,
                actor=started - ended,
                start=launch - started,
            )
        )
    return Run(step_s, devices, boundaries)


def run_evtrain(
    tmp: Path, schedule: str, P: int, M: int, D: int, costs: Costs, steps: int, warmup: int
) -> Run:
    """One evtrain contender: launch, collect, measure."""
    tag = uuid.uuid4().hex[:8]
    spec = tmp / f"emu_{schedule}_{P}x{M}x{D}_{tag}.py"
    spec.write_text(spec_text(schedule, P, M, D, costs, str(tmp / "runs")))
    events = run_stages(spec, P * D, warmup + steps, f"bench-emulated-{schedule}-{tag}")
    return evtrain_run(events, schedule, P, D, steps, warmup)


# ---------------------------------------------------------------------- torch side


def torch_twin(
    kind: str,
    microbatches: int,
    steps: int,
    warmup: int,
    kernels: tuple[float, float, float],
    layers_per_stage: int,
) -> tuple[float | None, dict[str, float]]:
    """One rank of torch.distributed.pipelining on the emulated layers (the shapes of
    pipeline_vs_torch's ``torch_worker``): rank 0's steps/s, and every rank's device
    tallies per timed step."""
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
        wide = {"dtype": torch.float64}
        stages.append(
            PipelineStage(
                module,
                index,
                world * chunks,
                torch.device("cpu"),
                # requires_grad as at run time (see pipeline_vs_torch's torch_worker):
                # without it a later stage would skip its input gradient.
                input_args=(torch.empty(mb, WIDTH + 1, requires_grad=index > 0, **wide),),
                output_args=torch.empty(mb, WIDTH + 1, requires_grad=True, **wide),
                output_grads=(torch.empty(mb, WIDTH + 1, **wide),),
                input_grads=(torch.empty(mb, WIDTH + 1, **wide),),
            )
        )
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
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            DEVICE.timed.clear()
            start = time.perf_counter()
        if kind == "zbv" and rank == 0:  # the V's two ends
            schedule.step(x, target=y, losses=[])
        elif rank == 0:
            schedule.step(x)
        elif rank == world - 1 and kind != "zbv":
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        DEVICE.sync()  # the training loop reads the step's loss
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    means = {key: statistics.fmean(t[key] for t in DEVICE.timed) for key in TALLIES}
    return (steps / elapsed if rank == 0 else None), means


def _launch_forked(nproc: int, entrypoint: Callable[..., Any], *args: Any) -> dict[int, Any]:
    """pipeline_vs_torch's ``_launch``, its workers forked from this process.

    Eight spawned interpreters importing torch on two cores take about half a
    minute to start and to end, more than the timed steps; forked ones share
    the imports. A torch rank uses nothing of this process's state but the
    functions it runs (and a fresh `DEVICE`: the calibration's clears), so the
    timed steps are the same.
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


def run_torch(kind: str, P: int, M: int, costs: Costs, steps: int, warmup: int) -> Run:
    DEVICE.free_at = 0.0  # the forked ranks' devices start idle
    out = _launch_forked(
        P, torch_twin, kind, M, steps, warmup, costs.kernels, costs.layers_per_stage
    )
    return Run(1 / out[0][0], [out[rank][1] for rank in range(P)], [])


# ------------------------------------------------------------------------ the bound


@dataclass(frozen=True)
class Bound:
    step_s: float
    idle_s: tuple[float, ...]
    """Each stage's idle time in the simulated step."""
    closed_form_s: float | None
    """Work per stage over one minus the closed-form bubble fraction (default costs)."""


def simulate_bound(schedule: str, P: int, M: int, costs: Costs) -> Bound:
    """The schedule's ideal step on the device: evtrain's simulator on the instruction
    lists the executor builds, each instruction costing its chunk's kernels."""
    from evtrain.stages.executor import DEFAULT_LOOKAHEAD
    from evtrain.stages.simulator import bubble_fraction, simulate

    V = CHUNKS.get(schedule, 1)
    per = costs.per_chunk(schedule)
    f, i, w = (per * s for s in costs.kernels)
    sim = simulate(
        schedule,
        P,
        M,
        f,
        i + w,
        weight_cost=w,
        reduce_grads=True,
        lookahead=DEFAULT_LOOKAHEAD,
        virtual_stages=V,
    )
    closed = None
    f, i, w = costs.kernels
    if i == w and f > 0 and abs(i + w - 2 * f) < 1e-12:
        work = M * costs.layers_per_stage * (f + i + w)
        closed = work / (1 - bubble_fraction(P, M, schedule, V))
    return Bound(sim.makespan, tuple(sim.makespan - b for b in sim.busy), closed)


# ----------------------------------------------------------------- lost-time table


LOST_ROWS = (
    ("lost", "lost = measured - bound"),
    ("input_extra", "  input waits beyond the bubble"),
    ("host_late", "  host late within the step"),
    ("boundary", "  the step boundary (before the step's first kernel)"),
    ("input_wait", "input waits, all (bubble included)"),
    ("idle_sim", "the schedule's own bubble (simulated)"),
    ("overshoot", "host's wake-up beyond the device's end"),
)


def lost_time(runs: Sequence[Run], bound: Bound, D: int) -> dict[str, float]:
    """Means over stages (replica 0) and runs of the lost-time rows (seconds)."""
    rows: dict[str, list[float]] = defaultdict(list)
    for run in runs:
        for stage, idle in enumerate(bound.idle_s):
            dev = run.devices[stage * D]
            rows["step"].append(run.step_s)
            rows["bound"].append(bound.step_s)
            rows["lost"].append(run.step_s - bound.step_s)
            rows["input_extra"].append(dev["input_wait"] - idle)
            rows["idle_sim"].append(idle)
            for key in ("input_wait", "host_late", "boundary", "overshoot", "busy"):
                rows[key].append(dev[key])
    return {k: statistics.fmean(v) for k, v in rows.items()}


def boundary_figures(runs: Sequence[Run]) -> dict[str, Any] | None:
    """Means over every timed boundary of the runs (milliseconds) and the gap's share
    of the step."""
    crossings = [b for r in runs for b in r.boundaries]
    if not crossings:
        return None
    controls = [b.control for b in crossings if b.control is not None]
    step = statistics.fmean(r.step_s for r in runs)
    gap = statistics.fmean(b.gap for b in crossings)
    return {
        "critical_ms": round(1e3 * gap, 3),
        "share_of_step": round(gap / step, 4),
        **{
            f"{part}_ms": round(1e3 * statistics.fmean(getattr(b, part) for b in crossings), 3)
            for part in ("exchange", "actor", "start")
        },
        "control_ms": round(1e3 * statistics.fmean(controls), 3) if controls else None,
        "boundaries": len(crossings),
    }


def cpu_table(runs: dict[str, list[Run]], *, quiet: bool = False) -> dict[str, dict[str, float]]:
    """CPU time per step of every contender's processes, and their share of the cores.

    The emulation holds only while the hosts keep ahead of their devices: a
    share near 1 means the stages queue for the CPU and the figures measure
    the machine.
    """
    cores = len(os.sched_getaffinity(0))
    out: dict[str, dict[str, float]] = {}
    for kind, kind_runs in runs.items():
        if not kind_runs:
            continue
        cpu = statistics.fmean(sum(d["cpu"] for d in r.devices) for r in kind_runs)
        step = statistics.fmean(r.step_s for r in kind_runs)
        out[kind] = {
            "cpu_ms_per_step": round(1e3 * cpu, 1),
            "share_of_cores": round(cpu / (cores * step), 3),
        }
    if quiet:
        return out
    print(
        f"CPU per step, all processes (ms) and its share of the {cores} cores: "
        + ", ".join(
            f"{k} {v['cpu_ms_per_step']:.0f} ({v['share_of_cores']:.0%})" for k, v in out.items()
        )
    )
    return out


# ------------------------------------------------------------------------------ main


def _shape(text: str, *, replicas: bool) -> tuple[int, int, int]:
    from evtrain.errors import UsageError
    from evtrain.schedule_names import check_virtual_stages

    parts = text.strip().split("x")
    form = "PxMxD, e.g. 8x16x4" if replicas else "PxM, e.g. 8x32"
    if len(parts) != (3 if replicas else 2) or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected {form}")
    P, M, D = (int(p) for p in (*parts, "1")[:3])
    if P < 2 or M < 1 or D < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected P >= 2, M >= 1, D >= 1")
    if M * MICROBATCH * D > SAMPLES:
        raise argparse.ArgumentTypeError(f"{text!r}: M x D at most {SAMPLES // MICROBATCH}")
    for schedule in SCHEDULES:
        try:
            check_virtual_stages(schedule, P, M, CHUNKS.get(schedule, 1))
        except UsageError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return P, M, D


def _grid(text: str) -> list[tuple[int, int]]:
    return [_shape(item, replicas=False)[:2] for item in text.split(",")]


def _exchange(text: str) -> tuple[int, int, int] | None:
    return _shape(text, replicas=True) if text.strip() else None


def _ms(x: float | None, width: int = 9) -> str:
    return f"{'n/a':>{width}s}" if x is None else f"{1e3 * x:{width}.1f}"


def _num(x: float | None, width: int = 9) -> str:
    return f"{'n/a':>{width}s}" if x is None else f"{x:{width}.3f}"


def _rounded(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def main() -> None:
    wall_start = time.perf_counter()
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--grid", type=_grid, default=_grid("8x32"), help="PxM,... (8x32)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per contender (6)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="untimed steps first (5: the timed ones publish no spans, as 49 of every "
        "50 steps of a run do)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="alternating repeats (1)")
    parser.add_argument("--forward-ms", type=float, default=4.0, help="forward kernel (4)")
    parser.add_argument("--input-ms", type=float, default=4.0, help="input-gradient kernel (4)")
    parser.add_argument("--weight-ms", type=float, default=4.0, help="weight-gradient kernel (4)")
    parser.add_argument(
        "--layers-per-stage", type=int, default=2, help="layers per stage, even (2)"
    )
    parser.add_argument(
        "--calibration", type=int, default=100, help="quiet microbatches per chunk size (100)"
    )
    parser.add_argument(
        "--exchange",
        type=_exchange,
        default=_exchange("8x8x4"),
        help="PxMxD of the control exchange's run: evtrain 1F1B with D replicas "
        "(8x8x4; '' skips it)",
    )
    parser.add_argument(
        "--exchange-scale",
        type=float,
        default=4.0,
        help="the exchange run's kernels are this many times as long (4)",
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
    if args.steps < 2 or args.warmup < 0 or args.repeats < 1:
        parser.error(
            "--steps must be >= 2 (a boundary between timed steps), --repeats >= 1, --warmup >= 0"
        )
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
        f"the device, quiet (this process, mean of {args.calibration}): the host's wake-up "
        f"{1e6 * cal.overshoot:.0f} us after its device's end; the host's time per microbatch, "
        "forward / backward of a chunk of "
        + ", ".join(
            f"{per} layer(s) {1e6 * f:.0f} / {1e6 * b:.0f} us" for per, (f, b) in cal.host.items()
        ),
        flush=True,
    )
    bounds = {(s, P, M): simulate_bound(s, P, M, costs) for P, M in grid for s in SCHEDULES}

    runs = [(kind, P, M) for P, M in grid for kind in CONTENDERS if kind in chosen]
    results: dict[tuple[str, int, int], list[Run]] = defaultdict(list)
    exchange_runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="evt-emu-") as tmpdir:
        tmp = Path(tmpdir)
        for repeat in range(args.repeats):
            # Reversed every other repeat: slow drift of the machine's load cancels.
            for kind, P, M in runs if repeat % 2 == 0 else runs[::-1]:
                side, schedule = kind.split("_", 1)
                launched = time.perf_counter()
                if side == "evtrain":
                    run = run_evtrain(tmp, schedule, P, M, 1, costs, args.steps, args.warmup)
                else:
                    run = run_torch(schedule, P, M, costs, args.steps, args.warmup)
                results[kind, P, M].append(run)
                print(
                    f"repeat {repeat + 1}/{args.repeats}  P={P} M={M:<3d} {kind:19s} "
                    f"{1 / run.step_s:6.3f} steps/s  {1e3 * run.step_s:7.1f} ms/step  "
                    f"(bound {1e3 * bounds[schedule, P, M].step_s:.1f}; "
                    f"{time.perf_counter() - launched:.0f} s with the launch)",
                    flush=True,
                )
        if args.exchange is not None:
            P, M, D = args.exchange
            launched = time.perf_counter()
            scale = args.exchange_scale
            longer = Costs(
                scale * costs.forward_s,
                scale * costs.input_s,
                scale * costs.weight_s,
                costs.layers_per_stage,
            )
            run = run_evtrain(tmp, "1f1b", P, M, D, longer, args.steps, args.warmup)
            exchange_runs.append(run)
            print(
                f"exchange     P={P} M={M} D={D} evtrain_1f1b  {1e3 * run.step_s:7.1f} ms/step "
                f"({time.perf_counter() - launched:.0f} s with the launch)",
                flush=True,
            )
    report(grid, bounds, results, exchange_runs, costs, cal, args, wall_start)


def report(
    grid: list[tuple[int, int]],
    bounds: dict[tuple[str, int, int], Bound],
    results: dict[tuple[str, int, int], list[Run]],
    exchange_runs: list[Run],
    costs: Costs,
    cal: Calibration,
    args: argparse.Namespace,
    wall_start: float,
) -> None:
    def step_time(kind: str, P: int, M: int) -> float | None:
        runs = results.get((kind, P, M), [])
        # The median rate's step time: rates are what the repeats vary in.
        return 1 / statistics.median(1 / r.step_s for r in runs) if runs else None

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
            f"{'closed':>8s} {'fraction':>8s} {'torch':>6s}"
        )
        for schedule in SCHEDULES:
            bound = bounds[schedule, P, M]
            ours = step_time(f"evtrain_{schedule}", P, M)
            theirs = step_time(f"torch_{schedule}", P, M)
            ratio = None if ours is None or theirs is None else theirs / ours
            fraction = None if ours is None else bound.step_s / ours
            torch_fraction = None if theirs is None else bound.step_s / theirs
            row[f"evtrain_{schedule}_step_ms"] = _rounded(None if ours is None else 1e3 * ours, 2)
            row[f"torch_{schedule}_step_ms"] = _rounded(None if theirs is None else 1e3 * theirs, 2)
            row[f"bound_{schedule}_step_ms"] = round(1e3 * bound.step_s, 2)
            row[f"emu_ratio_{schedule}"] = _rounded(ratio)
            row[f"emu_bound_fraction_{schedule}"] = _rounded(fraction)
            row[f"torch_bound_fraction_{schedule}"] = _rounded(torch_fraction)
            row[f"emu_ratio_{schedule}_per_repeat"] = [
                round(t.step_s / e.step_s, 3)
                for e, t in zip(
                    results.get((f"evtrain_{schedule}", P, M), []),
                    results.get((f"torch_{schedule}", P, M), []),
                    strict=False,
                )
            ]
            print(
                f"{schedule:12s} {_ms(ours, 8)} {_ms(theirs, 8)} {_num(ratio, 6)} "
                f"{_ms(bound.step_s, 8)} {_ms(bound.closed_form_s, 8)} "
                f"{_num(fraction, 8)} {_num(torch_fraction, 6)}"
            )
        print(
            "ms per step; ratio: evtrain / torch steps/s (twins: "
            + "; ".join(f"{s} {t}" for s, t in TWINS.items())
            + ").\nbound: evtrain's simulator on the stages' instruction lists, each "
            "instruction its kernels; closed: from the closed-form bubble (default costs "
            "only). fraction: bound / evtrain; torch: bound / torch."
        )
        one_ms, one_sim = step_time("evtrain_1f1b", P, M), bounds["1f1b", P, M].step_s
        for name in ("zb", "zbv"):
            ms, sim = step_time(f"evtrain_{name}", P, M), bounds[name, P, M].step_s
            promised = one_sim - sim
            realised = (
                None if one_ms is None or ms is None or promised <= 0 else (one_ms - ms) / promised
            )
            row[f"emu_{name}_bubble_realised"] = _rounded(realised)
            print(
                f"{name} vs 1f1b: the simulator promises {_ms(promised, 0).strip()} ms/step "
                f"less, evtrain realises {_num(realised, 0).strip()} of it"
            )
        row["cpu"] = cpu_table({kind: results.get((kind, P, M), []) for kind in CONTENDERS})

        lost = {
            kind: lost_time(results[kind, P, M], bounds[kind.split("_", 1)[1], P, M], 1)
            for kind in CONTENDERS
            if results.get((kind, P, M))
        }
        if lost:
            print()
            print(f"lost device time per step at P={P} M={M} (ms, mean over stages)")
            names = list(lost)
            print(f"{'':52s}" + "".join(f"{n.replace('evtrain_', 'ev_'):>11s}" for n in names))
            for key, label in (("step", "measured step"), ("bound", "bound"), *LOST_ROWS):
                print(f"{label:52s}" + "".join(_ms(lost[n].get(key), 11) for n in names))
        row["lost_ms"] = {
            n: {k: round(1e3 * v, 2) for k, v in sorted(d.items())} for n, d in lost.items()
        }
        row["boundary"] = {
            s: b
            for s in SCHEDULES
            if (b := boundary_figures(results.get((f"evtrain_{s}", P, M), []))) is not None
        }
        if row["boundary"]:
            print()
            print(f"evtrain's step boundary at P={P} M={M} (means over the timed boundaries)")
            print(
                f"{'schedule':12s} {'critical':>9s} {'share':>7s} {'exchange':>9s} "
                f"{'control':>9s} {'actor':>9s} {'start':>9s}"
            )
            for schedule, b in row["boundary"].items():
                print(
                    f"{schedule:12s} {b['critical_ms']:9.2f} {b['share_of_step']:7.1%} "
                    f"{b['exchange_ms']:9.2f} {_num(b['control_ms'])} {b['actor_ms']:9.2f} "
                    f"{b['start_ms']:9.2f}"
                )
            print(
                "ms; critical: the last kernel's end on any device to the next step's first "
                "launch (on the stage holding chunk 0); exchange: to its StepEnded (wake-up, "
                "control exchange, the step's events); control: of it, to the end of the control "
                "span (steps with spans); actor: StepEnded to StepStarted; start: "
                "StepStarted to the first launch"
            )
        rows.append(row)

    exchange: dict[str, Any] = {}
    if exchange_runs:
        P, M, D = args.exchange
        b = boundary_figures(exchange_runs)
        assert b is not None
        step = statistics.fmean(r.step_s for r in exchange_runs)
        share = b["exchange_ms"] / 1e3 / step
        cpu = cpu_table({"evtrain_1f1b_exchange": exchange_runs}, quiet=True)
        scale = args.exchange_scale
        exchange = {
            f"emu_exchange_share_{P * D}": round(share, 4),
            "exchange_run": {
                "P": P,
                "M": M,
                "D": D,
                "kernel_scale": scale,
                "step_ms": round(1e3 * step, 2),
                **b,
                **cpu["evtrain_1f1b_exchange"],
            },
        }
        print()
        print(
            f"the control exchange at P={P} x D={D} = {P * D} processes (evtrain 1f1b, M={M}, "
            f"kernels x{scale:g}): step {1e3 * step:.1f} ms; last kernel's end to stage 0's "
            f"StepEnded {b['exchange_ms']:.2f} ms ({share:.2%} of the step); the whole boundary "
            f"{b['critical_ms']:.2f} ms; CPU share of the cores "
            f"{cpu['evtrain_1f1b_exchange']['share_of_cores']:.0%}"
        )

    headline = rows[0]
    summary: dict[str, Any] = {
        **{f"emu_bound_fraction_{s}": headline[f"emu_bound_fraction_{s}"] for s in SCHEDULES},
        **{f"emu_ratio_{s}": headline[f"emu_ratio_{s}"] for s in SCHEDULES},
        "emu_zb_bubble_realised": headline["emu_zb_bubble_realised"],
        "emu_zbv_bubble_realised": headline["emu_zbv_bubble_realised"],
        **exchange,
        "lost_ms": headline["lost_ms"],
        "boundary": headline["boundary"],
        "cpu": headline["cpu"],
        "calibration": {
            "wake_up_us": round(1e6 * cal.overshoot, 1),
            "host_us_per_microbatch": {
                f"{per}_per_chunk": {"forward": round(1e6 * f, 1), "backward": round(1e6 * b, 1)}
                for per, (f, b) in cal.host.items()
            },
        },
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
