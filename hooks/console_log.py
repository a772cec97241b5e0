"""The logging hook: one progress line every N steps, eval results, bus trouble, run end.

In the spirit of detectron2's CommonMetricPrinter: every ``every`` steps one
line with step/max, loss, learning rate, samples/s, step time (median over a
window), ETA and peak memory per stage. Eval results, checkpoints, stage
failures, lost or dropped bus events and the end of the run get their own line.
With data parallelism a step is still one line (`StepMerger`), a stage's peak
memory is that of its highest replica, and the lines about one stage process
name its ``replica`` when it is not 0.

Started by a launcher whose console shows the run (`evtrain.logs`), the hook
leaves the run's start, progress, evaluations, failures and end to that
console and logs the rest on the terminal they share; with ``path`` it logs
everything to that file.

Lines go through structlog: by default with the process's configuration
(``evtrain --log-format console|json hook logging``); the ``log_format``
option renders this hook's lines its own way, and ``path`` sends them to a
file instead of stderr. Text from events goes through `safe_text` first, and
a progress line shows at most `MAX_METRIC_FIELDS` reported values.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, TextIO

import structlog

from evtrain.events import (
    BusDrops,
    BusGaps,
    CheckpointCommitted,
    CheckpointFailed,
    EvalEnded,
    HookError,
    RunEnded,
    RunStarted,
    StageFailed,
    StageStarted,
    StageStopped,
    StepEnded,
)
from evtrain.failures import is_communication_error, short_error
from evtrain.formatting import (
    fmt_bytes,
    fmt_duration,
    per_stage,
    safe_lines,
    safe_text,
    short,
)
from evtrain.hooks.hook import EventFilter, Hook, on
from evtrain.hooks.options import choice_option, int_option, path_option
from evtrain.logs import LOG_STREAM, launcher_console
from evtrain.steps import MergedStep, StepMerger, StepWindow, place_fields

LOG_FORMATS = ("console", "json")
MAX_METRIC_FIELDS = 64
"""Reported values shown on one progress or eval line; the rest are counted."""
_KEY_LIMIT = 64
_TEXT_LIMIT = 500
# Keys structlog or our loggers own: a reported value of that name never replaces them.
_RESERVED_KEYS = frozenset(
    {"event", "level", "timestamp", "hook", "logger", "exc_info", "exception", "stack_info"}
)


def _metric_fields(
    fields: dict[str, Any], values: dict[str, float], prefix: str = ""
) -> dict[str, Any]:
    """``fields`` plus ``values`` (names made safe, bounded), never replacing a field."""
    shown = 0
    for key, value in values.items():
        if shown == MAX_METRIC_FIELDS:
            fields["more_metrics"] = len(values) - shown
            break
        name = prefix + safe_text(key, _KEY_LIMIT)
        if name in fields or name in _RESERVED_KEYS:
            continue
        fields[name] = short(value)
        shown += 1
    return fields


def _text(value: str | None) -> str | None:
    return None if value is None else safe_text(value, _TEXT_LIMIT)


def make_logger(fmt: str, stream: TextIO, name: str) -> Any:
    """A structlog logger rendering ``fmt`` to ``stream``, independent of the global setup.

    Its lines carry ``hook=name``.
    """
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    return structlog.wrap_logger(
        structlog.WriteLogger(file=stream),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso" if fmt == "json" else "%H:%M:%S"),
            renderer,
        ],
        hook=name,
    )


class ConsoleLog(Hook):
    """Progress and run log (short name ``logging``).

    Options: ``every`` (steps between progress lines, default 20), ``window``
    (steps in the median step time and throughput, default 20),
    ``log_format`` (``console`` or ``json``; default: the process's
    ``--log-format``), ``path`` (append the lines to this file instead of
    stderr; console format unless ``log_format`` says ``json``).
    """

    name = "logging"
    default_priority = 100

    def __init__(
        self,
        *,
        every: int = 20,
        window: int = 20,
        log_format: str | None = None,
        path: str | Path | None = None,
        priority: int | None = None,
    ) -> None:
        super().__init__(priority=priority)
        self.every = int_option(self.name, "every", every)
        self._progress_steps = EventFilter(every=self.every)
        self.window = StepWindow(int_option(self.name, "window", window, minimum=2))
        self.log_format = (
            None
            if log_format is None
            else choice_option(self.name, "log_format", log_format, LOG_FORMATS)
        )
        self.path = path_option(self.name, "path", path)
        self._stream: TextIO | None = None
        self._merger = StepMerger(lambda: self.state)
        self._peak_memory: dict[int, int] = {}
        self._started_at: float | None = None
        self._failure_logged = False
        self._console_shows_run = self.path is None and launcher_console()
        """The launcher's console shows start, progress, evaluations and end: not us."""

    async def setup(self) -> None:
        """Open the log file, if any, and pick the logger."""
        if self.path is not None or self.log_format is not None:
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._stream = self.path.open("a", buffering=1)
            self.log = make_logger(
                self.log_format or "console", self._stream or LOG_STREAM.as_file(), self.name
            )

    async def teardown(self) -> None:
        """Close the log file."""
        if self._stream is not None:
            self._stream.close()

    @on(RunStarted)
    def run_started(self, ev: RunStarted) -> None:
        """A new run: forget the previous one, log its shape."""
        self._merger.reset()
        self.window.clear()
        self._peak_memory.clear()
        self._failure_logged = False
        self._started_at = ev.ts or time.time()
        if self._console_shows_run:
            return
        self.log.info(
            "run started",
            run=_text(ev.name),
            run_id=_text(ev.run_id),
            stages=ev.num_stages,
            **({"data_parallel": ev.data_parallel} if ev.data_parallel > 1 else {}),
            microbatches=ev.num_microbatches,
            schedule=_text(ev.schedule),
            max_steps=ev.max_steps,
            batch_size=ev.batch_size,
            start_step=ev.start_step,
            run_dir=_text(ev.run_dir),
        )

    @on(StageStarted)
    def stage_started(self, ev: StageStarted) -> None:
        """One line per stage as it joins."""
        self.log.info(
            "stage started",
            **place_fields(ev.stage, ev.replica),
            host=_text(ev.host),
            pid=ev.pid,
            device=_text(ev.device),
            layers=ev.layers,
            params=ev.num_params,
        )

    @on(StepEnded)
    def step_ended(self, ev: StepEnded) -> None:
        """Merge the stages' events; every ``every`` steps, log the progress line."""
        for merged in self._merger.add(ev):
            self._account(merged)
            if self._progress_steps(merged) and not self._console_shows_run:
                self._progress(merged)

    def _account(self, merged: MergedStep) -> None:
        self.window.add(merged)
        # A stage's peak is its highest replica's: the one closest to running out.
        for (stage, _), sev in merged.events.items():
            if sev.peak_memory_bytes is not None:
                self._peak_memory[stage] = max(
                    sev.peak_memory_bytes, self._peak_memory.get(stage, 0)
                )

    def _progress(self, merged: MergedStep) -> None:
        run = self.state.run
        max_steps = run.max_steps if run is not None else None
        fields: dict[str, Any] = {
            "step": f"{merged.step}/{max_steps}" if max_steps else str(merged.step),
            "loss": short(merged.loss),
            "lr": short(merged.lr),
        }
        if merged.grad_norm is not None:
            fields["grad_norm"] = short(merged.grad_norm)
        throughput = self.window.samples_per_s()
        fields["samples_per_s"] = None if throughput is None else round(throughput, 1)
        fields["step_time_s"] = short(self.window.step_time_s())
        fields["eta"] = fmt_duration(self.window.eta_s(max_steps))
        if self._peak_memory:
            fields["peak_mem"] = per_stage({s: fmt_bytes(b) for s, b in self._peak_memory.items()})
        self.log.info("progress", **_metric_fields(fields, merged.metrics))

    @on(EvalEnded)
    def eval_ended(self, ev: EvalEnded) -> None:
        """The eval metrics as one line."""
        if self._console_shows_run:
            return
        fields: dict[str, Any] = {
            "step": ev.step,
            "duration_s": short(ev.duration_s),
            "samples": ev.samples,
        }
        # Named sets' metrics carry their own prefix (val/loss, test/loss).
        prefix = "" if ev.sets else "val_"
        self.log.info("eval", **_metric_fields(fields, ev.metrics, prefix=prefix))

    @on(CheckpointCommitted)
    def checkpoint_committed(self, ev: CheckpointCommitted) -> None:
        """A checkpoint became resumable."""
        self.log.info(
            "checkpoint committed",
            step=ev.step,
            reason=_text(ev.reason) or None,
            path=_text(ev.path),
            size=fmt_bytes(ev.bytes),
            duration_s=short(ev.duration_s),
        )

    @on(CheckpointFailed)
    def checkpoint_failed(self, ev: CheckpointFailed) -> None:
        """A checkpoint will never be committed."""
        self.log.warning(
            "checkpoint failed",
            checkpoint=_text(ev.checkpoint_id),
            stage=ev.stage,
            error=_text(ev.error),
        )

    @on(BusGaps)
    def bus_gaps(self, ev: BusGaps) -> None:
        """Some subscriber lost events (this process's own runner already warned)."""
        if ev.source == f"hook/{self.runner.name}":
            return
        self.log.warning(
            "bus gap: events lost",
            from_source=_text(ev.from_source),
            missing=ev.missing,
            total_missing=ev.total_missing,
            observer=_text(ev.source),
        )

    @on(BusDrops)
    def bus_drops(self, ev: BusDrops) -> None:
        """A publisher's queue was full: events never left it."""
        self.log.warning(
            "events dropped by publisher",
            source=_text(ev.source),
            dropped=ev.dropped,
            total_dropped=ev.total_dropped,
        )

    @on(HookError)
    def hook_error(self, ev: HookError) -> None:
        """Another hook's handler raised (it keeps running)."""
        self.log.warning(
            "hook handler raised",
            hook=_text(ev.hook),
            handler=_text(ev.handler),
            event_type=_text(ev.event_type),
            error=_text(ev.error),
            count=ev.count,
        )

    @on(StageFailed)
    def stage_failed(self, ev: StageFailed) -> None:
        """A stage raised: its error and the last lines of the traceback.

        A stage that lost its connection to a failed peer is a consequence, not
        news: one short line, no traceback, so the cause stands out. The
        launcher's console reports the root cause and its consequences itself.
        """
        if self._console_shows_run:
            return
        if is_communication_error(ev.error):
            self.log.warning(
                "stage stopped by a peer's failure",
                **place_fields(ev.stage, ev.replica),
                step=ev.step,
                error=_text(short_error(ev.error)),
            )
            return
        self._failure_logged = True
        tail = safe_lines("\n".join(ev.traceback.strip().splitlines()[-6:]), _TEXT_LIMIT)
        self.log.error(
            "stage failed",
            **place_fields(ev.stage, ev.replica),
            step=ev.step,
            error=_text(ev.error),
            traceback=tail,
        )

    @on(StageStopped)
    def stage_stopped(self, ev: StageStopped) -> None:
        """A stage left the run (a stage that simply completed is no news: debug)."""
        level = self.log.debug if ev.status == "completed" else self.log.info
        level(
            "stage stopped",
            **place_fields(ev.stage, ev.replica),
            status=_text(ev.status),
            reason=_text(ev.reason) or None,
        )

    @on(RunEnded)
    def run_ended(self, ev: RunEnded) -> None:
        """Last progress line for a step not yet printed, then the end of the run."""
        if not self.of_this_run(ev):
            return
        for merged in self._merger.flush():
            self._account(merged)
        if self._console_shows_run:
            return
        elapsed = (ev.ts - self._started_at) if self._started_at and ev.ts else None
        level = "error" if ev.status == "failed" else "info"
        # A failure's reason is the stage error logged just before: say it once.
        reason = None if self._failure_logged else _text(ev.reason) or None
        getattr(self.log, level)(
            "run ended",
            status=ev.status,
            reason=reason,
            step=ev.step,
            elapsed_s=None if elapsed is None else round(elapsed, 1),
            peak_mem=per_stage({s: fmt_bytes(b) for s, b in self._peak_memory.items()}) or None,
        )
