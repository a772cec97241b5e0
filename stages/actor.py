"""The stage actor: one pipeline stage as an async process (anyio on asyncio).

`run_worker` is what `evtrain.stages.worker.worker_main` runs in every stage
process. The actor's event loop owns everything that talks to the bus —
events, heartbeats, signals — and hands each blocking unit of work (process
group setup, a training step, an evaluation pass) to one worker thread, so the
loop stays responsive: heartbeats keep coming during a long step, and
publishing never waits on the step nor the step on the bus. One thread hop
per step costs ~0.05-0.2 ms, far less than gloo waits inside the loop would
(gloo work cannot be awaited: a wait would block the whole loop).

Step numbering: ``StepStarted.step``/``StepEnded.step`` are 1-based — step k
is the k-th optimizer step and reads the data of `DataStream` index k-1.
Every boundary event (``CommandAcked``, ``EvalStarted``/``EvalEnded``,
``RunEnded``) carries the number of steps completed at that boundary, so
``EvalEnded(step=k)`` evaluates the weights after k steps and a checkpoint at
step k resumes with ``start_step=k``. Boundary 0 is the start of the run:
commands pending then (a stop, an evaluation) apply before the first step.

Who publishes what:

* every stage: ``StageStarted``, ``StepStarted``/``StepEnded`` (``loss`` only
  on the last stage), microbatch spans, ``Heartbeat`` (about once a second,
  also during setup and evaluation), ``CommandAcked`` for every command,
  ``StageStopped`` on a clean exit, ``StageFailed`` (with the traceback) when
  it raises — then it re-raises so the process exits non-zero;
* stage 0: ``RunStarted`` once all stages joined and ``RunEnded``
  (``completed``/``stopped``) — stage 0 is the one stage every run has, and
  it is the last to finish a step (it runs the final backward). A failed run
  is ended by the launcher, which knows which stage failed first and why
  (`evtrain.failures`); only a worker without a launcher (no
  ``WorkerConfig.report_dir``) publishes ``RunEnded(status="failed")`` from a
  failing stage 0, when elastic has no restart left;
* the last stage: ``EvalStarted``/``EvalEnded`` (it holds the metrics).

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
was worth up to ~40% (processes stop migrating onto each other's core after
every wake-up), but two jobs pinning the same cores would collide.

Signals: SIGTERM or SIGINT asks for a clean stop. The request travels in the
next control exchange, so every stage finishes the same step and the run
ends with ``RunEnded(status="stopped", reason="signal")`` and exit status 0.
A second signal more than one second after the first ends the process at
once (Ctrl-C pressed again; a single Ctrl-C reaches a worker twice, from
the terminal and forwarded by the elastic agent, within milliseconds).

Checkpoints (`evtrain.checkpoint.writer`): each stage owns a `ShardWriter`.
A ``CheckpointNow`` is applied at the boundary where it arrives, after that
step's optimizer and scheduler steps: an ``on_stop`` request is armed, any
other saves this stage's shard asynchronously and is acknowledged with
``CommandAcked.step`` = steps completed. Finished writes are published
(``CheckpointShardSaved``/``CheckpointFailed``) at every boundary and with
the heartbeats. When the run ends without failure the armed on-stop
checkpoint is saved, every shard is waited for and reported, and only then
do the stages meet at the final barrier and stage 0 publishes ``RunEnded``.
Before that, one *final boundary* after the last step applies the commands
that the last step's own events triggered (a checkpoint every N steps that
falls on the last step, a best-metric checkpoint of the final evaluation):
stage 0 waits ``EVTRAIN_FINAL_COMMAND_GRACE_S`` (default 0.5 s) for them.
When that boundary saved a checkpoint of the last step, the armed on-stop
one is skipped (it would share its directory; the hook drops it).

Resume: ``WorkerConfig.resume`` (a checkpoint, a run directory, or
``"latest"`` = the job's run directory) is resolved by rank 0 and agreed on
by all (`agree_on_resume`); each stage then loads its layers, optimizer,
scheduler and RNG (`load_stage_shard`) and continues with the step after the
saved one (``RunStarted.start_step``). After an elastic restart
(``TORCHELASTIC_RESTART_COUNT`` > 0) the stages resume from the run
directory's latest committed checkpoint when there is one (else as the first
attempt did). ``WorkerConfig.load_weights`` loads weights only and starts at
step 0.

Reports: with ``WorkerConfig.report_dir`` the stage keeps its
`evtrain.stages.worker.StageReport` there — at start, with every heartbeat,
at the end, and on failure (exception, innermost user frame, whether it is a
communication error) before `StageFailed` is published.
"""

