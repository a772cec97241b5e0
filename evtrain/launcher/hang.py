"""A run that makes no progress: noticing it (`HangWatch`) and saying where (`Hang`).

A stage that blocks — a layer waiting on a lock, a data loader that never
yields, a peer that stopped without its connections closing, a collective
that never completes — is not a crash: nothing fails, and every other stage
soon waits on it in a receive or a collective. Each stage rewrites its
`evtrain.stages.worker.StageReport` every second with its step and the
instruction it is in (`evtrain.events.Heartbeat.doing`); when no stage's
step or instruction changed for the hang timeout, the run hangs.

The timeout is ``--hang-timeout S``; by default `HANG_FLOOR_S`, or
`HANG_STEP_FACTOR` times the slowest step seen so far when that is longer;
0 turns the watch off. It runs while a stage runs (not while the stages
build their models and join their groups).

Then the launcher asks this machine's stages for every thread's Python
stack and, under NCCL, torch's Flight Recorder (`evtrain.stages.worker`),
and `Hang` composes the report: the stage that holds the others up (one
that stopped reporting; else one busy in an instruction that waits on
nobody; else the end of the chain of waits), a line per stage with what it
waits on, and every stack with the user's frames marked. The launcher
prints its short form, writes it whole to ``RUN_DIR/launches/RUN_ID/hang.txt``,
publishes it (`evtrain.events.HangReported`) and ends the run (exit status
`evtrain.launcher.options.EXIT_HUNG`, ``run.json`` status "hung") — or,
with a restart left, has elastic restart the workers from the last
committed checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import structlog

from evtrain.events import HangReported, RunEnded, doing_kind
from evtrain.failures import frame_text, is_user_file
from evtrain.formatting import fmt_duration
from evtrain.launcher.ending import RunEnding
from evtrain.launcher.stop import StopMachine
from evtrain.launcher.watch import FailureWatch
from evtrain.stages.worker import (
    StageReport,
    flight_recorder_dumps,
    rank_at,
    rank_coordinates,
    request_flight_recorder,
    request_stacks,
    stacks_path,
    this_host,
)

__all__ = [
    "HANG_FILE",
    "HANG_FLOOR_S",
    "HANG_STEP_FACTOR",
    "Hang",
    "HangResponse",
    "HangWatch",
    "StackFrame",
    "Thread",
    "gather_hang",
    "parse_stacks",
    "process_state",
    "write_hang",
]

log = structlog.get_logger(__name__)

HANG_FLOOR_S = 300.0
"""The default hang timeout's least value (seconds)."""
HANG_STEP_FACTOR = 10.0
"""The default hang timeout is at least this many times the slowest step seen."""
SILENT_AFTER_S = 5.0
"""A stage whose report is older than this has stopped responding (it writes every second)."""
STACKS_WAIT_S = 3.0
"""Seconds a hang report waits for the stages' stacks (a stopped process sends none)."""
HANG_FILE = "hang.txt"
"""The report of the hang that ended a run, in ``RUN_DIR/launches/RUN_ID/``
(``hang-attempt-N.txt`` for one that elastic restarted)."""

_UNRESPONSIVE = ("stopped", "stopped by a debugger", "exited", "gone")
_PEER = re.compile(r" (?:from|to) stage (\d+)")
_COLLECTIVE = {
    "ReduceGrads": "its replicas (the gradient all-reduce)",
    "OptimizerStep": "every stage (the step's control exchange)",
    "Boundary": "every stage (the boundary's control exchange)",
    "AgreeShapes": "every stage (agreeing the batch's shapes)",
}
_HOOK_WAITS = ("AwaitPlan", "AwaitVerdicts")
_GLOSS = {
    "LoadBatch": "reading the data",
    "SaveCheckpoint": "writing a checkpoint",
    "Evaluate": "evaluating",
}
_FR_TRACE = "python -m torch.distributed.flight_recorder.fr_trace"
_AT_BOUNDARY = ("Evaluate", "SaveCheckpoint", "Boundary", "Await")
"""Phases between steps: their step is the one completed."""


