"""The stage actor: one pipeline stage as an async process (anyio on asyncio).

`evtrain.stages.entry.worker_main` (the elastic entrypoint) runs `serve` in
every stage process. The actor's event loop publishes every event
(heartbeats included) and handles the signals; it hands each blocking unit
of work (process group setup, a training step, an evaluation pass) to one
worker thread, where stage 0 also reads the commands that arrived, for the
step boundary's control exchange (`evtrain.stages.control`). So the loop
stays responsive: heartbeats keep coming during a long step, and publishing
never waits on the step nor the step on the bus. One thread hop per step
costs far less than gloo waits inside the loop would (gloo work
cannot be awaited: a wait would block the whole loop; figures:
docs/benchmarks.md, "Measurements behind design choices").

Step numbering: ``StepStarted.step``/``StepEnded.step`` are 1-based — step k
is the k-th optimizer step and reads the data of `DataStream` index k-1.
Every boundary event (``EpochEnded``, ``EvalStarted``/``EvalEnded``,
``CheckpointRequested``, ``RunEnded``) carries the number of steps completed
at that boundary, so ``EvalEnded(step=k)`` evaluates the weights after k steps
and a checkpoint at step k resumes with ``start_step=k``; ``CommandAcked.step``
is the boundary the command applies at. Boundary 0 is the start of the run:
commands pending then (a stop, an evaluation) apply before the first step.

Who publishes what:

* every stage: ``StageStarted``, ``StepStarted``/``StepEnded`` (``loss`` only
  on the last stage), microbatch spans, ``Heartbeat`` (about once a second,
  also during setup and evaluation), ``CommandAcked`` for every command,
  ``StageStopped`` on a clean exit, ``StageFailed`` (with the traceback) when
  it raises — then it re-raises so the process exits non-zero;
* stage 0: ``RunStarted`` once all stages joined, ``EpochEnded``,
  ``CheckpointRequested`` for every save the stages begin, and ``RunEnded``
  (``completed``/``stopped``) — stage 0 is the one stage every run has, and
  it is the last to finish a step (it runs the final backward). A failed run
  is ended by the launcher, which knows which stage failed first and why
  (`evtrain.failures`); only a worker without a launcher (no
  ``WorkerConfig.report_dir``) publishes ``RunEnded(status="failed")`` from a
  failing stage 0, when elastic has no restart left;
* the last stage: ``EvalStarted``/``EvalEnded`` (it holds the metrics), and
  ``EvalProgress`` with its heartbeats while it evaluates.

With data parallelism (`evtrain.stages.mesh`) each of these is replica 0's
(stage 0 is global rank 0). The other replicas publish only their own
``StageStarted``, steps, spans, heartbeats, ``StageStopped`` and
``StageFailed``, all with ``replica`` set: they acknowledge no command,
write no shard (their weights equal replica 0's) and evaluate nothing.

Evaluation: at an evaluation boundary every stage runs the job's eval sets
in order (`evtrain.job.Job.eval_sets`), one forward-only pass each. One
``EvalEnded`` carries the metrics of all of them, prefixed ``SET/`` for
named sets; values reported with `evtrain.report` during a set's pass get
its prefix too. ``EvalProgress`` counts batches over all the sets.

Microbatch spans (``Job.microbatch_spans``): ``"all"`` every step;
``"sampled"`` steps 1-5 and every 50th step; ``"off"`` never. Waits that are
not about one microbatch (the send drain and the control exchange at the
step end) carry ``microbatch=-1``.

``comm_wait_s`` is host time blocked in ``wait()`` (receives, the send
drain, the control exchange). On CUDA an NCCL wait only orders streams, so
there it measures little of the real communication time.

``peak_memory_bytes``: on CUDA ``torch.cuda.max_memory_allocated`` during the
step; on CPU the process's peak resident set size so far
(``getrusage(RUSAGE_SELF).ru_maxrss``, KiB on Linux, times 1024) — a lifetime
peak, not per step.

Environment knobs: ``EVTRAIN_LOG_FORMAT`` (``console``/``json``) and
``EVTRAIN_LOG_LEVEL`` (default ``info``) configure the worker's structlog
output; ``EVTRAIN_PIN_CPU=1`` pins each stage process to one core (by local
rank, within the process's allowed CPUs). Pinning is opt-in: on a quiet
2-core machine it made no measurable difference, under CPU contention it
helps (processes stop migrating onto each other's core after every wake-up;
figures: docs/benchmarks.md, "Measurements behind design choices"), but two
jobs pinning the same cores would collide.

Signals: SIGTERM or SIGINT asks for a clean stop. The request travels in the
next control exchange, so every stage finishes the same step and the run
ends with ``RunEnded(status="stopped", reason="signal")`` and exit status 0.
A second signal more than one second after the first ends the process at
once (Ctrl-C pressed again; a single Ctrl-C reaches a worker twice, from
the terminal and forwarded by the elastic agent, within milliseconds).

Commands (the rules: `evtrain.bus.commands`): at every boundary each stage
admits the new commands through its `CommandLedger`, accepts each for a
boundary in its `evtrain.stages.orders.Orders` and acknowledges it, then
applies what is due there through one table from command type to handler
(``COMMAND_HANDLERS``), in this order: evaluation (commanded, standing or
the job's ``eval_every``), then at most one checkpoint per directory, then
the stop. One more *final boundary* after the last step applies what
arrived meanwhile.

Checkpoints (the protocol: `evtrain.checkpoint`; what a stage saves when:
`evtrain.stages.checkpointing`): a stage saves after that boundary's
optimizer step, scheduler step and evaluation, so the shard holds the
weights just evaluated. With ``WorkerConfig.await_plan`` (the launcher
starts a checkpoint hook) stage 0 holds boundary 0 until the coordinator's
plan arrived. Finished writes are published at every boundary and with the
heartbeats. When the run ends without failure, the plan's on-stop
checkpoint is saved, every shard is waited for and reported, the stages
meet at the final barrier,
and stage 0 waits for the coordinator's verdict on every checkpoint of the
run (``EVTRAIN_COORDINATOR_TIMEOUT_S``, default 30) before it publishes
``RunEnded``.

Resume: ``WorkerConfig.resume`` (a checkpoint, a run directory, or
``"latest"`` = the job's run directory) is resolved by rank 0 and agreed on
by all (`agree_on_resume`); each stage then loads its layers, optimizer,
scheduler and RNG (`load_stage_shard`) and continues with the step after the
saved one (``RunStarted.start_step``). After an elastic restart
(``TORCHELASTIC_RESTART_COUNT`` > 0) the stages resume from the run
directory's latest committed checkpoint when there is one (else as the first
attempt did). ``WorkerConfig.load_weights`` loads weights only and starts at
step 0.

Evaluation only (``WorkerConfig.evaluate_only``, ``evtrain eval``): the
stages load the checkpoint as a resume does, evaluate once at its step's
boundary (``EvalEnded(step=K)``) and end; they train no step, apply no
command and own no shard writer, so such a run saves nothing. The last
stage's report carries the metrics exactly as computed.

Heartbeats, the stage's report file and its failure report:
`evtrain.stages.liveness`.
"""

