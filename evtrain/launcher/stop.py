"""Stopping a run: signals, and the three phases of the stop (`StopMachine`).

The agent and every hook run in their own session, so a Ctrl-C at the
terminal reaches only the launcher, which orders the shutdown in phases:

1. the first SIGINT/SIGTERM publishes a `evtrain.events.StopRun` command,
   so every stage ends the run at the same step boundary and returns
   normally (``RunEnded(status="stopped")``, exit status 0); the command is
   published again until every stage acknowledged it
   (`evtrain.bus.commands.Delivery`);
2. if the workers have not ended after ``grace_s``, or on a second signal,
   the agent gets SIGTERM and elastic sends SIGTERM to each worker (which
   also stop at a step boundary if they can), then SIGKILL after
   `ELASTIC_SHUTDOWN_S`;
3. after `KILL_AFTER_S` more, or on a third signal, the agent's whole
   process group (the workers are in it) gets SIGKILL.

Why not begin with 2: after a worker returns, elastic's worker wrapper
waits for the agent to collect its result, which an agent that was
signalled never does, so every clean stop would last the whole shutdown
timeout and end with SIGKILL. With the bus lost, though, no command reaches
the stages: then 2 comes first. Before the workers exist there is nothing
to stop gently: then 3 comes first.

If the launcher itself is killed, the hooks receive SIGTERM
(``PR_SET_PDEATHSIG``, `evtrain.launcher.hook_supervisor`) and the agent sees its
stdin end: it stops the workers the same way, marks ``run.json``
interrupted and removes the launcher's ipc directory
(`evtrain.launcher.elastic_agent`).

`StopMachine` holds no process and reads no clock: signals, acknowledgements
and the time go in, the `StopAction` to carry out comes out. `StopDriver`
carries it out for the launcher: the command on the bus, the agent
terminated or killed. A caller that keeps the signals to itself
(`evtrain.tools.api` in a thread) passes them on through `StopRequests`.
"""

from __future__ import annotations

import enum
import queue
import secrets
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import anyio
import structlog

from evtrain.bus.commands import Delivery
from evtrain.events import CommandAcked, StopRun

__all__ = [
    "ELASTIC_SHUTDOWN_S",
    "KILL_AFTER_S",
    "StopAction",
    "StopDriver",
    "StopMachine",
    "StopRequests",
]

log = structlog.get_logger("evtrain.launcher.stop")

ELASTIC_SHUTDOWN_S = 5
"""Seconds elastic gives workers between its SIGTERM and SIGKILL (second stop phase)."""
KILL_AFTER_S = ELASTIC_SHUTDOWN_S + 10
"""Seconds the second phase lasts before the third (elastic's own SIGKILL comes before)."""


class StopAction(enum.Enum):
    """What the launcher does now for the stop."""

    NONE = "none"
    SEND_STOP = "send stop"
    """Phase 1 begins: publish the stop command."""
    RESEND_STOP = "resend stop"
    """Phase 1 goes on: publish the same command again (a stage has not acknowledged it)."""
    TERMINATE = "terminate"
    """Phase 2: SIGTERM to the agent (elastic terminates the workers)."""
    KILL = "kill"
    """Phase 3 (and any later signal): SIGKILL to the agent's process group."""

    @property
    def announcement(self) -> str | None:
        """The warning logged when the action starts a phase."""
        return _ANNOUNCEMENTS.get(self)


_ANNOUNCEMENTS = {
    StopAction.SEND_STOP: "stopping the run at the next step boundary",
    StopAction.TERMINATE: "escalating: elastic terminates the workers",
    StopAction.KILL: "killing every process of the run",
}


