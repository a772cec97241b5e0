"""Runs one stage's instruction list: a training step or an evaluation pass.

The executor is deliberately synchronous. gloo's point-to-point work can
only be waited on, not polled or awaited (`Work.is_completed()` stays False
until `wait()`, and `get_future()` is not implemented), so the stage actor
hands a whole step to one worker thread (one thread hop per step) and keeps
its event loop free for heartbeats, signals and publishing.

How instructions map to communication (see `evtrain.stages.p2p`):

* Receives are *posted* ahead of the instructions that wait for them, one
  more after every instruction (`evtrain.stages.receives`); `RecvActivation`
  / `RecvGrad` wait for theirs.
* 1F1B and zero bubble run with one extra warm-up forward on every stage
  but the last (`DEFAULT_LOOKAHEAD`), so activations arrive before they are
  needed.
* `SendActivation` / `SendGrad` post an ``isend`` and never wait for it; the
  sends are waited on once, at the end of the step, when every peer has
  certainly posted the matching receive (so this cannot deadlock).
* `BackwardInput` / `BackwardWeight` (zero bubble) are the two halves of
  `Backward` (`evtrain.stages.backward`).
* With model chunks (interleaved and zbv) every instruction names the
  stage's chunk it is for; each (chunk, microbatch) has its own slot of
  per-pass state, the model's first chunk reads the inputs and its last
  computes the loss, and what a chunk sends goes to the chunk that takes it
  (`evtrain.stages.schedules.chunk_place`: interleaved's last stage feeds the
  first stage's next chunk, zbv's chunks run down and back up), on the
  receiving chunk's own process groups (`evtrain.stages.mesh`). When that
  chunk is on the same stage (zbv's turn on stage 0) the send and the
  receive are a hand-off in memory: the output's leaves, detached, become
  the next chunk's input, and the gradient comes back the same way.
* `ReduceGrads` makes the gradients final: with data parallelism DDP's
  reducer (`evtrain.stages.data_parallel`) has averaged them over the
  stage's replicas during the step's last backward, which is the one it arms
  (a split backward, or several chunks, have no such single backward: their
  gradients are averaged here, in one flat all-reduce); here too the tied
  weights' gradients are summed over their stages.
* `OptimizerStep` is the step boundary: the per-step control exchange
  (global gradient norm, global mean loss, commands, signals —
  `evtrain.stages.control`), clipping, the optimizer and LR-scheduler steps.

The last stage's loss, what its backwards start from and what the step
reports, is `evtrain.stages.update.StepLoss`.

Evaluation (`StageExecutor.evaluate`) runs one set at a time, forward only;
the last stage tallies its metrics (`evtrain.stages.evaluation`).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from evtrain.data import DataStream
from evtrain.job import Job
from evtrain.schedule_names import Schedule, parse_schedule
from evtrain.stages.backward import SplitBackward
from evtrain.stages.control import ControlResult, StepControl
from evtrain.stages.data_parallel import Replicas
from evtrain.stages.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    LoadMicrobatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
)
from evtrain.stages.liveness import Doing
from evtrain.stages.loading import Reader
from evtrain.stages.mesh import ChunkRoutes, Place
from evtrain.stages.p2p import Mailbox
from evtrain.stages.precision import autocast
from evtrain.stages.pytree import BoundarySpec, call, split
from evtrain.stages.receives import PassReceives
from evtrain.stages.schedules import build_schedule
from evtrain.stages.shapes import ShapeTable
from evtrain.stages.sharded import ShardedReplicas, local_tensor
from evtrain.stages.tensor_parallel import check_gathered
from evtrain.stages.update import StepLoss, Timed, WeightUpdate

_Program = list[tuple[Callable[[int, int], None], int, int, str]]
"""A compiled instruction list: (handler, microbatch, chunk, the instruction's name)."""

if TYPE_CHECKING:
    from evtrain.stages.evaluation import EvalTally

__all__ = ["DEFAULT_LOOKAHEAD", "Span", "StageExecutor", "StepStats"]


@dataclass(frozen=True)
class Span:
    """One timed piece of a step; times are ``time.perf_counter`` seconds."""

    kind: str
    """``"forward"``, ``"backward"`` or ``"wait"``."""
    microbatch: int
    start: float
    end: float
    op: str = ""
    """For waits: ``recv_act``, ``recv_grad``, ``send``, ``reduce``, ``control`` or
    ``shapes`` (telling and agreeing the pass's data shapes, `evtrain.stages.shapes`);
    for the halves of a split backward: ``input`` or ``weight``."""
    chunk: int = 0
    """The model chunk (interleaved and zbv: the stage's local chunk) of the microbatch."""


@dataclass
class StepStats:
    """What one training step measured on this stage."""

    step: int
    loss: float | None
    lr: float | None
    grad_norm: float
    samples: int
    epoch: int
    duration_s: float
    forward_s: float
    backward_s: float
    comm_wait_s: float
    cpu_s: float
    """CPU seconds of the thread that ran the step: the stage's own work, without its
    process's other threads (events, communication). 0 on other devices than the CPU,
    where the work is the device's."""
    control: ControlResult
    spans: list[Span] = field(default_factory=list)
    skipped: bool = False
    """fp16: the step overflowed somewhere in the pipeline and no stage applied it."""


DEFAULT_LOOKAHEAD = 1
"""Extra 1F1B warm-up forwards on every stage but the last (`build_schedule`'s
``lookahead``). With the textbook warm-up (0), a 2-stage pipeline on gloo
pays a gradient round trip per microbatch: the first stage sends activation
m only after the backward that waited for gradient m-2, so the last stage,
the busiest one, waits for it. One extra forward hides that latency for the
cost of one more stored activation per stage: the last stage stops waiting
for activations in the steady state and steps get shorter (figures:
docs/benchmarks.md, "Measurements behind design choices")."""


@dataclass(slots=True)
class _Slot:
    """One model chunk's microbatch within a pass: its specs and what it holds
    between instructions (each field dropped once used)."""

    act_spec: BoundarySpec
    out_spec: BoundarySpec | None
    size: int
    input: Any = None
    in_leaves: list[torch.Tensor] | None = None
    """The received input leaves that send a gradient back."""
    target: Any = None
    outputs: list[torch.Tensor] | None = None
    """The output leaves: all of them until sent, then those that take a gradient."""
    loss: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    """The microbatch's `Job.loss_weight` (training, last chunk)."""
    grads: list[torch.Tensor] | None = None


class StageExecutor:
    """Executes the instruction lists of one pipeline stage.

    ``shapes`` holds the (input, output) `BoundarySpec` of each of this
    stage's model chunks for every data shape, and names each pass's shapes
    (`evtrain.stages.shapes`). ``chunks`` are the chunks'
    modules (interleaved and zbv; default: ``module`` is the only chunk),
    ``module`` holds them all.
    ``train``/``evaluation`` read the first stage's inputs and the last
    stage's targets (`evtrain.stages.loading`); other stages have None.
    ``update`` ends each step (`evtrain.stages.update`); ``split`` runs the
    backward's halves under zb and zbv. ``lookahead`` applies to 1F1B (see
    `DEFAULT_LOOKAHEAD`); ``recv_window`` bounds the receives posted ahead
    (default: all of a pass).

    Its collaborators: the `Mailbox` sends and waits (`evtrain.stages.p2p`),
    `PassReceives` posts each pass's receives ahead (`evtrain.stages.receives`),
    ``replicas`` (DDP or FSDP2) reduce and shard, `StepLoss` keeps the last
    stage's loss, `WeightUpdate` ends the step (`evtrain.stages.update`), `Doing`
    names the instruction for the heartbeats (`evtrain.stages.liveness`).
    """

    def __init__(
        self,
        *,
        job: Job,
        stage: int,
        num_stages: int,
        device: torch.device,
        module: nn.Module,
        update: WeightUpdate,
        split: SplitBackward | None = None,
        mailbox: Mailbox,
        control: StepControl,
        stream: DataStream,
        replicas: Replicas | ShardedReplicas | None = None,
        place: Place | None = None,
        shapes: ShapeTable,
        chunks: Sequence[nn.Module] | None = None,
        train: Reader | None,
        recv_window: int | None = None,
        lookahead: int = DEFAULT_LOOKAHEAD,
        sequence_split: int = 1,
        loss_parallel: bool = False,
    ) -> None:
        self.job = job
        self.sequence_split = sequence_split
        """Tensor ranks a sequence-parallel plan splits sequences over (1: none)."""
        self.loss_parallel = loss_parallel
        """The last chunk's logits reach the loss split over the tensor ranks
        (`evtrain.stages.tensor_parallel`)."""
        self.stage = stage
        self.num_stages = num_stages
        self.device = device
        self.module = module
        self.chunks = list(chunks) if chunks is not None else [module]
        self.V = len(self.chunks)
        self.place = place or Place(stage, 0, num_stages, 1)
        kind = parse_schedule(job.schedule)
        self.routes = ChunkRoutes.of(kind, self.place, self.V)
        self.last = any(self.routes.last)
        """This stage computes the loss (the last one, under every schedule)."""
        # Hand-offs in memory, by receiving chunk: activations and gradients in
        # microbatch order.
        self._handed_acts: list[deque[list[torch.Tensor]]] = [deque() for _ in range(self.V)]
        self._handed_grads: list[deque[list[torch.Tensor]]] = [deque() for _ in range(self.V)]
        self.update = update
        self.optimizer = update.optimizer
        self.lr_scheduler = update.lr_scheduler
        self.scaler = update.scaler
        self.mailbox = mailbox
        self.control = control
        self.replicas = replicas
        self.stream = stream
        self.shapes = shapes
        self.train = train
        self.M = job.num_microbatches
        self.receives = PassReceives(mailbox, self.routes, recv_window or self.M)
        self.doing = Doing(self.routes, self.V, self.place)
        """The instruction being executed, for the heartbeats (`evtrain.stages.liveness`)."""
        self.stop_requested = False
        """Set (from another thread) when this process got SIGTERM/SIGINT."""

        self.lookahead = 0 if kind is Schedule.GPIPE else lookahead
        self._split = split
        program = build_schedule(
            job.schedule,
            stage,
            num_stages,
            self.M,
            lookahead=self.lookahead,
            reduce_grads=True,
            virtual_stages=self.V,
        )
        if program[-2:] != [ReduceGrads(), OptimizerStep()]:
            raise RuntimeError("a training schedule must end with ReduceGrads, OptimizerStep")
        # grad_accum passes run the program without its last two instructions;
        # the reduction and the boundary run once, after the last pass.
        self._pass_program = self._compile(program[:-2])
        backwards = [i.microbatch for i in program if isinstance(i, Backward)]
        self._last_backward = backwards[-1] if backwards and self.V == 1 else -1
        """The microbatch whose backward ends the pass: the one the reducer is armed for
        (with one chunk; several chunks average their gradients at `ReduceGrads`)."""
        self._final_pass = False
        self._eval_programs: dict[int, _Program] = {}

        # Per-pass state: chunk v's microbatch m is slot v * n + m in a pass of n.
        self._n = 0
        self._slots: list[_Slot] = []
        self._batch_x: list[Any] = []
        self._batch_y: list[Any] = []
        self._mb_offset = 0
        self._spans: list[Span] | None = None
        self._forward_s = 0.0
        self._backward_s = 0.0
        self.step_loss = StepLoss(job, update.scaler)
        self._tally: EvalTally | None = None
        self._training = True

    # ------------------------------------------------------------ compilation

    def _compile(self, program: Sequence[Instruction]) -> _Program:
        handlers: dict[type, Callable[[int, int], None]] = {
            LoadMicrobatch: self._load,
            RecvActivation: self._recv_activation,
            Forward: self._forward,
            SendActivation: self._send_activation,
            RecvGrad: self._recv_grad_wait,
            Backward: self._backward,
            BackwardInput: self._backward_input,
            BackwardWeight: self._backward_weight,
            SendGrad: self._send_grad,
        }
        compiled = []
        for instruction in program:
            if isinstance(instruction, ReduceGrads | OptimizerStep):
                raise RuntimeError(f"{instruction} may only end a training program")
            compiled.append(
                (
                    handlers[type(instruction)],
                    instruction.microbatch,
                    instruction.chunk,
                    type(instruction).__name__,
                )
            )
        return compiled

    def _run(self, program: _Program) -> None:
        """Execute ``program`` on the pass begun, noting each instruction for `doing`."""
        offset, doing, post_one = self._mb_offset, self.doing, self.receives.post_one
        for handler, microbatch, chunk, kind in program:
            doing.at = (kind, offset + microbatch, chunk, time.monotonic())
            handler(microbatch, chunk)
            post_one()

    # ---------------------------------------------------------------- training

    def train_step(self, step: int, *, record_spans: bool = False) -> StepStats:
        """Run training step ``step`` (1-based: step k reads the data of index k-1)."""
        start = time.perf_counter()
        cpu_start = time.thread_time()
        self._bind_device()
        # The boundary's control receives, posted now so the peers' numbers
        # are waiting when this stage reaches the boundary.
        self.control.prepare()
        self._spans = [] if record_spans else None
        self._forward_s = self._backward_s = 0.0
        self.step_loss.reset()
        self.mailbox.reset_wait()
        self._training = True
        if self.replicas is not None:
            self.replicas.begin_step()
        index = step - 1
        mb = self.job.microbatch_size
        for accum in range(self.job.grad_accum):
            self._mb_offset = accum * self.M
            self._final_pass = accum == self.job.grad_accum - 1
            self.doing.set("LoadBatch")
            self._load_batch(self.stream.batch_index(index, accum))
            self._begin_pass([mb] * self.M)
            self._run(self._pass_program)
        self._final_pass = False
        self.doing.set("ReduceGrads")
        self._wait(self.update.reduce_grads(), "reduce")
        lr = float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else None
        local_loss, local_weight = self.step_loss.local()
        self.doing.set("OptimizerStep")
        control, timed = self.update.step(local_loss, self.stop_requested, local_weight)
        self._wait(timed, "control")
        drain_start, drain_end = self.mailbox.drain_sends()
        if self._spans is not None and drain_end - drain_start > 1e-4:
            self._spans.append(Span("wait", -1, drain_start, drain_end, "send"))
        self._end_pass()
        self.doing.at = None
        return StepStats(
            step=step,
            loss=control.loss if self.last else None,
            lr=lr,
            grad_norm=control.grad_norm,
            samples=self.job.samples_per_step,
            epoch=self.stream.epoch_of(index),
            duration_s=time.perf_counter() - start,
            forward_s=self._forward_s,
            backward_s=self._backward_s,
            comm_wait_s=self.mailbox.reset_wait(),
            cpu_s=time.thread_time() - cpu_start if self.device.type == "cpu" else 0.0,
            control=control,
            spans=self._spans or [],
            skipped=self.update.skipped,
        )

    def _bind_device(self) -> None:
        # The current CUDA device is per thread, and each call may run on
        # another worker thread of the actor.
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _wait(self, timed: Timed | None, op: str) -> None:
        """Count a wait at the end of the step, and record its span."""
        if timed is None:
            return
        self.mailbox.wait_s += timed.waited
        if self._spans is not None:
            self._spans.append(Span("wait", -1, timed.start, timed.end, op))

    # ------------------------------------------------------------------ passes

    def _begin_pass(self, sizes: Sequence[int]) -> None:
        n = len(sizes)
        self._n = n
        start = time.perf_counter()
        if self.shapes.varying:
            self.doing.set("AgreeShapes")
        ids = self.shapes.pass_ids(sizes, self._batch_x if any(self.routes.first) else None)
        if self._spans is not None and self.shapes.varying:
            self._spans.append(Span("wait", -1, start, time.perf_counter(), "shapes"))
        specs = [self.shapes.specs(v, i) for v in range(self.V) for i in ids]
        self._slots = [_Slot(act, out, sizes[k % n]) for k, (act, out) in enumerate(specs)]
        for v in range(self.V):
            self._handed_acts[v].clear()
            self._handed_grads[v].clear()
        self.receives.begin(specs, n)

    def _end_pass(self) -> None:
        self._slots = []
        self.receives.end()
        self._batch_x = self._batch_y = []

    def _load_batch(self, batch_index: int) -> None:
        if self.train is None:
            return
        inputs, targets = self.train.batch(batch_index)
        mb = self.job.microbatch_size
        if inputs is not None:
            self._batch_x = split(inputs, mb)
        if targets is not None:
            self._batch_y = split(targets, mb)

    # ------------------------------------------------------------ instructions

    def _load(self, m: int, v: int) -> None:
        slot = self._slots[v * self._n + m]
        if self.routes.first[v]:
            slot.input = self._batch_x[m]
        if self.routes.last[v]:
            slot.target = self._batch_y[m]

    def _recv_activation(self, m: int, v: int) -> None:
        slot = self._slots[v * self._n + m]
        peer = self.routes.prev[v]
        assert peer is not None
        if self.routes.local(peer):
            leaves = self._handed_acts[v].popleft()
        else:
            pending = self.receives.take("act", v, m)
            assert pending is not None, f"activation {m} of chunk {v} was never posted"
            leaves, start, end = self.mailbox.wait(pending)
            if self._spans is not None:
                self._spans.append(Span("wait", self._mb_offset + m, start, end, "recv_act", v))
        spec = slot.act_spec
        if self._training:
            slot.in_leaves = [
                leaf.requires_grad_(True)
                for leaf, leaf_spec in zip(leaves, spec.leaves, strict=True)
                if leaf_spec.carries_grad
            ]
        slot.input = spec.unflatten(leaves, self.device)

    def _forward(self, m: int, v: int) -> None:
        slot = self._slots[v * self._n + m]
        x, slot.input = slot.input, None
        last = self.routes.last[v]
        start = time.perf_counter()
        # One chunk goes through DDP's wrapper (its reducer is armed by hand);
        # several chunks are their layers, averaged at ReduceGrads instead.
        replicas = self.replicas if self._training and self.V == 1 else None
        with self._loss_context(v):
            with autocast(self.job.precision, self.device):
                if replicas is None:
                    out = call(self.chunks[v], x)
                else:
                    with replicas.accumulating():
                        out = call(replicas.module, x)
                loss = None
                if last and self.sequence_split > 1:
                    check_gathered(out, slot.target, self.sequence_split)
                if last and self._training:
                    assert slot.target is not None
                    # A split loss is a replicated DTensor: its backward stays one.
                    loss = local_tensor(self.job.loss(out, slot.target))
            if last and loss is None and self._tally is not None:
                self._tally.add(out, slot.target, slot.size)
        if loss is not None:
            slot.loss, slot.weight = loss, self.step_loss.add(loss, slot.target)
        elif not last:
            assert slot.out_spec is not None
            where = f"stage {self.stage} output of microbatch {m}"
            slot.outputs = slot.out_spec.leaves_of(out, where)
        end = time.perf_counter()
        self._forward_s += end - start
        if self._spans is not None:
            self._spans.append(Span("forward", self._mb_offset + m, start, end, "", v))

    def _send_activation(self, m: int, v: int) -> None:
        slot = self._slots[v * self._n + m]
        leaves, spec = slot.outputs, slot.out_spec
        peer = self.routes.next[v]
        assert leaves is not None and spec is not None and peer is not None
        if self.routes.local(peer):
            # What a receive would give: new leaves, without this chunk's history
            # (the shared version counter still catches an in-place change).
            self._handed_acts[peer[1]].append([t.detach() for t in leaves])
        else:
            self.mailbox.send_activation(leaves, *peer)
        if not self._training:
            slot.outputs = None
            return
        # Keep only what the backward needs.
        slot.outputs = [t for t, s in zip(leaves, spec.leaves, strict=True) if s.carries_grad]
        self._open_grads()

    def _open_grads(self) -> None:
        if self._training:
            self.receives.open_grads()

    def _recv_grad_wait(self, m: int, v: int) -> None:
        self._open_grads()  # a program without SendActivation first
        slot = self._slots[v * self._n + m]
        peer = self.routes.next[v]
        assert peer is not None
        if self.routes.local(peer):
            spec = slot.out_spec
            slot.grads = self._handed_grads[v].popleft() if spec and spec.carries_grad else None
            return
        pending = self.receives.take("grad", v, m)
        if pending is None:  # integer outputs carry no gradient
            return
        grads, start, end = self.mailbox.wait(pending)
        if self._spans is not None:
            self._spans.append(Span("wait", self._mb_offset + m, start, end, "recv_grad", v))
        slot.grads = grads

    def _backward_roots(
        self, m: int, v: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """What microbatch ``m``'s backward starts from: the scaled loss (last
        chunk), or the outputs that take a gradient with the gradients received."""
        slot = self._slots[v * self._n + m]
        if self.routes.last[v]:
            loss, slot.loss = slot.loss, None
            weight, slot.weight = slot.weight, None
            assert loss is not None
            return [self.step_loss.root(loss, weight)], None
        outs, received = slot.outputs or [], slot.grads or []
        slot.outputs = slot.grads = None
        pairs = [(o, g) for o, g in zip(outs, received, strict=True) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _backward_input(self, m: int, v: int) -> None:
        assert self._split is not None
        start = time.perf_counter()
        tensors, grads = self._backward_roots(m, v)
        k = v * self._n + m
        with self._local_grads(), self._loss_context(v):
            self._split.input_half(k, tensors, grads, self._slots[k].in_leaves or [])
        self._backward_span(m, v, start, "input")

    def _backward_weight(self, m: int, v: int) -> None:
        assert self._split is not None
        start = time.perf_counter()
        with self._local_grads(), self._loss_context(v):
            self._split.weight_half(v * self._n + m)
        if self.replicas is not None:
            self.replicas.weight_half_done()
        self._backward_span(m, v, start, "weight")

    def _loss_context(self, v: int) -> contextlib.AbstractContextManager[None]:
        """Chunk ``v``'s forward and backward with split logits: under ``loss_parallel``
        (no effect on an op of plain tensors)."""
        if self.loss_parallel and self.routes.last[v]:
            return loss_parallel()
        return contextlib.nullcontext()

    def _local_grads(self) -> contextlib.AbstractContextManager[None]:
        """Gradients accumulate on this replica only (DDP's reducer stays off)."""
        return self.replicas.accumulating() if self.replicas else contextlib.nullcontext()

    def _backward_span(self, m: int, v: int, start: float, part: str = "") -> None:
        end = time.perf_counter()
        self._backward_s += end - start
        if self._spans is not None:
            self._spans.append(Span("backward", self._mb_offset + m, start, end, part, v))

    def _backward(self, m: int, v: int) -> None:
        start = time.perf_counter()
        tensors, grads = self._backward_roots(m, v)
        if tensors:
            replicas = self.replicas
            with self._loss_context(v):
                if replicas is None:
                    torch.autograd.backward(tensors, grads)
                elif self._final_pass and m == self._last_backward:
                    replicas.arm(tensors)  # this backward reduces, overlapped with itself
                    torch.autograd.backward(tensors, grads)
                else:
                    with replicas.accumulating():
                        torch.autograd.backward(tensors, grads)
        self._backward_span(m, v, start)

    def _send_grad(self, m: int, v: int) -> None:
        slot = self._slots[v * self._n + m]
        leaves, slot.in_leaves = slot.in_leaves, None
        peer = self.routes.prev[v]
        if not leaves or peer is None:
            return
        grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]
        if self.routes.local(peer):
            self._handed_grads[peer[1]].append(grads)
        else:
            self.mailbox.send_grad(grads, *peer)

    # -------------------------------------------------------------- evaluation

    @contextlib.contextmanager
    def forward_only(self, *, train_mode: bool = False) -> Iterator[None]:
        """Forward-only passes (`forward_pass`, `forward_training_batch`) without grad, in
        ``eval()`` mode (``train_mode``: in ``train()`` mode, so BatchNorm updates its
        statistics)."""
        self._bind_device()
        self._training = False
        self._spans = None
        was_training = self.module.training
        # The chunks too: a model= stage's chunks are views with containers of their own.
        for module in (self.module, *self.chunks):
            module.train(train_mode)
        try:
            with torch.no_grad():
                yield
            self.mailbox.drain_sends()
        finally:
            self._training = True
            self._tally = None
            self.doing.at = None
            for module in (self.module, *self.chunks):
                module.train(was_training)
            self._end_pass()
            self.mailbox.reset_wait()

    def forward_pass(
        self, batch: Sequence[range], reader: Reader | None, tally: EvalTally | None
    ) -> None:
        """One eval batch through this stage (inside `forward_only`): its microbatches
        are ``batch``'s rows, read by ``reader``; the last stage adds them to ``tally``."""
        self._mb_offset = 0
        self._tally = tally
        self._batch_x = []
        self._batch_y = []
        if reader is not None:
            self.doing.set("LoadBatch")
            pairs = [reader.rows(r) for r in batch]
            self._batch_x = [x for x, _ in pairs]
            self._batch_y = [y for _, y in pairs]
        self._begin_pass([len(r) for r in batch])
        self._run_forward_only(len(batch))

    def forward_training_batch(self, batch_index: int) -> None:
        """Training batch ``batch_index`` (this replica's share) through this stage, its
        outputs dropped (inside `forward_only`)."""
        self._mb_offset = 0
        self._tally = None
        self._batch_x = []
        self._batch_y = []
        self.doing.set("LoadBatch")
        self._load_batch(batch_index)
        self._begin_pass([self.job.microbatch_size] * self.M)
        self._run_forward_only(self.M)

    def _run_forward_only(self, n: int) -> None:
        """The forward-only program of ``n`` microbatches, on the pass begun."""
        program = self._eval_programs.get(n)
        if program is None:
            program = self._compile(
                build_schedule(
                    self.job.schedule,
                    self.stage,
                    self.num_stages,
                    n,
                    forward_only=True,
                    virtual_stages=self.V,
                )
            )
            self._eval_programs[n] = program
        self._run(program)