from __future__ import annotations

import atexit
import math
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.to_thread
import structlog
import torch

from evtrain.bus.address import BusAddress
from evtrain.bus.commands import CommandLedger, CommandReceiver
from evtrain.bus.publisher import Publisher, flush_process
from evtrain.bus.security import curve_from_env
from evtrain.bus.subscriber import Subscriber
from evtrain.errors import SpecError
from evtrain.events import (
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointNow,
    CheckpointPlan,
    Command,
    EpochEnded,
    EvaluateNow,
    Event,
    Heartbeat,
    MicrobatchBackward,
    MicrobatchForward,
    MicrobatchWait,
    RunEnded,
    RunStarted,
    StageStarted,
    StageStopped,
    StepEnded,
    StepStarted,
    StopRun,
    TensorRankStepEnded,
)
from evtrain.job import Job
from evtrain.logs import configure_logging
from evtrain.overrides import apply_overrides
from evtrain.reporting import Reporter, reporting
from evtrain.run_state import stage_source
from evtrain.spec import load_job
from evtrain.stages.checkpointing import await_plan, await_the_end
from evtrain.stages.control import ControlResult
from evtrain.stages.executor import Span, StepStats
from evtrain.stages.liveness import StageLiveness
from evtrain.stages.mesh import Place
from evtrain.stages.partition import (
    stage_units,
)
from evtrain.stages.setup import (
    StageRuntime,
    build_stage,
    finish_stage,
    prepare_stage,
)
from evtrain.stages.worker import (
    WorkerConfig,
)

