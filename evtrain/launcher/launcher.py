"""`Launcher`: one launch on this node, from the options to the exit status.

The phases and the exit statuses are the package's docstring
(`evtrain.launcher`); each collaborator's module says how its part works.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TextIO

import anyio
import structlog

from evtrain.bus.subscriber import Subscriber
from evtrain.events import (
    CommandAcked,
    EvalEnded,
    EvalProgress,
    EvalStarted,
    Heartbeat,
    HookStarted,
    Message,
    RunEnded,
    RunStarted,
    StageFailed,
    StepEnded,
    TensorRankStepEnded,
)
from evtrain.failures import RootCause
from evtrain.launcher.agent import AgentProcess, agent_config, agent_report_path, cleanup_message
from evtrain.launcher.bus import RunBus
from evtrain.launcher.ending import RunEnding
from evtrain.launcher.hang import Hang, HangResponse
from evtrain.launcher.hook_supervisor import HookSupervisor
from evtrain.launcher.hooks import finish_hooks, start_hooks, wait_attached
from evtrain.launcher.options import (
    EXIT_FAILED,
    EXIT_OK,
    LAUNCHER_SOURCE,
    LaunchOptions,
    is_bus_owner,
    new_run_id,
)
from evtrain.launcher.plan import LaunchPlan, make_plan, purpose_of
from evtrain.launcher.progress import RunConsole
from evtrain.launcher.report import Report, closing_event, record_status
from evtrain.launcher.run_dir import take_over
from evtrain.launcher.run_record import LAUNCHES_DIR
from evtrain.launcher.stop import StopDriver, StopMachine, StopRequests
from evtrain.launcher.stragglers import StragglerNotices
from evtrain.launcher.watch import BusWatch, FailureResponse, FailureWatch
from evtrain.stages.worker import remove_flight_recorder_pipes

__all__ = ["Launcher"]

log = structlog.get_logger(__name__)

_TOPICS = (
    RunStarted.topic.decode(),
    RunEnded.topic.decode(),
    StepEnded.topic.decode(),
    TensorRankStepEnded.topic.decode(),
    EvalStarted.topic.decode(),
    EvalProgress.topic.decode(),
    EvalEnded.topic.decode(),
    StageFailed.topic.decode(),
    HookStarted.topic.decode(),
    CommandAcked.topic.decode(),
    Heartbeat.topic.decode(),
)
_POLL_S = 0.1


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class Launcher:
    """Runs one job on this node (`evtrain.launcher`); use `run` (once).

    Its collaborators, in the order the launch needs them:

    * `evtrain.launcher.plan.LaunchPlan` (`prepare`): the job, its split, what the
      stages load, and its `evtrain.launcher.plan.Purpose`: training or evaluation,
      decided once from the options;
    * `evtrain.launcher.bus.RunBus`: the bus's address and CURVE keys, the broker
      this launch hosts, the launcher's own publishers;
    * `evtrain.launcher.agent.AgentProcess`: the elastic agent that runs the stage
      workers, started first and told `evtrain.launcher.agent.agent_config`;
    * `evtrain.launcher.run_dir.take_over`: the run directory;
    * `evtrain.launcher.hook_supervisor.HookSupervisor` (`evtrain.launcher.hooks`): the hooks;
    * `evtrain.launcher.stop.StopMachine`: the phases of a stop, fed by signals and
      `request_stop`, carried out by `evtrain.launcher.stop.StopDriver`;
    * `evtrain.launcher.watch.FailureWatch` and `evtrain.launcher.watch.BusWatch`: the
      stages' and the agent's reports, root causes, a lost bus; and
      `evtrain.launcher.watch.FailureResponse`: what a failure makes the launcher do;
    * `evtrain.launcher.hang.HangResponse`: a run that makes no progress, where it is
      stuck, and its end;
    * `evtrain.launcher.stragglers.StragglerNotices`: stages, replicas and tensor ranks slower than
      their peers;
    * `evtrain.launcher.ending.RunEnding`: the `RunEnded` the launcher publishes itself
      when the stages cannot;
    * `evtrain.launcher.report.Report`: header, summary, an evaluation's result, the
      failure, ``run.json``; on `evtrain.launcher.progress.RunConsole`, the terminal.
    """

    def __init__(
        self, options: LaunchOptions, *, out: TextIO | None = None, err: TextIO | None = None
    ) -> None:
        self.options = options
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.run_id = options.run_id or new_run_id()
        self.purpose = purpose_of(options)
        self.console = RunConsole(
            self.out, self.err, quiet=options.quiet, eval_lines=self.purpose.shows_eval_lines
        )
        self.progress = self.console.progress
        self.plan: LaunchPlan | None = None
        self.bus: RunBus | None = None
        self.run_dir: Path | None = None
        self.report: Report | None = None
        self.stop = StopMachine(options.grace_s)
        self._requests = StopRequests(_POLL_S)
        self._stopping = StopDriver(
            self.stop,
            send=lambda command: self.bus is not None and self.bus.send_command(command),
            agent=lambda: self._agent,
            workers_started=lambda: self._config_sent,
            bus_down=self._bus_down,
        )
        self._agent: AgentProcess | None = None
        self._supervisor: HookSupervisor | None = None
        self._failures: FailureWatch | None = None
        self._bus_watch: BusWatch | None = None
        self._failure_response: FailureResponse | None = None
        self._hangs: HangResponse | None = None
        self._stragglers: StragglerNotices | None = None
        self._end = RunEnding(self._bus_down)
        self._config_sent = False
        self._ended: RunEnded | None = None
        """The stages' own ``RunEnded``, from the bus."""
        self._ended_event: anyio.Event | None = None
        self._root: RootCause | None = None
        self._started = time.monotonic()
        self._started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime())

    # -- what callers read ----------------------------------------------------------

    @property
    def is_bus_owner(self) -> bool:
        """Whether this node binds the bus and runs the hooks (node 0)."""
        return is_bus_owner(self.options)

    @property
    def report_dir(self) -> Path:
        """Where this launch's stage and agent reports (and ``failure.txt``) go."""
        assert self.run_dir is not None
        return self.run_dir / LAUNCHES_DIR / self.run_id

    @property
    def job(self) -> Any:
        return self.plan.job if self.plan is not None else None

    @property
    def resume_path(self) -> Path | None:
        """The committed checkpoint ``--resume`` resolved to (before anything started)."""
        return self.plan.resume_path if self.plan is not None else None

    @property
    def warnings(self) -> list[str]:
        """Problems found while preparing that do not stop the launch."""
        return self.plan.warnings if self.plan is not None else []

    @property
    def evaluation(self) -> dict[str, Any] | None:
        """An evaluation's result, as written to its JSON file."""
        return self.report.result if self.report is not None else None

    # -- the launch -------------------------------------------------------------------

    def prepare(self) -> None:
        """Load and validate everything; raise `UsageError` before anything starts."""
        self.plan = make_plan(self.options, self.purpose)
        self.bus = RunBus(self.options, self.run_id)

    def run(self) -> int:
        """Launch the job and follow it to the end; returns the exit status."""
        # Until the event loop takes over the signals, SIGTERM unwinds through
        # the cleanup below instead of killing this process on the spot.
        previous = (
            signal.signal(signal.SIGTERM, _exit_on_signal) if self.options.handle_signals else None
        )
        # The agent process starts first, idle until it is told what to run:
        # its torch import (and the fork server's) overlaps ours and the spec
        # loading. If validation fails it is killed before it did anything.
        self._agent = agent = AgentProcess.start(self.options, self.console)
        try:
            self.prepare()
            plan, bus = self.plan, self.bus
            assert plan is not None and bus is not None
            if not bus.hosts_broker:
                # Before anything is created or started. Node r > 0 waits for node 0's
                # broker, which node 0 binds only after it has taken over the run
                # directory: on a shared file system ours would be in it before.
                bus.wait_for_broker()
            run_dir = self.run_dir = self.purpose.own_dir(plan, self.run_id).expanduser().resolve()
            done = self.purpose.done_already(plan, run_dir)
            if done is not None:
                self.console.say(done)
                return EXIT_OK
            run_dir.mkdir(parents=True, exist_ok=True)
            previous_run = None
            if self.is_bus_owner:
                previous_run = take_over(
                    run_dir, self.options, plan, self.run_id, warn=self.console.warn
                )
            self.report_dir.mkdir(parents=True, exist_ok=True)
            if plan.job_source is not None:
                # The workers load a spec by path: this one rebuilds the given Job.
                self.options.spec = str(plan.job_source.write_spec(self.report_dir / "job"))
            if bus.hosts_broker:
                bus.choose_address()
            # Before anything it would have to undo exists: should we die from
            # here on, the agent removes our ipc directory and marks the record.
            agent.send(cleanup_message(run_dir, is_bus_owner=bus.is_owner, owned_dir=bus.owned_dir))
            if bus.hosts_broker:
                bus.host()
            self._start_watching(plan, bus, run_dir)
            assert self.report is not None
            self.report.previous_run = previous_run
            self._write_record(status="running")
            self.report.header()
            status = anyio.run(self._main)
            assert self._failures is not None
            ended = self._failures.ended_status(self._ended)
            self._write_record(status=record_status(status, ended_status=ended), exit_status=status)
            return status
        finally:
            self._cleanup()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _start_watching(self, plan: LaunchPlan, bus: RunBus, run_dir: Path) -> None:
        """The watches and the report of a launch that starts its stages in ``run_dir``."""
        self._failures = FailureWatch(
            plan.job,
            self.progress,
            report_dir=self.report_dir,
            agent_report=agent_report_path(self.report_dir, self.options),
            restarts=self.options.max_restarts,
        )
        self._bus_watch = BusWatch(bus, self.console.warn, since=self._started)
        self._failure_response = FailureResponse(
            self._failures,
            self._end,
            self.stop,
            warn=self.console.warn,
            kill_workers=self._kill_agent,
            bus_owner=self.is_bus_owner,
        )
        if self.is_bus_owner:
            # Node 0 decides for the run: another node sees its own stages only.
            self._hangs = HangResponse(
                self.options.hang_timeout,
                self._failures,
                self._end,
                self.stop,
                error=self.console.error,
                kill_workers=self._kill_agent,
                report_dir=self.report_dir,
                run_id=self.run_id,
                replicas=plan.job.data_parallel,
            )
            self._stragglers = StragglerNotices(self._end.send, self.console.warn)
        self.report = Report(
            self.options,
            plan,
            self.console,
            self.err,
            run_id=self.run_id,
            run_dir=run_dir,
            report_dir=self.report_dir,
            bus=bus,
            failures=self._failures,
            bus_watch=self._bus_watch,
            started=self._started,
            started_at=self._started_at,
        )

    def _bus_down(self) -> bool:
        return self._bus_watch is not None and self._bus_watch.down

    async def _main(self) -> int:
        assert self.bus is not None and self._bus_watch is not None
        self._ended_event = anyio.Event()
        subscriber: Subscriber = self.bus.subscribe(_TOPICS)
        self._end.publisher = self.bus.open_publisher()
        handle_signals = self.options.handle_signals
        signals: AbstractContextManager[AsyncIterator[int]] = (
            anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM)
            if handle_signals
            else nullcontext(aiter(self._requests))
        )
        with subscriber, signals as received:
            # Before any hook starts, so that no hook's HookStarted is missed.
            await self.bus.prove_subscription(subscriber, self._on_event)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._stopping.watch, received)
                if handle_signals:
                    tg.start_soon(self._stopping.watch, aiter(self._requests))
                tg.start_soon(self._read_bus, subscriber)
                tg.start_soon(self._watch_bus)
                try:
                    status = await self._drive()
                finally:
                    tg.cancel_scope.cancel()
        return status

    # -- stopping -----------------------------------------------------------------------

    def request_stop(self, signum: int = signal.SIGINT) -> None:
        """Act as if ``signum`` had arrived (callable from any thread; `evtrain.launcher.stop`).

        What a caller that keeps the signals to itself (``handle_signals`` off:
        `evtrain.tools.api` in a thread) uses to pass on a Ctrl-C.
        """
        self._requests.put(signum)

    def _kill_agent(self) -> None:
        if self._agent is not None:
            self._agent.kill()

    # -- following the run ---------------------------------------------------------------

    async def _read_bus(self, subscriber: Subscriber) -> None:
        while True:
            for msg in await subscriber.receive(timeout=0.5):
                self._on_event(msg)

    async def _watch_bus(self) -> None:
        assert self._bus_watch is not None and self._agent is not None
        agent, failures = self._agent, self._failures
        assert failures is not None
        await self._bus_watch.run(
            stages_running=lambda: (
                self._config_sent
                and self._ended is None
                and self._end.published is None
                and failures.any_running()
            ),
            steps_known=failures.steps_known,
            steps_seen=lambda: self.progress.stats.steps_done,
            agent_running=lambda: agent.poll() is None,
        )

    def _on_event(self, msg: Message) -> None:
        assert self._bus_watch is not None
        self._bus_watch.heard()
        if msg.run_id and msg.run_id != self.run_id:
            return  # another run sharing this bus
        self.console.update(msg)
        if isinstance(msg, HookStarted):
            if self._supervisor is not None:
                self._supervisor.attached(msg.pid)
        elif isinstance(msg, RunStarted):
            log.debug("run started", after_s=round(time.monotonic() - self._started, 2))
            if self._stragglers is not None:
                self._stragglers.run_started(msg)
        elif isinstance(msg, StepEnded | TensorRankStepEnded) and self._stragglers is not None:
            self._stragglers.step_ended(msg)
        elif isinstance(msg, CommandAcked):
            self._stopping.acknowledged(msg)
        elif isinstance(msg, RunEnded) and msg.source != LAUNCHER_SOURCE:
            self._ended = msg
            if self._supervisor is not None:
                self._supervisor.mark_run_ended()
            if self._ended_event is not None:
                self._ended_event.set()

    async def _drive(self) -> int:
        opts, plan, bus, agent = self.options, self.plan, self.bus, self._agent
        assert plan is not None and bus is not None and bus.address is not None
        assert agent is not None and self._bus_watch is not None and self.run_dir is not None
        failures, response = self._failures, self._failure_response
        assert failures is not None and response is not None
        supervisor = self._supervisor = start_hooks(opts, plan, bus.address, self.console)
        self._end.supervisor = supervisor
        stopping = lambda: self.stop.signal is not None  # noqa: E731
        problem = await wait_attached(supervisor, opts.hook_attach_timeout, stopping)
        if problem is not None or self.stop.signal is not None:
            if problem is not None:
                self.console.error(problem)
            agent.close_stdin()
            await agent.wait(timeout=10)
            supervisor.terminate()
            return 128 + self.stop.signal if self.stop.signal is not None else EXIT_FAILED
        log.debug("hooks attached", after_s=round(time.monotonic() - self._started, 2))
        # stdin stays open from here on: its end tells the agent we are gone.
        config = agent_config(
            opts,
            plan,
            run_id=self.run_id,
            run_dir=self.run_dir,
            report_dir=self.report_dir,
            bus=str(bus.address),
        )
        self._config_sent = agent.send(config)
        if not self._config_sent:
            self.console.error("the elastic agent process died at startup")
            supervisor.terminate()
            return EXIT_FAILED
        while (agent_status := agent.poll()) is None:
            supervisor.poll()
            failures.refresh()
            response.tick()
            if self._hangs is not None:  # node 0 decides for the run
                await self._hangs.tick()
            self.console.tick()
            self._stopping.tick(plan.job.stages)
            await anyio.sleep(_POLL_S)
        failures.refresh()
        await response.settle(_POLL_S)
        seen_on_bus = self.progress.stats.steps_done
        failures.settle_progress()
        self._root = failures.final_root_cause(ended_by_us=self.stop.workers_ended_by_us)
        if agent_status == 0 and self._ended is None and not self._bus_down():
            # The stages' RunEnded may still be on its way when the agent exits.
            assert self._ended_event is not None
            with anyio.move_on_after(1.0):
                await self._ended_event.wait()
            if self._ended is None:
                await self._bus_watch.check(seen_on_bus, agent_running=lambda: agent.poll() is None)
        self._kill_agent()  # anything left in the agent's process group
        if self._ended is None and self._end.published is None and self.is_bus_owner:
            # Tell hooks the run is over when the stages could not.
            signum, step = self.stop.signal, failures.steps_known()
            closing = closing_event(agent_status, stop_signal=signum, step=step)
            self._end.publish(failures.failed(self._root) if self._root is not None else closing)
        await finish_hooks(
            supervisor,
            bus_down=self._bus_down(),
            failed_at=self._end.published_at if self._end.failed else None,
            finish_timeout=opts.hook_finish_timeout,
        )
        if plan.checkpointing:
            self._bus_watch.commit_after_loss(self.run_dir, self.run_id)
        self.console.close()
        assert self.report is not None
        signum, ended = self.stop.signal, self._ended
        return self.report.conclude(
            agent_status, stop_signal=signum, ended=ended, root=self._root, hang=self._hang
        )

    # -- the end ------------------------------------------------------------------------

    @property
    def _hang(self) -> Hang | None:
        return self._hangs.hang if self._hangs is not None else None

    def _write_record(self, **extra: Any) -> None:
        assert self.report is not None
        self.report.write_record(root=self._root, hang=self._hang, **extra)

    def _cleanup(self) -> None:
        """Whatever happened: no process of ours left, broker stopped, ipc dir removed."""
        self._kill_agent()
        remove_flight_recorder_pipes(self.run_id)
        if self.bus is not None:
            self.bus.close_clients(bus_down=self._bus_down())
        if self._supervisor is not None:
            self._supervisor.kill()
        if self.bus is not None:
            self.bus.stop()
        self.console.close()
