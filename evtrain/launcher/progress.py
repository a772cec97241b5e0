"""What the launcher shows of a run: header, progress, evaluations, summary.

`Progress` folds the events the launcher's own subscriber receives
(`RunStarted`, `StepEnded`, `EvalStarted`, `EvalProgress`, `EvalEnded`,
`RunEnded`, `StageFailed`) into a few numbers and renders them as text:
steps done / max, loss, samples/s, steps/s, an ETA, the evaluation in
progress (batches done / total, and its set), the latest evaluation and the
end-of-run summary. Rates
come from the event timestamps over a sliding window of the last stage's
steps, so they are what the pipeline really did, not what the launcher
happened to observe. With data parallelism those are replica 0's: every
replica reports the same steps, the global batch and the mean loss, so
counting theirs too would count each step once per replica; a stage's peak
memory is that of its highest replica. At the end the launcher settles the count with what
the stages themselves reported (`Progress.settle`), so the summary is right
even when bus events were lost.

`RunConsole` is the launcher's terminal, in one of three modes:

* live (stdout is a terminal): one progress bar drawn by rich at the bottom
  of the screen, with every other line (header, evaluations, warnings, log
  lines) printed above it. When stderr is the same terminal, log lines get
  there through the console too: this process's structlog lines through
  `evtrain.logs.LOG_STREAM`, and the output of every process the launcher
  starts (hooks, the elastic agent and its workers) through a pipe that
  the console reads line by line, so no process writes over the bar.
* plain (stdout is a file or a pipe): no control codes; a progress line at
  every tenth of the run and at least every `PLAIN_INTERVAL_S` seconds (also
  while an evaluation runs: its batches done), one line per evaluation. The
  other processes write to stderr directly.
* quiet (``-q``): the header and the summary only.

The bar is transient: at the end it gives way to the summary, which says
everything it said.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import IO, TextIO

from rich.console import Console
from rich.progress import BarColumn, SpinnerColumn, TaskID, TextColumn
from rich.progress import Progress as RichProgress
from rich.text import Text

from evtrain.events import (
    EvalEnded,
    EvalProgress,
    EvalStarted,
    Message,
    RunEnded,
    RunStarted,
    StageFailed,
    StepEnded,
)
from evtrain.formatting import fmt_bytes, per_stage, safe_text
from evtrain.logs import LAUNCHER_CONSOLE_ENV, LOG_STREAM

__all__ = [
    "PLAIN_INTERVAL_S",
    "Progress",
    "ProgressStats",
    "RunConsole",
    "format_duration",
]

_WINDOW = 20
"""Steps in the sliding window that rates are computed over."""
PLAIN_INTERVAL_S = 30.0
"""Longest time between two plain progress lines while steps go on."""
_PLAIN_MARKS = 10
"""Plain mode prints a progress line at every 1/_PLAIN_MARKS of the steps."""
STALL_MIN_S = 10.0
"""A run is stalled once no step ended for this long, and for 10 typical steps."""
STALLED_LINE_S = 60.0
"""Plain mode repeats a stalled run's line this often."""
_RELAY_DRAIN_S = 2.0
_NAME_LIMIT = 64