class HangWatch:
    """Whether the run made progress within the timeout (module docstring).

    Pure: the reports and the time go in (`observe`), the verdict comes out.
    """

    def __init__(self, timeout: float | None) -> None:
        self.explicit = timeout
        """``--hang-timeout`` (None: derived; 0: off)."""
        self._fingerprint: tuple[tuple[int, str, int, str], ...] | None = None
        self._since = 0.0
        """When the fingerprint last changed."""
        self._least_step: int | None = None
        self._step_at = 0.0
        self.slowest_step_s = 0.0
        """The longest time the slowest stage took for a step (boundary work included)."""

    @property
    def timeout(self) -> float:
        """The current timeout (seconds; 0: off)."""
        if self.explicit is not None:
            return self.explicit
        return max(HANG_FLOOR_S, HANG_STEP_FACTOR * self.slowest_step_s)

    def observe(self, reports: Mapping[int, StageReport], now: float) -> bool:
        """Whether the run hangs, given the stage reports at ``now`` (monotonic)."""
        if not any(r.status == "running" for r in reports.values()):
            self._fingerprint = None  # nothing to watch yet, or any more
            return False
        fingerprint = tuple(
            sorted((rank, r.status, r.step, r.doing) for rank, r in reports.items())
        )
        least = min(r.step for r in reports.values())
        if self._least_step is None or least < self._least_step:
            self._least_step, self._step_at = least, now
        elif least > self._least_step:
            if self._fingerprint is not None:
                self.slowest_step_s = max(
                    self.slowest_step_s, (now - self._step_at) / (least - self._least_step)
                )
            self._least_step, self._step_at = least, now
        if fingerprint != self._fingerprint:
            self._fingerprint, self._since = fingerprint, now
            return False
        timeout = self.timeout
        return timeout > 0 and now - self._since >= timeout

    def still_for(self, now: float) -> float:
        """Seconds without progress."""
        return 0.0 if self._fingerprint is None else now - self._since


@dataclass(frozen=True)
class StackFrame:
    filename: str
    lineno: int
    function: str

    @property
    def user(self) -> bool:
        return is_user_file(self.filename)

    def text(self) -> str:
        return frame_text(self.filename, self.lineno, self.function)


@dataclass(frozen=True)
class Thread:
    """One thread of a faulthandler dump; ``frames`` innermost first, as it writes them."""

    header: str
    frames: tuple[StackFrame, ...]


_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_stacks(text: str) -> list[Thread]:
    """The threads of a `faulthandler` dump."""
    threads: list[Thread] = []
    header: str | None = None
    frames: list[StackFrame] = []
    for line in [*text.splitlines(), ""]:
        if _THREAD.match(line):
            header, frames = line.rstrip(":"), []
        elif (match := _FRAME.match(line)) is not None and header is not None:
            frames.append(StackFrame(match[1], int(match[2]), match[3]))
        elif not line.strip() and header is not None:
            threads.append(Thread(header, tuple(frames)))
            header = None
    return threads