__all__ = ["RankInfo", "StageActor", "run_worker", "serve", "spans_enabled"]

log = structlog.get_logger("evtrain.stages.actor")

_FORCE_EXIT_AFTER_S = 1.0


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job, as torchrun / elastic set it in the environment."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls) -> RankInfo:
        """Read ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (defaults: a single process)."""
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        )


BUS_CONNECT_S = 60.0
"""How long a stage waits for the broker to answer. Whoever started the stage made sure
the broker runs (the launcher answers for it before any stage starts): a slow answer
is a loaded machine, which the publisher's 10 s default failed runs on."""


def spans_enabled(mode: str, step: int) -> bool:
    """Whether step ``step`` (1-based) publishes microbatch spans under ``mode``."""
    if mode == "all":
        return True
    if mode == "sampled":
        return step <= 5 or step % 50 == 0
    return False


def run_worker(config: WorkerConfig) -> None:
    """Run one stage to the end (see the module docstring); raises if the stage failed."""
    configure_logging(
        os.environ.get("EVTRAIN_LOG_FORMAT", "console"),  # type: ignore[arg-type]
        os.environ.get("EVTRAIN_LOG_LEVEL", "info"),
    )
    actor = StageActor(config, RankInfo.from_env())
    anyio.run(actor.run, backend="asyncio")


def serve(config: WorkerConfig) -> None:
    """Run one stage as a worker that elastic started (`evtrain.stages.entry.worker_main`).

    Tearing down an interpreter that imported torch (and, through the
    optimizers, torch._dynamo) takes 1-3 s on a small machine: a worker that
    elastic started (``TORCHELASTIC_RUN_ID`` set) and that ended cleanly ends
    its process with ``os._exit(0)`` at interpreter exit instead, after
    elastic collected its return value and every bus message was flushed.
    A failed stage's process ends through multiprocessing's ``os._exit``,
    which would cut its last events (``StageFailed``) off: they are flushed
    before the failure propagates.
    """
    try:
        run_worker(config)
    except BaseException:
        flush_process()
        raise
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        atexit.register(_fast_exit)