def format_duration(seconds: float) -> str:
    """``75.3`` -> ``"1:15"``, ``3725`` -> ``"1:02:05"``; ``"?"`` when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _rate(value: float) -> str:
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _metrics(metrics: dict[str, float]) -> str:
    # Metric names come from the stages' events: shown, never interpreted.
    # Named sets ("val/loss", "test/loss") stay in the order they came, each
    # with its loss first.
    groups: dict[str, int] = {}

    def order(item: tuple[str, float]) -> tuple[int, bool, str]:
        group, sep, leaf = item[0].partition("/")
        if not sep:
            group, leaf = "", item[0]
        # sorted() computes the keys in the input's order: first seen, first shown.
        return groups.setdefault(group, len(groups)), leaf != "loss", item[0]

    ordered = sorted(metrics.items(), key=order)
    return " ".join(f"{safe_text(key, _NAME_LIMIT)} {value:.5g}" for key, value in ordered)


@dataclass
class ProgressStats:
    """What is known about the run's progress (all from events)."""

    name: str = ""
    num_stages: int | None = None
    data_parallel: int | None = None
    """Replicas of every stage (None before `RunStarted`)."""
    max_steps: int | None = None
    start_step: int = 0
    steps_done: int = 0
    last_loss: float | None = None
    last_lr: float | None = None
    last_eval: EvalEnded | None = None
    evaluating: int | None = None
    """The step of the evaluation in progress (None: none is)."""
    eval_done: int = 0
    """Batches that evaluation finished, over all its sets."""
    eval_total: int = 0
    eval_set: str = ""
    """The set it is in (``""``: the single unnamed set)."""
    ended: RunEnded | None = None
    failures: list[StageFailed] = field(default_factory=list)
    first_step_ts: float | None = None
    last_step_ts: float | None = None
    last_step_arrived: float | None = None
    """When the latest timed step's event arrived here (`time.monotonic`)."""
    first_step_seen: int = 0
    """The step of the first `StepEnded` timed (``first_step_ts``)."""
    last_step_seen: int = 0
    """The step of the latest `StepEnded` timed (``last_step_ts``)."""
    samples_total: int = 0
    peak_memory: dict[int, int] = field(default_factory=dict)
    """Highest ``peak_memory_bytes`` reported, by stage."""
    window: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=_WINDOW))

    def steps_per_s(self) -> float | None:
        """Optimizer steps per second over the recent window."""
        if len(self.window) < 2:
            return None
        elapsed = self.window[-1][0] - self.window[0][0]
        return (len(self.window) - 1) / elapsed if elapsed > 0 else None

    def samples_per_s(self) -> float | None:
        """Training samples per second over the recent window."""
        if len(self.window) < 2:
            return None
        elapsed = self.window[-1][0] - self.window[0][0]
        samples = sum(s for _, s in list(self.window)[1:])
        return samples / elapsed if elapsed > 0 else None

    def stalled_s(self, now: float) -> float | None:
        """Seconds since the latest step's event arrived, once that is far longer than a
        step (`STALL_MIN_S`, and 10 recent steps); None while steps come (``now``:
        `time.monotonic`; the events' own times are another machine's clock).

        An evaluation in progress is not a stall: it shows its own progress.
        """
        arrived = self.last_step_arrived
        if arrived is None or self.ended is not None or self.evaluating is not None:
            return None
        gap = now - arrived
        steps = self.steps_per_s()
        typical = 1.0 / steps if steps else 0.0
        return gap if gap >= max(STALL_MIN_S, 10 * typical) else None

    def eta_s(self) -> float | None:
        """Seconds until ``max_steps`` at the recent rate."""
        rate = self.steps_per_s()
        if rate is None or self.max_steps is None:
            return None
        return max(0, self.max_steps - self.steps_done) / rate