from __future__ import annotations

import datetime
import os
import resource
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
import structlog
import torch
import torch.distributed as dist

from evtrain.bus.address import BusAddress
from evtrain.bus.commands import CommandReceiver
from evtrain.bus.publisher import Publisher
from evtrain.checkpoint import CheckpointError
from evtrain.checkpoint.loader import agree_on_resume, load_stage_shard, load_weights
from evtrain.checkpoint.writer import CompletedShard, ShardWriter, is_on_stop_request
from evtrain.data import derive_seed, eval_microbatches
from evtrain.errors import SpecError
from evtrain.events import (
    CheckpointFailed,
    CheckpointNow,
    Command,
    CommandAcked,
    EvalEnded,
    EvalStarted,
    EvaluateNow,
    Event,
    Heartbeat,
    MicrobatchBackward,
    MicrobatchForward,
    MicrobatchWait,
    RunEnded,
    RunStarted,
    StageFailed,
    StageStarted,
    StageStopped,
    StepEnded,
    StepStarted,
    StopRun,
)
from evtrain.failures import frame_location, is_communication_error, user_frames
from evtrain.job import Job
from evtrain.reporting import Reporter, reporting
from evtrain.spec import apply_overrides, load_job
from evtrain.stages.control import ControlResult, StepControl
from evtrain.stages.executor import Span, StageExecutor, StepStats
from evtrain.stages.p2p import Mailbox, TensorSpec, exchange_shapes, infer_output_spec
from evtrain.stages.partition import StageModule, build_stage_module, partition
from evtrain.stages.worker import ReportStatus, StageReport, WorkerConfig

__all__ = ["RankInfo", "StageActor", "run_worker", "spans_enabled"]

log = structlog.get_logger("evtrain.stages.actor")

HEARTBEAT_INTERVAL_S = 1.0
PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)
_FORCE_EXIT_AFTER_S = 1.0
FINAL_GRACE_ENV = "EVTRAIN_FINAL_COMMAND_GRACE_S"
"""Seconds stage 0 waits after the last step for commands its events trigger (default 0.5)."""


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


def spans_enabled(mode: str, step: int) -> bool:
    """Whether step ``step`` (1-based) publishes microbatch spans under ``mode``."""
    if mode == "all":
        return True
    if mode == "sampled":
        return step <= 5 or step % 50 == 0
    return False


def run_worker(config: WorkerConfig) -> None:
    """Run one stage to the end (see the module docstring); raises if the stage failed."""
    from evtrain.logs import configure_logging

    configure_logging(
        os.environ.get("EVTRAIN_LOG_FORMAT", "console"),  # type: ignore[arg-type]
        os.environ.get("EVTRAIN_LOG_LEVEL", "info"),
    )
    actor = StageActor(config, RankInfo.from_env())
    anyio.run(actor.run, backend="asyncio")