def _fast_exit() -> None:
    # atexit runs handlers last-in first-out: this one runs first, once
    # elastic's wrapper has handed over the return value and returned.
    flush_process()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class StageActor:
    """One pipeline stage: setup, the step loop, boundaries, events (module docstring).

    Its collaborators:

    * `evtrain.stages.setup` builds the stage (`build_stage`, `prepare_stage`) into a
      `StageRuntime`: the `StageExecutor` that runs each step and pass, the
      `StageEvaluator`, `StageCheckpointing` and the `Orders` of commands;
    * `evtrain.stages.liveness.StageLiveness`: heartbeats, the report file, the failure;
    * `evtrain.bus`: the publisher, and on rank 0 the command receiver and the
      subscriber of the checkpoint hook's verdicts.
    """

    def __init__(self, config: WorkerConfig, ranks: RankInfo) -> None:
        self.config = config
        self.ranks = ranks
        self.place = Place.of_rank(ranks.rank, ranks.world_size, 1)
        """Known once the job is loaded (`_load_job`): it says how many replicas there are."""
        self.stage = ranks.rank
        self.num_stages = ranks.world_size
        self.replica = 0
        self.publisher: Publisher | None = None
        self.live = StageLiveness(config, ranks.rank, self.publish)
        self.reporter = Reporter()
        self.job: Job | None = None
        self.runtime: StageRuntime | None = None
        """Everything set up before the first step (`evtrain.stages.setup`)."""
        self.device = torch.device("cpu")
        self._receiver: CommandReceiver | None = None
        self._verdicts: Subscriber | None = None
        self.ledger = CommandLedger(self.stage, None)
        self._stop_requested = False
        self._first_signal: float | None = None
        # Span times are perf_counter readings; this turns them into wall clock.
        self._clock_offset = time.time() - time.perf_counter()

    # ------------------------------------------------------------------ events

    @property
    def _rt(self) -> StageRuntime:
        if self.runtime is None:
            raise RuntimeError(f"stage {self.stage} is not set up yet")
        return self.runtime

    def publish(self, event: Event) -> None:
        """Publish without blocking (drops are counted by the publisher); no-op without bus.

        Tensor ranks above 0 repeat rank 0's computations, and so its events: they
        publish only their own step times (`TensorRankStepEnded`), and tell the
        launcher of themselves through their reports."""
        if self.publisher is not None and self.place.tp == 0:
            self.publisher.publish(event)

    def _wall(self, perf: float) -> float:
        return self._clock_offset + perf

    # --------------------------------------------------------------- lifecycle

    async def run(self) -> None:
        """Set up, train, publish; re-raise a failure after reporting and publishing it."""
        self.live.write_report()
        try:
            # The job says which stage and replica this rank is, which the
            # events name from the first one on.
            await anyio.to_thread.run_sync(self._load_job)
        except BaseException as exc:
            self.live.failed(exc, first_rank=self.place.rank == 0)
            raise
        if self.config.bus is not None:
            address = BusAddress.parse(self.config.bus)
            # A CURVE bus: the launcher names its key directory in the environment.
            curve = curve_from_env()
            self.publisher = Publisher(
                address.endpoint("events_in"),
                source=stage_source(self.stage, self.replica, self.place.tp),
                run_id=self.config.run_id,
                curve=curve,
                connect_timeout=BUS_CONNECT_S,
            )
            # Replica 0's tensor rank 0 answers for its stage: one acknowledgement per stage.
            answers = self.replica == 0 and self.place.tp == 0
            self.ledger = CommandLedger(self.stage, self.publisher if answers else None)
            if self.place.rank == 0:
                self._receiver = CommandReceiver(address.endpoint("commands_out"), curve=curve)
                self._verdicts = Subscriber(
                    address.endpoint("events_out"),
                    [
                        CheckpointCommitted.topic.decode(),
                        CheckpointFailed.topic.decode(),
                        StageStopped.topic.decode(),
                        # Its own heartbeats coming back say the bus still carries.
                        Heartbeat.topic.decode(),
                    ],
                    curve=curve,
                )
        failure: BaseException | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.live.heartbeats)
                tg.start_soon(self._signals)
                try:
                    await self._main()
                except BaseException as exc:
                    failure = exc
                tg.cancel_scope.cancel()
        finally:
            if failure is not None:
                if self.runtime is not None:
                    self.runtime.checkpointing.finish_failing()
                self.live.failed(failure, first_rank=self.place.rank == 0)
            if self._receiver is not None:
                self._receiver.close()
            if self._verdicts is not None:
                self._verdicts.close()
            if self.publisher is not None:
                self.publisher.close()
        if failure is not None:
            raise failure

    async def _signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                now = time.monotonic()
                if self._first_signal is None:
                    self._first_signal = now
                    self._stop_requested = True
                    if self.runtime is not None:
                        self.runtime.executor.stop_requested = True
                    log.info("signal: stopping after this step", stage=self.stage, signal=signum)
                elif now - self._first_signal > _FORCE_EXIT_AFTER_S:
                    log.warning("second signal: exiting now", stage=self.stage, signal=signum)
                    if self.publisher is not None:
                        self.publisher.close(linger=0.2)
                    os._exit(128 + signum)

    async def _main(self) -> None:
        job = self.job
        assert job is not None  # run() loaded it
        parts = await anyio.to_thread.run_sync(
            build_stage, job, self.place, self.ranks.local_rank, self._receiver
        )
        self.device, module = parts.device, parts.module
        self.publish(
            StageStarted(
                stage=self.stage,
                replica=self.replica,
                num_stages=self.num_stages,
                rank=self.ranks.rank,
                host=socket.gethostname(),
                pid=os.getpid(),
                device=str(self.device),
                layers=list(stage_units(module)),
                num_params=sum(p.numel() for p in module.parameters()),
            )
        )
        rt = await anyio.to_thread.run_sync(
            prepare_stage, job, parts, self.config, self.publish, self.reporter
        )
        self.runtime = self.live.runtime = rt
        self.live.completed = start_step = rt.start_step
        total, control = rt.total_steps, parts.control
        rt.executor.stop_requested = self._stop_requested

        # Boundary 0: every stage joined; commands sent before the run apply now,
        # and a coordinator's checkpoint plan, which it sends on RunStarted, is
        # awaited so that it applies from the first step.
        if self.place.rank == 0:
            self.publish(
                RunStarted(
                    name=job.name,
                    num_stages=self.num_stages,
                    num_microbatches=job.num_microbatches,
                    schedule=job.schedule,
                    max_steps=start_step if self.config.evaluate_only else total,
                    batch_size=job.batch_size,
                    start_step=start_step,
                    data_parallel=job.data_parallel,
                    virtual_stages=job.virtual_stages,
                    tensor_parallel=job.tensor_parallel,
                    run_dir=str(job.run_dir),
                )
            )
            if self.config.await_plan and self._receiver is not None:
                with self.live.in_phase("AwaitPlan (the checkpoint hook's plan)"):
                    await await_plan(self._receiver)
        with self.live.in_phase("Boundary 0"):
            first = await anyio.to_thread.run_sync(control.exchange, 0.0, self._stop_requested)
        self.live.state = "running"
        log.debug("stage running", stage=self.stage, steps=total, device=str(self.device))
        if self.config.evaluate_only:
            # The checkpoint's own boundary, evaluated once. No command is
            # applied there, so nothing can make this run train or save.
            step, stop_reason = start_step, None
            with reporting(self.reporter):  # reported values count as in training's evals
                await self._evaluate(step)
        else:
            step, stop_reason = await self._train(start_step, total, first)
        status: Literal["completed", "stopped"] = "completed" if stop_reason is None else "stopped"
        self.live.state = "stopping"
        # The on-stop checkpoint, every shard still in flight and StageStopped
        # are this stage's last events; stage 0 announces the end only once it
        # got every stage's StageStopped back from the broker, so RunEnded
        # reaches every hook after all of them.
        checkpointing = rt.checkpointing
        with self.live.in_phase(f"SaveCheckpoint step {self.live.completed}"):
            if self.live.completed > start_step:
                await checkpointing.save_on_stop(self.live.completed, rt.orders.plan)
            await checkpointing.finish()
        self.publish(
            StageStopped(
                stage=self.stage,
                replica=self.replica,
                status=status,
                reason=stop_reason or "",
            )
        )
        await anyio.to_thread.run_sync(finish_stage, rt, self.config.dump_weights_dir)
        if self._verdicts is not None:
            everyone = {(s, r) for s in range(self.num_stages) for r in range(self.place.replicas)}
            with self.live.in_phase("AwaitVerdicts (the checkpoint hook's commits)"):
                await await_the_end(
                    self._verdicts, self.config.run_id, everyone, checkpointing.awaiting
                )
        self.live.write_report(status)
        if self.place.rank == 0:
            self.publish(
                RunEnded(status=status, reason=stop_reason or "", step=self.live.completed)
            )
        checkpointing.close()
        log.debug("stage finished", stage=self.stage, status=status, steps=self.live.completed)

    async def _train(self, step: int, total: int, first: ControlResult) -> tuple[int, str | None]:
        """Train from boundary ``step`` to ``total``; the last step and the stop reason."""
        rt = self._rt
        job, control = rt.job, rt.parts.control
        stop_reason = await self._boundary(step, first, scheduled_eval=False)
        with reporting(self.reporter):
            while stop_reason is None and step < total:
                step += 1
                stats = await self._train_step(step)
                stop_reason = await self._boundary(
                    step,
                    stats.control,
                    scheduled_eval=job.eval_every is not None and step % job.eval_every == 0,
                )
        # The final boundary: what arrived since the last one (a checkpoint
        # that a hook asked for on the last step's events) applies too.
        with self.live.in_phase(f"Boundary {step}"):
            final = await anyio.to_thread.run_sync(control.exchange, 0.0, self._stop_requested)
        await self._boundary(step, final, scheduled_eval=False, final=True)
        return step, stop_reason

    # ------------------------------------------------------------------- setup

    def _load_job(self) -> None:
        """Load the job and place this rank on the (pp, dp) mesh (blocking)."""
        config = self.config
        job = apply_overrides(load_job(config.spec_path), config.overrides)
        if config.device is not None:
            job = apply_overrides(job, {"device": config.device})
        if job.world_size != self.ranks.world_size:
            raise SpecError(
                "stages",
                f"the job has {job.stages} stages x {job.data_parallel} replicas x "
                f"{job.tensor_parallel} tensor ranks but {self.ranks.world_size} stage workers "
                "were started (one process per stage, replica and tensor rank)",
            )
        self.job = job
        self.place = Place.of_rank(
            self.ranks.rank, job.stages, job.data_parallel, job.tensor_parallel
        )
        self.stage, self.num_stages = self.place.stage, self.place.num_stages
        self.replica = self.place.replica
        self.ledger = CommandLedger(self.stage, None)
        self.live.placed(self.stage, self.replica, self.place.tp, self.place.tp_size)

    # ------------------------------------------------------------------- steps

    async def _train_step(self, step: int) -> StepStats:
        rt = self._rt
        job, executor = rt.job, rt.executor
        spans = spans_enabled(job.microbatch_spans, step)
        self.publish(StepStarted(step=step, stage=self.stage, replica=self.replica))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.live.in_step = True
        stats = await anyio.to_thread.run_sync(
            lambda: executor.train_step(step, record_spans=spans)
        )
        self.live.in_step = False
        self.live.completed = step
        if stats.loss is not None:
            self.live.last_loss = stats.loss
        metrics = self.reporter.collect()
        for span in stats.spans:
            self.publish(self._span_event(step, span))
        # What each process measures of itself: tensor ranks above 0 publish these alone.
        own: dict[str, Any] = {
            "step": step,
            "stage": self.stage,
            "replica": self.replica,
            "duration_s": stats.duration_s,
            "forward_s": stats.forward_s,
            "backward_s": stats.backward_s,
            "comm_wait_s": stats.comm_wait_s,
            "cpu_s": stats.cpu_s,
            "peak_memory_bytes": self._peak_memory(),
            "state_bytes": self._rt.executor.update.state_bytes(),
        }
        if self.place.tp:
            if self.publisher is not None:
                self.publisher.publish(TensorRankStepEnded(**own, tp=self.place.tp))
            return stats
        self.publish(
            StepEnded(
                **own,
                loss=stats.loss,
                lr=stats.lr,
                grad_norm=stats.grad_norm,
                samples=stats.samples,
                epoch=stats.epoch,
                metrics=metrics,
            )
        )
        return stats

    def _span_event(self, step: int, span: Span) -> Event:
        start, end = self._wall(span.start), self._wall(span.end)
        where: dict[str, Any] = {
            "step": step,
            "stage": self.stage,
            "replica": self.replica,
            "microbatch": span.microbatch,
            "start": start,
            "end": end,
            "chunk": span.chunk,
        }
        if span.kind == "wait":
            return MicrobatchWait(**where, op=span.op)
        if span.kind == "forward":
            return MicrobatchForward(**where)
        part: Literal["", "input", "weight"] = (
            "input" if span.op == "input" else "weight" if span.op == "weight" else ""
        )
        return MicrobatchBackward(**where, part=part)

    def _peak_memory(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    # -------------------------------------------------------------- boundaries

    async def _boundary(
        self, step: int, control: ControlResult, *, scheduled_eval: bool, final: bool = False
    ) -> str | None:
        """Apply what every stage agreed on at this boundary; return a stop reason or None."""
        rt = self._rt
        orders = rt.orders
        fresh = step > rt.start_step and not final
        if self.place.rank == 0 and fresh:
            for epoch in orders.epochs_ended(step):
                self.publish(EpochEnded(epoch=epoch, step=step))
        work = _Work(step=step, evaluate=scheduled_eval or (fresh and orders.evaluation_due(step)))
        accepted: list[Command] = []
        for command in control.commands:
            if not self.ledger.admit(command):
                continue  # a retry: the ledger answered it with the earlier acknowledgement
            refusal = self._refusal(command)
            if refusal is not None:
                self.ledger.ack(command, step=step, ok=False, detail=refusal)
                continue
            taken = orders.accept(command, step)
            self.ledger.ack(
                command, step=taken.step, ok=taken.ok, detail=taken.detail, late=taken.late
            )
            if taken.ok and taken.step == step:
                accepted.append(command)
        for command in orders.due(step, accepted):
            COMMAND_HANDLERS[type(command)](self, command, work)
        metric: float | None = None
        if work.evaluate:
            metrics = await self._evaluate(step)
            plan = orders.plan
            if plan is not None and plan.best_metric is not None:
                metric = await anyio.to_thread.run_sync(
                    self._share_metric, metrics.get(plan.best_metric, math.nan)
                )
        with self.live.in_phase(f"SaveCheckpoint step {step}"):
            await rt.checkpointing.save_due(
                step, work.checkpoints, orders.plan, metric, periodic=fresh
            )
        rt.checkpointing.publish_done()
        if work.stop_reason is None and control.signalled:
            return "signal"
        return work.stop_reason

    def _refusal(self, command: Command) -> str | None:
        """Why this stage cannot carry ``command`` out at all (None: it can)."""
        if type(command) not in COMMAND_HANDLERS:
            return f"unknown command {command.topic.decode()!r}"
        if isinstance(command, EvaluateNow) and (self.job is None or self.job.eval_data is None):
            return "the job has no eval_data"
        return None

    def _on_checkpoint(self, command: CheckpointNow, work: _Work) -> None:
        work.checkpoints.append(command)

    def _on_plan(self, command: CheckpointPlan, work: _Work) -> None:
        self._rt.orders.set_plan(command)

    def _on_evaluate(self, command: EvaluateNow, work: _Work) -> None:
        if self._rt.orders.add_evaluation(command, work.step):
            work.evaluate = True

    def _on_stop_run(self, command: StopRun, work: _Work) -> None:
        work.stop_reason = work.stop_reason or command.reason or "stop command"

    def _share_metric(self, value: float) -> float:
        """The last stage's ``value`` on every stage (blocking, collective)."""
        return self._rt.parts.control.share(value, src=self.place.rank_of(self.num_stages - 1, 0))

    async def _evaluate(self, step: int) -> dict[str, float]:
        """Evaluate the weights after ``step`` steps on every eval set; the metrics (all
        sets, prefixed for named ones) on the last stage, else {}."""
        previous, self.live.state = self.live.state, "evaluating"
        try:
            with self.live.in_phase(f"Evaluate step {step}"):
                result = await self._rt.evaluator.evaluate(step)
        finally:
            self.live.state = previous
        if result is None:
            return {}
        self.live.evaluated(step, result)
        return result.metrics


@dataclass
class _Work:
    """What one boundary owes, gathered from the commands due there."""

    step: int
    evaluate: bool = False
    checkpoints: list[CheckpointNow] = field(default_factory=list)
    stop_reason: str | None = None


COMMAND_HANDLERS: dict[type[Command], Callable[[StageActor, Any, _Work], None]] = {
    CheckpointNow: StageActor._on_checkpoint,
    CheckpointPlan: StageActor._on_plan,
    EvaluateNow: StageActor._on_evaluate,
    StopRun: StageActor._on_stop_run,
}
"""What each command does at the boundary it applies at (the stage's command table)."""