def process_state(pid: int) -> str:
    """What ``/proc`` says of process ``pid`` on this machine, in words ("" when running
    or sleeping, as a healthy blocked process does)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    state = stat.rsplit(")", 1)[-1].split()[0]
    return {"T": "stopped", "t": "stopped by a debugger", "Z": "exited", "D": "in disk I/O"}.get(
        state, ""
    )


@dataclass(frozen=True)
class StageState:
    """One stage worker when the run hung: its last report, and what else is known."""

    report: StageReport
    replicas: int
    silent_s: float | None
    """Seconds since its report stopped changing, when it stopped responding (else None)."""
    process: str = ""
    """`process_state` of its process ("": running, or not on this machine)."""
    threads: list[Thread] = field(default_factory=list)
    """Its faulthandler dump's threads (none: no dump came)."""

    @classmethod
    def of(
        cls, report: StageReport, *, replicas: int, wall: float, process: str, stack: str
    ) -> StageState:
        """``report`` read at wall-clock time ``wall``; its process's state and stack."""
        age = wall - report.updated
        unresponsive = age > SILENT_AFTER_S or process in _UNRESPONSIVE
        return cls(
            report=report,
            replicas=replicas,
            silent_s=max(age, 0.0) if unresponsive and report.status == "running" else None,
            process=process,
            threads=parse_stacks(stack),
        )

    @property
    def name(self) -> str:
        r = self.report
        name = f"stage {r.stage}" + (f" replica {r.replica}" if self.replicas > 1 else "")
        return name + (f" tensor rank {r.tp}" if r.tp_size > 1 else "")

    @property
    def in_step(self) -> int:
        """The step it is in: the next one inside a step, the completed one at a boundary."""
        doing = self.report.doing
        if not doing or doing.startswith(_AT_BOUNDARY):
            return self.report.step
        return self.report.step + 1

    @property
    def instruction(self) -> str:
        """The instruction inside its phase (``"Evaluate step 4: Forward m2"``: ``Forward``)."""
        return doing_kind(self.report.doing)

    def waits_on_rank(self) -> int | None:
        """The rank of the peer stage it waits on (same replica and tensor rank), if any."""
        match = _PEER.search(self.report.doing)
        if match is None or not self.instruction.startswith(("Recv", "Send")):
            return None
        r = self.report
        return rank_at(int(match[1]), r.replica, r.tp, replicas=self.replicas, tp_size=r.tp_size)

    def waits_on(self) -> str:
        """What it waits on, in words ("": nothing, it is busy)."""
        peer = self.waits_on_rank()
        if peer is not None:
            stage, _, _ = rank_coordinates(
                peer, replicas=self.replicas, tp_size=self.report.tp_size
            )
            return f"stage {stage}"
        collective = _COLLECTIVE.get(self.instruction)
        if collective is not None:
            return collective
        return "a hook" if self.instruction in _HOOK_WAITS else ""

    @property
    def busy(self) -> bool:
        """In an instruction that waits on no other process (a forward, the data...)."""
        return bool(self.report.doing) and not self.waits_on()

    def working_thread(self) -> Thread | None:
        """The thread that runs the stage's work: the one deepest in user code, else the
        one in the executor, else the first."""
        if not self.threads:
            return None

        def score(thread: Thread) -> tuple[int, int]:
            user = sum(f.user for f in thread.frames)
            executor = any(f.filename.endswith("executor.py") for f in thread.frames)
            return user, int(executor)

        return max(self.threads, key=score)

    def location(self) -> str:
        """The innermost user frame of its working thread ("" without one)."""
        thread = self.working_thread()
        if thread is None:
            return ""
        for frame in thread.frames:
            if frame.user:
                return frame.text()
        return ""

    def doing_words(self) -> str:
        doing = self.report.doing or "between steps"
        gloss = _GLOSS.get(self.instruction) or _GLOSS.get(doing.split(" ", 1)[0])
        return f"{doing} ({gloss})" if gloss else doing

    def line(self) -> str:
        """Its line in the report."""
        r = self.report
        if self.silent_s is not None:
            text = (
                f"{self.name}: not responding for {_seconds(self.silent_s)} "
                f"(last seen in step {self.in_step}, {self.doing_words()})"
            )
            if self.process:
                text += f"; its process is {self.process}"
            return text
        text = f"{self.name}: step {self.in_step}, {self.doing_words()}"
        if r.doing:
            text += f" for {_seconds(r.doing_s)}"
        waits = self.waits_on()
        if waits:
            text += f", waiting on {waits}"
        location = self.location()
        if location and not waits:
            text += f", at {location}"
        return text