class Progress:
    """Bus events folded into `ProgressStats`, and the text that shows them."""

    def __init__(self) -> None:
        self.stats = ProgressStats()

    def update(self, msg: Message) -> None:
        """Fold one event into the stats (other message types are ignored)."""
        stats = self.stats
        if isinstance(msg, RunStarted):
            if stats.first_step_ts is not None:
                # The workers were restarted (elastic): time the new attempt only.
                stats.window.clear()
                stats.first_step_ts = stats.last_step_ts = stats.last_step_arrived = None
                stats.steps_done = msg.start_step
                stats.ended = None
            stats.name = msg.name
            stats.num_stages = msg.num_stages
            stats.data_parallel = msg.data_parallel
            stats.max_steps = msg.max_steps
            stats.start_step = msg.start_step
            stats.steps_done = max(stats.steps_done, msg.start_step)
        elif isinstance(msg, StepEnded):
            self._step(msg)
        elif isinstance(msg, EvalStarted):
            stats.evaluating, stats.eval_done, stats.eval_set = msg.step, 0, ""
            stats.eval_total = msg.num_batches
        elif isinstance(msg, EvalProgress):
            if stats.evaluating != msg.step:  # its EvalStarted was missed
                stats.evaluating, stats.eval_done = msg.step, 0
            # Events may arrive out of order between sources, never backwards here.
            stats.eval_done = max(stats.eval_done, msg.batches_done)
            stats.eval_total, stats.eval_set = msg.num_batches, msg.set
        elif isinstance(msg, EvalEnded):
            stats.last_eval = msg
            if stats.evaluating == msg.step:
                stats.evaluating = None
        elif isinstance(msg, RunEnded):
            stats.ended = msg
        elif isinstance(msg, StageFailed):
            stats.failures.append(msg)

    def _step(self, msg: StepEnded) -> None:
        stats = self.stats
        if stats.data_parallel is not None and msg.replica >= stats.data_parallel:
            return  # no process of this run
        if msg.peak_memory_bytes is not None:
            stats.peak_memory[msg.stage] = max(
                msg.peak_memory_bytes, stats.peak_memory.get(msg.stage, 0)
            )
        # Only the last stage knows the loss; it is also the one that finishes a
        # step last, so its events time the pipeline. Before RunStarted told us
        # the stage count, the loss marks the last stage. Of its replicas,
        # replica 0 speaks for the run.
        last = stats.num_stages - 1 if stats.num_stages else None
        if msg.replica or (last is not None and msg.stage != last):
            return
        if last is None and msg.loss is None:
            return
        # Steps are numbered from 1 (step k reads batch k - 1): step k ended = k done.
        stats.steps_done = max(stats.steps_done, msg.step)
        if msg.loss is not None:
            stats.last_loss = msg.loss
        if msg.lr is not None:
            stats.last_lr = msg.lr
        stats.samples_total += msg.samples
        if stats.first_step_ts is None:
            stats.first_step_ts = msg.ts
            stats.first_step_seen = msg.step
        stats.last_step_ts = msg.ts
        stats.last_step_arrived = time.monotonic()
        stats.last_step_seen = msg.step
        stats.window.append((msg.ts, msg.samples))

    def settle(self, steps: int, loss: float | None) -> None:
        """Adopt the stages' own final count (and the last stage's loss) where it is ahead."""
        stats = self.stats
        if steps < stats.steps_done:
            return
        if steps > stats.steps_done or stats.last_loss is None:
            stats.last_loss = loss if loss is not None else stats.last_loss
        stats.steps_done = steps

    # -- text -------------------------------------------------------------------

    def steps_text(self) -> str:
        """``"150/300"`` (or ``"150"`` without a known maximum)."""
        stats = self.stats
        total = f"/{stats.max_steps}" if stats.max_steps is not None else ""
        return f"{stats.steps_done}{total}"

    def rates_text(self, now: float | None = None) -> str:
        """Loss, throughput and ETA: ``"loss 0.21  9.1k samples/s  143 steps/s  ETA 0:02"``;
        a stalled run's ``"loss 0.21  no step for 1:05"`` instead (``now``: monotonic)."""
        stats = self.stats
        parts = []
        if stats.last_loss is not None:
            parts.append(f"loss {stats.last_loss:.5g}")
        stalled = stats.stalled_s(time.monotonic() if now is None else now)
        if stalled is not None:
            # The recent rate was true of steps that ended long ago, not of the run now.
            return "  ".join([*parts, f"no step for {format_duration(stalled)}"])
        samples = stats.samples_per_s()
        if samples is not None:
            parts.append(f"{_rate(samples)} samples/s")
        steps = stats.steps_per_s()
        if steps is not None:
            parts.append(f"{_rate(steps)} steps/s")
        eta = stats.eta_s()
        if eta is not None:
            parts.append(f"ETA {format_duration(eta)}")
        return "  ".join(parts)

    def line(self, now: float | None = None) -> str:
        """The plain progress line: ``"step 150/300  loss ...  ETA 0:02"``."""
        rates = self.rates_text(now)
        return f"step {self.steps_text()}" + (f"  {rates}" if rates else "")

    def eval_text(self) -> str:
        """The evaluation in progress, ``"evaluating@150 12/40 val"``, else the latest one
        short, ``"eval@150 loss 0.097 accuracy 0.969"`` (or "")."""
        if self.stats.evaluating is not None:
            return f"evaluating@{self.stats.evaluating} {self._eval_done_text()}"
        last = self.stats.last_eval
        return "" if last is None else f"eval@{last.step} {_metrics(last.metrics)}"

    def _eval_done_text(self) -> str:
        stats = self.stats
        where = f" {safe_text(stats.eval_set, _NAME_LIMIT)}" if stats.eval_set else ""
        return f"{stats.eval_done}/{stats.eval_total}{where}"

    def eval_progress_line(self) -> str:
        """The plain line of the evaluation in progress (or ""):
        ``"evaluating step 150: 12/40 batches val"``."""
        stats = self.stats
        if stats.evaluating is None:
            return ""
        where = f" {safe_text(stats.eval_set, _NAME_LIMIT)}" if stats.eval_set else ""
        return (
            f"evaluating step {stats.evaluating}: {stats.eval_done}/{stats.eval_total} "
            f"batches{where}"
        )

    @staticmethod
    def eval_line(ev: EvalEnded) -> str:
        """One evaluation's line: ``"eval at step 50: loss 0.2058 accuracy 0.93872"``."""
        return f"eval at step {ev.step}: {_metrics(ev.metrics)}"

    def summary(self, *, status: str, wall_s: float) -> str:
        """The end-of-run summary: status, steps, final loss, last eval, peak memory.

        The run directory is in the header, once.
        """
        stats = self.stats
        head = f"run {status}: {self.steps_text()} steps in {format_duration(wall_s)}"
        if stats.first_step_ts is not None and stats.last_step_ts is not None:
            # Timed by the events seen: a count settled from the stages' reports
            # (events lost) has no timestamps.
            timed = stats.last_step_seen - stats.first_step_seen
            span = stats.last_step_ts - stats.first_step_ts
            if timed > 0 and span > 0:
                head += f" ({_rate(timed / span)} steps/s)"
        lines = [head]
        # A failed run's reason is the root cause, which the launcher prints itself.
        if stats.ended is not None and stats.ended.reason and stats.ended.status != "failed":
            lines.append(f"  reason: {safe_text(stats.ended.reason, 500)}")
        if stats.last_loss is not None:
            lines.append(f"  final loss: {stats.last_loss:.6g}")
        if stats.last_eval is not None:
            lines.append(
                f"  last eval (step {stats.last_eval.step}): {_metrics(stats.last_eval.metrics)}"
            )
        if stats.peak_memory:
            memory = per_stage({s: fmt_bytes(b) for s, b in stats.peak_memory.items()})
            lines.append(f"  peak memory: {memory}")
        return "\n".join(lines)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