class StopMachine:
    """The phase of the stop (module docstring): inputs in, `StopAction` out.

    ``phase`` is 0 until a stop began; it counts on with every signal after
    the third (each one kills again).
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.phase = 0
        self.signal: int | None = None
        """The first signal that arrived (None: no stop was asked for)."""
        self.deadline: float | None = None
        """When the current phase times out and the next begins (None: never)."""
        self.delivery = Delivery(wanted=1)
        """The stop command's acknowledgements (`tick` says how many stages there are)."""

    @property
    def workers_ended_by_us(self) -> bool:
        """Whether we had elastic (or ourselves) end the workers: their deaths say nothing."""
        return self.phase >= 2

    @property
    def reason(self) -> str:
        """Why the run stops, as the stop command and ``RunEnded`` say it."""
        return f"launcher got {signal.Signals(self.signal or signal.SIGTERM).name}"

    def on_signal(
        self, signum: int, now: float, *, workers_started: bool, bus_down: bool
    ) -> StopAction:
        """A signal arrived (or `StopRequests` passed one on): the next phase."""
        if self.signal is None:
            self.signal = int(signum)
        return self.escalate(now, workers_started=workers_started, bus_down=bus_down)

    def escalate(self, now: float, *, workers_started: bool, bus_down: bool) -> StopAction:
        """Move to the next phase (a signal arrived, or the current phase timed out)."""
        self.phase += 1
        if self.phase == 1 and not workers_started:
            self.phase = 3  # no workers yet: nothing to stop gently
        elif self.phase == 1 and bus_down:
            self.phase = 2  # no command reaches the stages
        if self.phase == 1:
            self.deadline = now + self.grace_s
            return StopAction.SEND_STOP
        if self.phase == 2:
            self.deadline = now + KILL_AFTER_S
            return StopAction.TERMINATE
        self.deadline = None
        return StopAction.KILL

    def sent(self, now: float) -> None:
        """The stop command was published at ``now``."""
        self.delivery.sent(now)

    def acknowledged(self, stage: int) -> None:
        """``stage`` acknowledged the stop command (it applies it once, whatever repeats)."""
        self.delivery.acknowledged(stage)

    def tick(self, now: float, *, stages: int) -> StopAction:
        """Periodically: escalate on timeout, retry the command until ``stages`` acknowledged."""
        if self.phase == 0:
            return StopAction.NONE
        if self.deadline is not None and now > self.deadline:
            # Phase 1 only begins on a signal: from here on the phase is >= 2.
            return self.escalate(now, workers_started=True, bus_down=False)
        self.delivery.wanted = stages
        if self.phase == 1 and self.delivery.due(now):
            return StopAction.RESEND_STOP
        return StopAction.NONE

    def killed_workers(self) -> None:
        """We killed the workers (a run that failed elsewhere): their deaths are ours."""
        self.phase = 3


class StopRequests:
    """Stops asked for from another thread (`evtrain.launcher.Launcher.request_stop`)."""

    def __init__(self, poll_s: float) -> None:
        self._queue: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._poll_s = poll_s

    def put(self, signum: int) -> None:
        """Act as if ``signum`` had arrived (callable from any thread)."""
        self._queue.put(int(signum))

    async def __aiter__(self) -> AsyncIterator[int]:
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                await anyio.sleep(self._poll_s)


class _Agent(Protocol):
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class StopDriver:
    """Carries out what ``machine`` says: ``send`` publishes a `StopRun` (False: it could
    not), ``agent`` is the process that runs the workers (None: not started).
    ``workers_started`` and ``bus_down`` say what the machine must know of a signal."""

    def __init__(
        self,
        machine: StopMachine,
        *,
        send: Callable[[StopRun], bool],
        agent: Callable[[], _Agent | None],
        workers_started: Callable[[], bool],
        bus_down: Callable[[], bool],
    ) -> None:
        self.machine = machine
        self.command_id = secrets.token_hex(8)
        """The one id of this launch's stop command: stages apply it once, however
        often it arrives."""
        self._send, self._agent = send, agent
        self._workers_started, self._bus_down = workers_started, bus_down

    async def watch(self, signals: AsyncIterator[int]) -> None:
        """Every signal (or request) takes the stop one phase on."""
        async for signum in signals:
            name = signal.Signals(signum).name
            log.warning("signal received", signal=name, phase=self.machine.phase + 1)
            action = self.machine.on_signal(
                signum,
                time.monotonic(),
                workers_started=self._workers_started(),
                bus_down=self._bus_down(),
            )
            self.act(action)

    def tick(self, stages: int) -> None:
        """The machine's timeouts, checked."""
        self.act(self.machine.tick(time.monotonic(), stages=stages))

    def act(self, action: StopAction) -> None:
        if action.announcement is not None:
            log.warning(action.announcement)
        if action in (StopAction.SEND_STOP, StopAction.RESEND_STOP):
            if self._send(StopRun(command_id=self.command_id, reason=self.machine.reason)):
                self.machine.sent(time.monotonic())
        elif (agent := self._agent()) is None:
            return
        elif action is StopAction.TERMINATE:
            agent.terminate()
        elif action is StopAction.KILL:
            agent.kill()

    def acknowledged(self, ack: CommandAcked) -> None:
        if ack.command_id == self.command_id:
            self.machine.acknowledged(ack.stage)