@dataclass(frozen=True)
class Hang:
    """The report of a hung run (module docstring)."""

    stages: list[StageState]
    """Every stage worker reported, by rank."""
    culprit: StageState
    still_s: float
    """Seconds the run made no progress."""
    cycle: list[StageState] = field(default_factory=list)
    """Stages that wait on each other in a circle (a deadlock), if that is what it is."""

    @classmethod
    def compose(cls, stages: list[StageState], still_s: float) -> Hang:
        """The report of ``stages`` (at least one) after ``still_s`` without progress."""
        by_rank = {s.report.rank: s for s in stages}
        silent = [s for s in stages if s.silent_s is not None]
        if silent:
            return cls(stages, max(silent, key=lambda s: s.silent_s or 0.0), still_s)
        busy = [s for s in stages if s.busy]
        if busy:
            return cls(stages, max(busy, key=lambda s: s.report.doing_s), still_s)
        hooked = [s for s in stages if s.waits_on() == "a hook"]
        if hooked:
            return cls(stages, hooked[0], still_s)
        # Follow the waits from the stage that waited longest to the one holding it up.
        start = max(stages, key=lambda s: s.report.doing_s)
        seen: list[StageState] = []
        current: StageState | None = start
        while current is not None and current not in seen:
            seen.append(current)
            peer = current.waits_on_rank()
            current = by_rank.get(peer) if peer is not None else None
        if current is not None:  # back at a stage already visited: a circle
            cycle = seen[seen.index(current) :]
            return cls(stages, current, still_s, cycle=cycle)
        return cls(stages, seen[-1], still_s)

    @property
    def step(self) -> int:
        return self.culprit.in_step

    def headline(self) -> str:
        """One line: where the run is stuck."""
        c = self.culprit
        if self.cycle:
            names = " and ".join(s.name for s in self.cycle)
            return (
                f"the run hung in step {self.step}: {names} wait on each other "
                f"({'; '.join(s.report.doing for s in self.cycle)})"
            )
        if c.silent_s is not None:
            process = f"; its process is {c.process}" if c.process else ""
            return (
                f"the run hung in step {self.step}: {c.name} stopped responding "
                f"{_seconds(c.silent_s)} ago, in {c.doing_words()}{process}"
            )
        text = f"the run hung in step {self.step}: {c.name} has been in {c.doing_words()}"
        text += f" for {_seconds(c.report.doing_s)}"
        waits = c.waits_on()
        if waits:
            text += f", waiting on {waits}"
        location = c.location()
        if location:
            text += f", at {location}"
        return text

    def summary(self, path: Path | None) -> str:
        """What the console shows: the headline and a line per stage."""
        lines = [self.headline()]
        lines += [f"  {s.line()}" for s in self.stages]
        if path is not None:
            lines.append(f"  every stack: {path}")
        return "\n".join(lines)

    def text(self, *, flight_recorder: list[Path]) -> str:
        """The whole report (``hang.txt``): the summary and every stack, user frames marked."""
        out = [
            self.summary(None),
            "",
            f"No stage's step or instruction changed for {_seconds(self.still_s)}.",
            "Stacks, innermost frame first; '>' marks your code.",
        ]
        for stage in self.stages:
            out += ["", f"== {stage.name} (rank {stage.report.rank}, pid {stage.report.pid})"]
            if not stage.threads:
                why = f"its process is {stage.process}" if stage.process else "no dump came"
                out.append(f"   no stack: {why}")
            for thread in stage.threads:
                out.append(f"   {thread.header}:")
                for frame in thread.frames:
                    mark = ">" if frame.user else " "
                    out.append(f"   {mark} {frame.text() if frame.user else _plain(frame)}")
        if flight_recorder:
            out += [
                "",
                f"torch's Flight Recorder (read with `{_FR_TRACE} DIR`):",
            ]
            out += [f"   {path}" for path in flight_recorder]
        return "\n".join(out) + "\n"


def _plain(frame: StackFrame) -> str:
    return f"{frame.filename}:{frame.lineno} in {frame.function}"


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value < 120 else fmt_duration(value)


async def gather_hang(
    reports: dict[int, StageReport],
    *,
    report_dir: Path,
    run_id: str,
    attempt: int,
    replicas: int,
    still_s: float,
) -> Hang:
    """The hang of ``reports`` (by rank), with the stacks of this machine's stages and
    their Flight Recorder dumps asked for and waited on (`STACKS_WAIT_S` at most)."""
    host = this_host()
    local = {rank: r for rank, r in reports.items() if r.host == host}
    paths = {rank: stacks_path(report_dir, attempt, rank) for rank in local}
    request_stacks([r.pid for r in local.values()])
    recorders = request_flight_recorder(run_id, attempt)
    deadline = time.monotonic() + STACKS_WAIT_S
    sizes: dict[int, int] = {}
    while time.monotonic() < deadline:
        await anyio.sleep(0.1)
        now_sizes = {rank: _size(path) for rank, path in paths.items()}
        # Every dump written and none still growing: a stopped process writes none.
        recorded = len(flight_recorder_dumps(report_dir, attempt)) >= recorders
        if all(now_sizes.values()) and now_sizes == sizes and recorded:
            break
        sizes = now_sizes
    wall, states = time.time(), []
    for rank, report in sorted(reports.items()):
        stack = ""
        if rank in paths:
            with contextlib.suppress(OSError):
                stack = paths[rank].read_text(errors="replace")
        process = process_state(report.pid) if rank in local else ""
        states.append(
            StageState.of(report, replicas=replicas, wall=wall, process=process, stack=stack)
        )
    return Hang.compose(states, still_s)


