"""The launcher's progress line and end-of-run summary, computed from bus events.

At the end the launcher settles the count with what the stages themselves
reported (`Progress.settle`), so the summary is right even when bus events
were lost.

`Progress` folds the events the launcher's own subscriber receives
(`RunStarted`, `StepEnded`, `EvalEnded`, `RunEnded`, `StageFailed`) into a
few numbers and renders them: steps done / max, loss, samples/s, steps/s and
an ETA. On a terminal the line is rewritten in place (``\\r``); anywhere else
(a log file, CI, a pipe) it prints a plain line every ``interval`` seconds so
logs stay readable. Rates come from the event timestamps over a sliding
window of the last stage's steps, so they are what the pipeline really did,
not what the launcher happened to observe.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

from evtrain.events import EvalEnded, Message, RunEnded, RunStarted, StageFailed, StepEnded

__all__ = ["Progress", "ProgressStats", "format_duration"]

_WINDOW = 20
"""Steps in the sliding window that rates are computed over."""


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
    ordered = sorted(metrics.items(), key=lambda kv: (kv[0] != "loss", kv[0]))
    return " ".join(f"{key} {value:.5g}" for key, value in ordered)


@dataclass
class ProgressStats:
    """What is known about the run's progress (all from events)."""

    name: str = ""
    num_stages: int | None = None
    max_steps: int | None = None
    start_step: int = 0
    steps_done: int = 0
    last_loss: float | None = None
    last_lr: float | None = None
    last_eval: EvalEnded | None = None
    ended: RunEnded | None = None
    failures: list[StageFailed] = field(default_factory=list)
    first_step_ts: float | None = None
    last_step_ts: float | None = None
    first_step_seen: int = 0
    """The step of the first `StepEnded` timed (``first_step_ts``)."""
    last_step_seen: int = 0
    """The step of the latest `StepEnded` timed (``last_step_ts``)."""
    samples_total: int = 0
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

    def eta_s(self) -> float | None:
        """Seconds until ``max_steps`` at the recent rate."""
        rate = self.steps_per_s()
        if rate is None or self.max_steps is None:
            return None
        return max(0, self.max_steps - self.steps_done) / rate


class Progress:
    """Turns bus events into a progress line on ``stream`` and a final summary.

    ``tty`` (default: ``stream.isatty()``) picks the in-place line; otherwise a
    plain line is printed at most every ``interval`` seconds. ``enabled=False``
    (``--quiet``) prints nothing while running; `summary` still works.
    """

    def __init__(
        self,
        stream: TextIO,
        *,
        tty: bool | None = None,
        interval: float = 10.0,
        tty_interval: float = 0.2,
        enabled: bool = True,
    ) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.interval = tty_interval if self.tty else interval
        self.enabled = enabled
        self.stats = ProgressStats()
        self._last_print = 0.0
        self._printed_step = -1
        self._line_width = 0

    # -- folding events ---------------------------------------------------------

    def update(self, msg: Message) -> None:
        """Fold one event into the stats (other message types are ignored)."""
        stats = self.stats
        if isinstance(msg, RunStarted):
            if stats.first_step_ts is not None:
                # The workers were restarted (elastic): time the new attempt only.
                stats.window.clear()
                stats.first_step_ts = stats.last_step_ts = None
                stats.steps_done = msg.start_step
                stats.ended = None
            stats.name = msg.name
            stats.num_stages = msg.num_stages
            stats.max_steps = msg.max_steps
            stats.start_step = msg.start_step
            stats.steps_done = max(stats.steps_done, msg.start_step)
        elif isinstance(msg, StepEnded):
            self._step(msg)
        elif isinstance(msg, EvalEnded):
            stats.last_eval = msg
            self._eval_line(msg)
        elif isinstance(msg, RunEnded):
            stats.ended = msg
        elif isinstance(msg, StageFailed):
            stats.failures.append(msg)

    def _step(self, msg: StepEnded) -> None:
        stats = self.stats
        # Only the last stage knows the loss; it is also the one that finishes a
        # step last, so its events time the pipeline. Before RunStarted told us
        # the stage count, the loss marks the last stage.
        last = stats.num_stages - 1 if stats.num_stages else None
        if (last is not None and msg.stage != last) or (last is None and msg.loss is None):
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

    # -- rendering --------------------------------------------------------------

    def line(self) -> str:
        """The current progress line (no newline)."""
        stats = self.stats
        total = f"/{stats.max_steps}" if stats.max_steps is not None else ""
        parts = [f"step {stats.steps_done}{total}"]
        if stats.last_loss is not None:
            parts.append(f"loss {stats.last_loss:.5g}")
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

    def tick(self, now: float | None = None) -> None:
        """Print the line if it is due (and something changed)."""
        if not self.enabled or self.stats.first_step_ts is None:
            return
        now = time.monotonic() if now is None else now
        if now - self._last_print < self.interval or self._printed_step == self.stats.steps_done:
            return
        self._emit()
        self._last_print = now

    def _emit(self) -> None:
        text = self.line()
        self._printed_step = self.stats.steps_done
        if self.tty:
            pad = max(0, self._line_width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._line_width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _eval_line(self, msg: EvalEnded) -> None:
        if not self.enabled:
            return
        self._clear()
        self.stream.write(f"eval at step {msg.step}: {_metrics(msg.metrics)}\n")
        self.stream.flush()

    def _clear(self) -> None:
        if self.tty and self._line_width:
            self.stream.write("\r" + " " * self._line_width + "\r")
            self._line_width = 0

    def close(self) -> None:
        """Print the final state of the line and end it."""
        if not self.enabled:
            return
        if self.stats.first_step_ts is not None and self._printed_step != self.stats.steps_done:
            self._emit()
        if self.tty and self._line_width:
            self.stream.write("\n")
            self._line_width = 0
        self.stream.flush()

    def summary(self, *, status: str, wall_s: float, run_dir: str) -> str:
        """The end-of-run summary: status, steps, final loss, last eval, wall time, run dir."""
        stats = self.stats
        total = f"/{stats.max_steps}" if stats.max_steps is not None else ""
        head = f"run {status}: {stats.steps_done}{total} steps in {format_duration(wall_s)}"
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
            lines.append(f"  reason: {stats.ended.reason}")
        if stats.last_loss is not None:
            lines.append(f"  final loss: {stats.last_loss:.6g}")
        if stats.last_eval is not None:
            lines.append(
                f"  last eval (step {stats.last_eval.step}): {_metrics(stats.last_eval.metrics)}"
            )
        lines.append(f"  run dir: {run_dir}")
        return "\n".join(lines)