class StageActor:
    """One pipeline stage: setup, the step loop, boundaries, events (module docstring)."""

    def __init__(self, config: WorkerConfig, ranks: RankInfo) -> None:
        self.config = config
        self.ranks = ranks
        self.stage = ranks.rank
        self.num_stages = ranks.world_size
        self.completed = 0
        self.state = "starting"
        self.publisher: Publisher | None = None
        self.reporter = Reporter()
        self.job: Job | None = None
        self.executor: StageExecutor | None = None
        self.control: StepControl | None = None
        self.module: StageModule | None = None
        self.device = torch.device("cpu")
        self._receiver: CommandReceiver | None = None
        self._stop_requested = False
        self._first_signal: float | None = None
        self._in_step = False
        self.writer: ShardWriter | None = None
        self.start_step = 0
        self._saved_step: int | None = None
        self._last_loss: float | None = None
        self.report: StageReport | None = None
        if config.report_dir is not None:
            self.report = StageReport(
                stage=self.stage,
                pid=os.getpid(),
                attempt=_restart_count(),
                status="starting",
                updated=time.time(),
            )
        # Span times are perf_counter readings; this turns them into wall clock.
        self._clock_offset = time.time() - time.perf_counter()

    # ------------------------------------------------------------------ events

    def publish(self, event: Event) -> None:
        """Publish without blocking (drops are counted by the publisher); no-op without bus."""
        if self.publisher is not None:
            self.publisher.publish(event)

    def _wall(self, perf: float) -> float:
        return self._clock_offset + perf

    # --------------------------------------------------------------- lifecycle

    async def run(self) -> None:
        """Set up, train, publish; re-raise a failure after reporting and publishing it."""
        self._write_report()
        if self.config.bus is not None:
            address = BusAddress.parse(self.config.bus)
            self.publisher = Publisher(
                address.endpoint("events_in"),
                source=f"stage/{self.stage}",
                run_id=self.config.run_id,
            )
            if self.stage == 0:
                self._receiver = CommandReceiver(address.endpoint("commands_out"))
        failure: BaseException | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeats)
                tg.start_soon(self._signals)
                try:
                    await self._main()
                except BaseException as exc:
                    failure = exc
                tg.cancel_scope.cancel()
        finally:
            if failure is not None:
                self._report_failure(failure)
            if self._receiver is not None:
                self._receiver.close()
            if self.publisher is not None:
                self.publisher.close()
        if failure is not None:
            raise failure

    def _write_report(self, status: ReportStatus | None = None) -> None:
        """Bring this stage's `StageReport` up to date (the launcher's view without the bus)."""
        report, directory = self.report, self.config.report_dir
        if report is None or directory is None:
            return
        if status is not None:
            report.status = status
        elif report.status == "starting" and self.state == "running":
            report.status = "running"
        report.step = self.completed
        report.loss = self._last_loss
        try:
            report.write(directory)
        except OSError as exc:
            log.warning("cannot write the stage report", stage=self.stage, error=str(exc))

    def _report_failure(self, exc: BaseException) -> None:
        text = "".join(traceback.format_exception(exc))
        error = f"{type(exc).__name__}: {exc}"
        step = self.completed + 1 if self._in_step else None
        if self.report is not None:
            # The file comes first: the launcher decides the root cause from it,
            # whatever becomes of the bus.
            frames = user_frames(exc.__traceback__)
            self.report.error = error
            self.report.traceback = text
            self.report.user_frames = frames
            self.report.location = frame_location(frames[-1]) if frames else ""
            self.report.consequence = is_communication_error(error)
            self.report.failed_at = time.time()
            self.report.failed_step = step
            self._write_report("failed")
            # The launcher prints the root cause once; a line per stage here
            # would repeat it and its consequences.
            log.debug("stage failed", stage=self.stage, error=error)
        else:
            log.error("stage failed", stage=self.stage, error=error)
        self.publish(StageFailed(stage=self.stage, error=error, traceback=text, step=step))
        if self.report is None and self.stage == 0 and not _restart_pending():
            # Without a launcher nobody else ends the run for the hooks; a
            # launcher publishes RunEnded itself, naming the root cause.
            self.publish(RunEnded(status="failed", reason=error, step=self.completed))

    async def _heartbeats(self) -> None:
        while True:
            self.publish(Heartbeat(stage=self.stage, step=self.completed, state=self.state))
            self._write_report()
            self._publish_shards()
            await anyio.sleep(HEARTBEAT_INTERVAL_S)

    async def _signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                now = time.monotonic()
                if self._first_signal is None:
                    self._first_signal = now
                    self._stop_requested = True
                    if self.executor is not None:
                        self.executor.stop_requested = True
                    log.info("signal: stopping after this step", stage=self.stage, signal=signum)
                elif now - self._first_signal > _FORCE_EXIT_AFTER_S:
                    log.warning("second signal: exiting now", stage=self.stage, signal=signum)
                    if self.publisher is not None:
                        self.publisher.close(linger=0.2)
                    os._exit(128 + signum)

    async def _main(self) -> None:
        await anyio.to_thread.run_sync(self._setup)
        job, module = self.job, self.module
        assert job is not None and module is not None
        self.publish(
            StageStarted(
                stage=self.stage,
                num_stages=self.num_stages,
                rank=self.ranks.rank,
                host=socket.gethostname(),
                pid=os.getpid(),
                device=str(self.device),
                layers=list(module.layer_range),
                num_params=sum(p.numel() for p in module.parameters()),
            )
        )
        total = await anyio.to_thread.run_sync(self._prepare)
        executor, control = self.executor, self.control
        assert executor is not None and control is not None
        executor.stop_requested = self._stop_requested

        # Boundary 0: every stage joined; commands sent before the run apply now.
        start_step = self.start_step
        first = await anyio.to_thread.run_sync(control.exchange, 0.0, self._stop_requested)
        if self.stage == 0:
            self.publish(
                RunStarted(
                    name=job.name,
                    num_stages=self.num_stages,
                    num_microbatches=job.num_microbatches,
                    schedule=job.schedule,
                    max_steps=total,
                    batch_size=job.batch_size,
                    start_step=start_step,
                    run_dir=str(job.run_dir),
                )
            )
        self.state = "running"
        log.info("stage running", stage=self.stage, steps=total, device=str(self.device))
        step = start_step
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
        # The final boundary: commands triggered by the last step's events (a
        # periodic or best-metric checkpoint of the last step) arrive after
        # its control exchange; give them a moment and apply them too. Shards
        # still in flight are reported first: the hook issues its next request
        # only once the previous checkpoint is committed.
        if self.writer is not None:
            for done in await anyio.to_thread.run_sync(self.writer.wait):
                self.publish(done.to_event())
        final = await anyio.to_thread.run_sync(self._final_exchange)
        await self._boundary(step, final, scheduled_eval=False)
        status = "completed" if stop_reason is None else "stopped"
        self.state = "stopping"
        # The on-stop checkpoint and every shard still in flight are reported
        # before the final barrier, so RunEnded (after it) comes last.
        for done in await anyio.to_thread.run_sync(self._save_on_stop):
            self.publish(done.to_event())
        await anyio.to_thread.run_sync(self._finish)
        self._write_report(status)
        if self.stage == 0:
            self.publish(RunEnded(status=status, reason=stop_reason or "", step=self.completed))
        self.publish(StageStopped(stage=self.stage, status=status, reason=stop_reason or ""))
        if self.writer is not None:
            self.writer.close()
        log.info("stage finished", stage=self.stage, status=status, steps=self.completed)

    # ------------------------------------------------------------------- setup

    def _setup(self) -> None:
        """Load the job, join the process groups, build this stage's slice (blocking)."""
        config = self.config
        job = apply_overrides(load_job(config.spec_path), config.overrides)
        if config.device is not None:
            job = apply_overrides(job, {"device": config.device})
        if job.stages != self.num_stages:
            raise SpecError(
                "stages",
                f"the job has {job.stages} stages but {self.num_stages} stage workers were "
                "started (one process per stage)",
            )
        self.job = job
        if os.environ.get("EVTRAIN_PIN_CPU") == "1":  # opt-in, see the module docstring
            cpus = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cpus[self.ranks.local_rank % len(cpus)]})
        torch.set_num_threads(job.threads or 1)
        self.device = job.stage_device(self.ranks.local_rank)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
        backend = "nccl" if cuda else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(
                backend,
                rank=self.ranks.rank,
                world_size=self.num_stages,
                timeout=PROCESS_GROUP_TIMEOUT,
                device_id=self.device if cuda else None,
            )
        act_group = grad_group = control_group = None
        if self.num_stages > 1:
            act_group = dist.group.WORLD
            # Gradients get their own group (own connections / communicators).
            grad_group = dist.new_group(backend=backend, timeout=PROCESS_GROUP_TIMEOUT)
            # Control messages always go over gloo, even on CUDA.
            control_group = dist.new_group(backend="gloo", timeout=PROCESS_GROUP_TIMEOUT)
        layer_range = partition(job)[self.stage]
        # Per-stage RNG for randomness inside layers (dropout); layer init is
        # seeded per layer by build_stage_module, independent of the partition.
        torch.manual_seed(derive_seed(job.seed, "stage", self.stage))
        self.module = build_stage_module(job, layer_range, self.device)
        self.module.train()
        self._mailbox = Mailbox(
            stage=self.stage,
            num_stages=self.num_stages,
            device=self.device,
            act_group=act_group,
            grad_group=grad_group,
        )
        self.control = StepControl(
            rank=self.stage,
            world_size=self.num_stages,
            group=control_group,
            receiver=self._receiver,
        )

    def _prepare(self) -> int:
        """Load data, agree on boundary shapes, build the optimizer and executor (blocking)."""
        job, module = self.job, self.module
        assert job is not None and module is not None
        first, last = self.stage == 0, self.stage == self.num_stages - 1
        train = job.train_tensors()
        stream = job.train_stream()
        total = job.total_steps()
        evaluation = job.eval_tensors()
        eval_sizes: list[int] = []
        if evaluation is not None:
            plan = eval_microbatches(
                evaluation.num_samples, job.effective_eval_batch_size, job.num_microbatches
            )
            eval_sizes = [len(r) for batch in plan for r in batch]
        sizes = sorted({job.microbatch_size, *eval_sizes})

        input_specs = None
        if first:
            sample, dtype = tuple(train.inputs.shape[1:]), train.inputs.dtype
            input_specs = [TensorSpec((n, *sample), dtype) for n in sizes]
        in_specs, out_specs = exchange_shapes(
            stage=self.stage,
            num_stages=self.num_stages,
            input_specs=input_specs,
            output_spec_of=lambda spec: infer_output_spec(module, spec, self.device),
            group=self._mailbox.act_group,
            device=self.device if self.device.type == "cuda" else torch.device("cpu"),
        )
        specs = dict(zip(sizes, zip(in_specs, out_specs, strict=True), strict=True))

        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = job.optimizer(params) if params else None
        scheduler = (
            job.lr_scheduler(optimizer)
            if job.lr_scheduler is not None and optimizer is not None
            else None
        )
        self.executor = StageExecutor(
            job=job,
            stage=self.stage,
            num_stages=self.num_stages,
            device=self.device,
            module=module,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            mailbox=self._mailbox,
            control=self.control,  # type: ignore[arg-type]
            stream=stream,
            specs=specs,
            train_inputs=train.inputs if first else None,
            train_targets=train.targets if last else None,
            eval_inputs=evaluation.inputs if evaluation is not None and first else None,
            eval_targets=evaluation.targets if evaluation is not None and last else None,
            eval_num_samples=evaluation.num_samples if evaluation is not None else 0,
        )
        self.writer = ShardWriter(self.stage, self.num_stages, device=self.device)
        self._restore(optimizer, scheduler)
        return total

    def _restore(self, optimizer: torch.optim.Optimizer | None, scheduler: object) -> None:
        """Resume from a checkpoint or load weights, as the config says (blocking, collective)."""
        config, job, module = self.config, self.job, self.module
        assert job is not None and module is not None
        path = None
        if _restart_count() > 0:
            # An elastic restart: continue from the last committed checkpoint.
            try:
                path = agree_on_resume(job.run_dir)
            except CheckpointError as exc:
                log.warning("restart: no committed checkpoint to resume", error=str(exc))
        if path is None and config.resume is not None:
            resume = job.run_dir if config.resume == "latest" else config.resume
            path = agree_on_resume(resume)
        if path is not None:
            state = load_stage_shard(path, self.stage, module, optimizer, scheduler)
            self.start_step = self.completed = state.step
            log.info("resumed", stage=self.stage, path=str(path), step=state.step)
        elif config.load_weights is not None:
            load_weights(config.load_weights, module)
            log.info("weights loaded", stage=self.stage, path=config.load_weights)

    def _final_exchange(self) -> ControlResult:
        """One more control exchange after the last step (blocking, collective)."""
        assert self.control is not None
        if self._receiver is not None:
            time.sleep(_final_command_grace_s())
        return self.control.exchange(0.0, self._stop_requested)

    def _save_on_stop(self) -> list[CompletedShard]:
        """Save the armed on-stop checkpoint (if any) and wait for every write (blocking)."""
        writer, executor, module = self.writer, self.executor, self.module
        if writer is None or executor is None or module is None:
            return []
        if self._saved_step == self.completed:
            # A checkpoint of this very step is already saved (the final
            # boundary's): a second one would share its directory. The hook
            # drops the on-stop request when no shard of it appears.
            log.info("on-stop checkpoint skipped: this step is saved", step=self.completed)
            return writer.wait()
        try:
            writer.save_on_stop(
                step=self.completed,
                module=module,
                optimizer=executor.optimizer,
                scheduler=executor.lr_scheduler,
                data_position=executor.stream.batch_index(self.completed),
            )
        except CheckpointError as exc:
            log.error("on-stop checkpoint failed", stage=self.stage, error=str(exc))
        return writer.wait()

    def _finish(self) -> None:
        """Final barrier, optional weight dump, leave the process groups (blocking)."""
        assert self.control is not None and self.module is not None
        self.control.barrier()
        if self.config.dump_weights_dir:
            from safetensors.torch import save_file

            directory = Path(self.config.dump_weights_dir)
            directory.mkdir(parents=True, exist_ok=True)
            state = {k: v.detach().cpu().contiguous() for k, v in self.module.state_dict().items()}
            save_file(state, str(directory / f"stage-{self.stage}.safetensors"))
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------- steps

    async def _train_step(self, step: int) -> StepStats:
        job, executor = self.job, self.executor
        assert job is not None and executor is not None
        spans = spans_enabled(job.microbatch_spans, step)
        self.publish(StepStarted(step=step, stage=self.stage))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._in_step = True
        stats = await anyio.to_thread.run_sync(
            lambda: executor.train_step(step, record_spans=spans)
        )
        self._in_step = False
        self.completed = step
        if stats.loss is not None:
            self._last_loss = stats.loss
        metrics = self.reporter.collect()
        for span in stats.spans:
            self.publish(self._span_event(step, span))
        self.publish(
            StepEnded(
                step=step,
                stage=self.stage,
                loss=stats.loss,
                lr=stats.lr,
                grad_norm=stats.grad_norm,
                samples=stats.samples,
                epoch=stats.epoch,
                duration_s=stats.duration_s,
                forward_s=stats.forward_s,
                backward_s=stats.backward_s,
                comm_wait_s=stats.comm_wait_s,
                peak_memory_bytes=self._peak_memory(),
                metrics=metrics,
            )
        )
        return stats

    def _span_event(self, step: int, span: Span) -> Event:
        common = {
            "step": step,
            "stage": self.stage,
            "microbatch": span.microbatch,
            "start": self._wall(span.start),
            "end": self._wall(span.end),
        }
        if span.kind == "forward":
            return MicrobatchForward(**common)
        if span.kind == "backward":
            return MicrobatchBackward(**common)
        return MicrobatchWait(**common, op=span.op)

    def _peak_memory(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    # -------------------------------------------------------------- boundaries

    async def _boundary(
        self, step: int, control: ControlResult, *, scheduled_eval: bool
    ) -> str | None:
        """Apply what every stage agreed on at this boundary; return a stop reason or None."""
        want_eval = scheduled_eval
        eval_commands: list[Command] = []
        stop_commands: list[StopRun] = []
        for command in control.commands:
            if isinstance(command, EvaluateNow):
                want_eval = True
                eval_commands.append(command)
            elif isinstance(command, StopRun):
                stop_commands.append(command)
            elif isinstance(command, CheckpointNow):
                ok, detail = await anyio.to_thread.run_sync(self._checkpoint, command, step)
                self._ack(command, step, ok=ok, detail=detail)
                if not ok:
                    self.publish(
                        CheckpointFailed(
                            checkpoint_id=command.checkpoint_id,
                            step=step,
                            stage=self.stage,
                            error=detail,
                        )
                    )
            else:
                self._ack(command, step, ok=False, detail="unknown command")
        job = self.job
        assert job is not None
        has_eval_data = job.eval_data is not None
        if want_eval and has_eval_data:
            await self._evaluate(step)
        for command in eval_commands:
            if has_eval_data:
                self._ack(command, step)
            else:
                self._ack(command, step, ok=False, detail="the job has no eval_data")
        stop_reason: str | None = None
        for command in stop_commands:
            stop_reason = stop_reason or command.reason or "stop command"
            self._ack(command, step)
        if stop_reason is None and control.signalled:
            stop_reason = "signal"
        self._publish_shards()
        return stop_reason

    def _publish_shards(self) -> None:
        """Publish the shard writes that finished since the last call (never blocks)."""
        if self.writer is not None:
            for done in self.writer.poll():
                self.publish(done.to_event())

    def _ack(self, command: Command, step: int, *, ok: bool = True, detail: str = "") -> None:
        self.publish(
            CommandAcked(
                command_id=command.command_id,
                command=command.topic.decode(),
                stage=self.stage,
                step=step,
                ok=ok,
                detail=detail,
            )
        )

    def _checkpoint(self, command: CheckpointNow, step: int) -> tuple[bool, str]:
        """Save this stage's shard for ``command`` at boundary ``step`` (blocking, short).

        ``step`` optimizer and scheduler steps are done; the write itself
        continues in the writer's thread. A refused save (already committed,
        unusable path, unsupported state) is acknowledged with ``ok=False``
        and published as ``CheckpointFailed``.
        """
        writer, executor, module = self.writer, self.executor, self.module
        if writer is None or executor is None or module is None:
            return False, "the stage is not ready to checkpoint"
        if is_on_stop_request(command):
            writer.arm_on_stop(command)
            return True, "armed for the end of the run"
        try:
            writer.save(
                command.path,
                checkpoint_id=command.checkpoint_id,
                step=step,
                module=module,
                optimizer=executor.optimizer,
                scheduler=executor.lr_scheduler,
                data_position=executor.stream.batch_index(step),
                reason=command.reason,
            )
        except CheckpointError as exc:
            log.error("checkpoint refused", stage=self.stage, error=str(exc))
            return False, str(exc)
        self._saved_step = step
        return True, ""

    async def _evaluate(self, step: int) -> None:
        executor = self.executor
        assert executor is not None
        last = self.stage == self.num_stages - 1
        previous, self.state = self.state, "evaluating"
        if last:
            self.publish(
                EvalStarted(step=step, stage=self.stage, num_batches=_eval_batches(self.job))
            )
        self.reporter.collect()  # training-time leftovers do not belong to the eval
        stats = await anyio.to_thread.run_sync(executor.evaluate)
        reported = self.reporter.collect()
        self.state = previous
        if last:
            metrics = {**reported, **stats.metrics}
            self.publish(
                EvalEnded(
                    step=step,
                    stage=self.stage,
                    metrics=metrics,
                    samples=stats.samples,
                    duration_s=stats.duration_s,
                )
            )


def _eval_batches(job: Job | None) -> int:
    if job is None:
        return 0
    evaluation = job.eval_tensors()
    if evaluation is None:
        return 0
    return len(
        eval_microbatches(
            evaluation.num_samples, job.effective_eval_batch_size, job.num_microbatches
        )
    )


def _restart_count() -> int:
    """How many times elastic restarted this worker group (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _restart_pending() -> bool:
    """Whether elastic will restart the workers after this failure."""
    max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    return _restart_count() < max_restarts


def _final_command_grace_s() -> float:
    return float(os.environ.get(FINAL_GRACE_ENV, "0.5") or 0)