def write_hang(hang: Hang, report_dir: Path, attempt: int, *, restarting: bool) -> Path | None:
    """Write ``hang``'s whole report (`HANG_FILE`, or ``hang-attempt-N.txt`` when elastic
    restarts the workers); its path (None: it could not be written)."""
    path = report_dir / (f"hang-attempt-{attempt}.txt" if restarting else HANG_FILE)
    try:
        path.write_text(hang.text(flight_recorder=flight_recorder_dumps(report_dir, attempt)))
    except OSError as exc:
        log.warning("cannot write the hang report", path=str(path), error=str(exc))
        return None
    return path


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class HangResponse:
    """What node 0's launcher does about a run that makes no progress: report where it
    is stuck (`HangReported`, the console, a report file), then end the run, or, when
    elastic restarts the worker group, kill this node's stuck workers and watch anew.
    ``kill_workers`` ends the run's workers (the agent's process group); ``stop`` is
    told their deaths are the launcher's."""

    def __init__(
        self,
        timeout: float | None,
        failures: FailureWatch,
        ending: RunEnding,
        stop: StopMachine,
        *,
        error: Callable[[str], None],
        kill_workers: Callable[[], None],
        report_dir: Path,
        run_id: str,
        replicas: int,
    ) -> None:
        self._timeout = timeout
        self.watch = HangWatch(timeout)
        self._failures, self._ending, self._stop = failures, ending, stop
        self._error, self._kill_workers = error, kill_workers
        self._report_dir = report_dir
        self._run_id = run_id
        self._replicas = replicas
        self.hang: Hang | None = None
        """The hang that ended the run."""

    async def tick(self) -> None:
        """Look for a hang, unless the run is ending already; end the run on one."""
        if self._ending.published is not None or self._stop.phase > 0:
            return
        hang = await self._check(self._failures, self._ending, self._error)
        if hang is not None:
            self.hang = hang
            self._stop.killed_workers()  # their deaths are ours, not a failure
            self._kill_workers()

    async def _check(
        self, failures: FailureWatch, ending: RunEnding, error: Callable[[str], None]
    ) -> Hang | None:
        """The hang that ends the run, published, if one is found now; None otherwise
        (none, or the workers restart)."""
        now = time.monotonic()
        if not self.watch.observe(failures.stage_reports, now):
            return None
        attempt = failures.current_attempt()
        number = attempt.attempt if attempt is not None else 0
        hang = await gather_hang(
            failures.stage_reports,
            report_dir=self._report_dir,
            run_id=self._run_id,
            attempt=number,
            replicas=self._replicas,
            still_s=self.watch.still_for(now),
        )
        restarting = failures.restart_pending(attempt)
        path = write_hang(hang, self._report_dir, number, restarting=restarting)
        culprit = hang.culprit.report
        ending.send(
            HangReported(
                step=hang.step,
                stage=culprit.stage,
                replica=culprit.replica,
                doing=culprit.doing,
                location=hang.culprit.location(),
                summary=hang.summary(None),
                report=str(path or ""),
                restarting=restarting,
            )
        )
        error(hang.summary(path))
        if restarting:
            # Elastic restarts a worker group one of whose workers died.
            failures.hung_attempts[number] = hang.headline()
            self.watch = HangWatch(self._timeout)
            for report in failures.stage_reports.values():
                if report.host == this_host():
                    with contextlib.suppress(OSError):
                        os.kill(report.pid, signal.SIGKILL)
            return None
        headline = hang.headline()
        ending.publish(
            RunEnded(status="failed", reason=headline, root_cause=headline, step=hang.step)
        )
        return hang