class _Relay:
    """A pipe that child processes write their output to, read here line by line."""

    def __init__(self, sink: Callable[[str], None]) -> None:
        read_fd, self.write_fd = os.pipe()
        self._sink = sink
        self._thread = threading.Thread(
            target=self._pump, args=(read_fd,), name="evtrain-output-relay", daemon=True
        )
        self._thread.start()

    def _pump(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            for raw in pipe:
                self._sink(raw.decode(errors="replace").rstrip("\r\n"))

    def close(self) -> None:
        """Stop accepting writers; read what they left (until their copies close too)."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1
        # A straggler that still holds the pipe (a worker elastic could not reap)
        # must not hold the summary back.
        self._thread.join(_RELAY_DRAIN_S)


class RunConsole:
    """The launcher's terminal: see the module docstring for its three modes.

    ``live`` (default: whether ``out`` is a terminal) picks the live bar;
    ``quiet`` prints only what `say` and the warnings print. Lines written
    with `say` go to ``out``; `warn` and `error` lines to ``err``.
    """

    def __init__(
        self,
        out: TextIO,
        err: TextIO,
        *,
        quiet: bool = False,
        live: bool | None = None,
        interval: float = PLAIN_INTERVAL_S,
        prefix: str = "evtrain launch",
        eval_lines: bool = True,
    ) -> None:
        self.progress = Progress()
        self.eval_lines = eval_lines
        """Print a line per finished evaluation (an evaluation-only run prints its own)."""
        self.out = out
        self.err = err
        self.quiet = quiet
        self.live = not quiet and (_is_terminal(out) if live is None else live)
        self.interval = interval
        self.prefix = prefix
        # Log lines join the bar's terminal only when stderr is that terminal;
        # with stderr redirected they stay where the user sent them.
        self.shares_terminal = self.live and _is_terminal(err)
        self._lock = threading.RLock()
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None
        self._stack = ExitStack()
        self._relay: _Relay | None = None
        self._last_plain = time.monotonic()
        self._last_refresh = self._last_plain
        self._plain_step = -1
        self._plain_eval: tuple[int, int] | None = None
        self._closed = False

    # -- what the launcher's children need ----------------------------------------

    @property
    def child_output(self) -> int | None:
        """The file descriptor children write stdout and stderr to (None: inherit ours)."""
        with self._lock:
            if self._relay is None and self.shares_terminal and not self._closed:
                self._relay = _Relay(self._child_line)
            relay = self._relay
        return relay.write_fd if relay is not None and relay.write_fd >= 0 else None

    def child_env(self) -> dict[str, str]:
        """Environment for the launcher's children: who shows what (`evtrain.logs`)."""
        return {} if self.quiet else {LAUNCHER_CONSOLE_ENV: "1"}

    # -- lines ----------------------------------------------------------------------

    def say(self, text: str) -> None:
        """Lines of the run's own story (header, summary) on ``out``."""
        for line in text.splitlines():
            self._emit(line, self.out)

    def warn(self, text: str) -> None:
        """``PREFIX: warning: TEXT`` on ``err``."""
        self._emit(f"{self.prefix}: warning: {text}", self.err)

    def error(self, text: str) -> None:
        """``PREFIX: error: TEXT`` (more lines may follow) on ``err``."""
        for line in f"{self.prefix}: error: {text}".splitlines():
            self._emit(line, self.err)

    def _emit(self, line: str, stream: TextIO) -> None:
        with self._lock:
            bar = self._bar
            if bar is not None and (stream is self.out or self.shares_terminal):
                bar.console.print(Text(line), soft_wrap=True)
                return
            stream.write(line + "\n")
            stream.flush()

    def _log_line(self, line: str) -> None:
        self._emit(line, self.err)

    def _child_line(self, line: str) -> None:
        with self._lock:
            if self._bar is not None:
                # Text.from_ansi keeps colours and drops cursor movement.
                self._bar.console.print(Text.from_ansi(line), soft_wrap=True)
                return
        self._emit(line, self.err)

    # -- the run ----------------------------------------------------------------------

    def start(self) -> None:
        """From now on progress is shown (live: the bar appears)."""
        if not self.live or self._bar is not None or self._closed:
            return
        console = Console(file=self.out, highlight=False, soft_wrap=True)
        bar = RichProgress(
            SpinnerColumn(),
            TextColumn("{task.description}", markup=False),
            BarColumn(bar_width=30),
            TextColumn("{task.fields[steps]}", markup=False),
            TextColumn("{task.fields[rates]}", markup=False),
            TextColumn("{task.fields[eval]}", markup=False, style="cyan"),
            console=console,
            transient=True,
            refresh_per_second=4,
            redirect_stdout=True,
            redirect_stderr=self.shares_terminal,
        )
        with self._lock:
            self._task = bar.add_task("starting", total=None, steps="", rates="", eval="")
            bar.start()
            self._bar = bar
        if self.shares_terminal:
            self._stack.enter_context(LOG_STREAM.redirect(self._log_line))

    def update(self, msg: Message) -> None:
        """Fold one event in and show what changed."""
        self.progress.update(msg)
        if self.quiet:
            return
        if isinstance(msg, EvalEnded) and self.eval_lines:
            self._emit(Progress.eval_line(msg), self.out)
        elif isinstance(msg, StepEnded) and not self.live:
            self._plain_at_mark()
        if self._bar is not None and isinstance(
            msg, RunStarted | StepEnded | EvalStarted | EvalProgress | EvalEnded
        ):
            self._refresh()

    def _refresh(self) -> None:
        stats = self.progress.stats
        bar, task = self._bar, self._task
        if bar is None or task is None:
            return
        started = stats.num_stages is not None
        total, completed = (stats.max_steps if started else None), stats.steps_done
        if stats.evaluating is not None:
            # A long evaluation fills the bar with its batches, then training resumes it.
            total, completed = stats.eval_total or None, stats.eval_done
        bar.update(
            task,
            description=safe_text(stats.name, _NAME_LIMIT) if started else "starting",
            total=total,
            completed=completed,
            steps=self.progress.steps_text() if started else "",
            rates=self.progress.rates_text(),
            eval=self.progress.eval_text(),
        )

    def _plain_at_mark(self) -> None:
        stats = self.progress.stats
        if stats.max_steps is None or stats.first_step_ts is None:
            return
        every = max(1, stats.max_steps // _PLAIN_MARKS)
        if stats.steps_done // every > max(self._plain_step, stats.start_step) // every:
            self._plain_line()

    def _plain_line(self, now: float | None = None) -> None:
        self._plain_step = self.progress.stats.steps_done
        self._last_plain = time.monotonic() if now is None else now
        self._emit(self.progress.line(now), self.out)

    def tick(self, now: float | None = None) -> None:
        """Plain mode: a progress line if none was printed for ``interval`` seconds.

        While an evaluation runs, the line says how far it got instead (when
        that changed since the last one); while the run is stalled, a line
        saying so every `STALLED_LINE_S`. Live mode: the bar's text, which
        only events change otherwise, every second.
        """
        if self.quiet:
            return
        now = time.monotonic() if now is None else now
        if self.live:
            if now - self._last_refresh >= 1.0:
                self._last_refresh = now
                self._refresh()
            return
        stats = self.progress.stats
        if stats.stalled_s(now) is not None:
            if now - self._last_plain >= max(self.interval, STALLED_LINE_S):
                self._plain_line(now)
            return
        if stats.evaluating is not None:
            where = (stats.evaluating, stats.eval_done)
            if now - self._last_plain >= self.interval and where != self._plain_eval:
                self._plain_eval, self._last_plain = where, now
                self._emit(self.progress.eval_progress_line(), self.out)
            return
        if stats.first_step_ts is None:
            return
        if now - self._last_plain >= self.interval and (
            self._plain_step != self.progress.stats.steps_done
        ):
            self._plain_line()

    def close(self) -> None:
        """End the progress display (before the summary); read what children left."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._relay is not None:
            self._relay.close()
        self._stack.close()
        with self._lock:
            bar, self._bar = self._bar, None
        if bar is not None:
            bar.stop()
        elif not self.quiet and not self.live:
            stats = self.progress.stats
            if stats.first_step_ts is not None and self._plain_step != stats.steps_done:
                self._plain_line()
