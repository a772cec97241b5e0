"""The metrics log (short name ``metrics``): RUN_DIR/metrics.jsonl, like detectron2's metrics.json.

One JSON object per line:

* per step, once every stage reported it (see `StepMerger`)::

    {"type": "step", "step": 9, "time": 1718000000.1, "epoch": 0, "samples": 64,
     "loss": 0.41, "lr": 0.003, "grad_norm": 1.2, "step_time_s": 0.051,
     "stages": {"0": {"duration_s": 0.05, "forward_s": 0.02, "backward_s": 0.025,
                      "comm_wait_s": 0.004, "peak_memory_bytes": null,
                      "state_bytes": 1048576}, "1": {...}},
     ...values reported with evtrain.report...}

  ``stages`` holds replica 0's times; with data parallelism the other
  replicas' times follow by replica, then stage (one line per step still:
  ``loss`` and ``samples`` are the run's, whichever replica reported them)::

    {"type": "step", "step": 9, ..., "stages": {"0": {...}, "1": {...}},
     "replicas": {"1": {"0": {"duration_s": 0.05, ...}, "1": {...}}}}

* per evaluation::

    {"type": "eval", "step": 49, "time": ..., "duration_s": 0.4, "samples": 256,
     "metrics": {"loss": 0.38, "accuracy": 0.91}}

  with named eval sets the names carry their set's prefix and ``sets`` gives
  each set's samples::

    {"type": "eval", "step": 49, ..., "samples": 384, "sets": {"val": 256, "test": 128},
     "metrics": {"val/loss": 0.38, "val/accuracy": 0.91, "test/loss": 0.41, ...}}

``step`` is the 0-based step index of the events; ``time`` the event's wall
clock. When the stages start over from a checkpoint within one launch (an
elastic restart: a `RunStarted` whose ``start_step`` is below the steps
written), the lines of the steps after it are dropped first, as a resumed
launch's are (`evtrain.launcher.run_record.rewind_metrics`): each step appears once,
from the attempt whose weights went on. Every value comes from the events,
so replaying a recorded run (``evtrain replay RUN_DIR --hook metrics``) writes
the same lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evtrain.events import EvalEnded, RunEnded, RunStarted, StepEnded
from evtrain.formatting import safe_text
from evtrain.hooks.hook import Hook, on
from evtrain.hooks.options import path_option
from evtrain.hooks.run_output import JsonLinesFile, RunOutput, rewind_json_lines
from evtrain.steps import MergedStep, StepMerger

FILENAME = "metrics.jsonl"


def _times(ev: StepEnded) -> dict[str, Any]:
    return {
        "duration_s": ev.duration_s,
        "forward_s": ev.forward_s,
        "backward_s": ev.backward_s,
        "comm_wait_s": ev.comm_wait_s,
        "peak_memory_bytes": ev.peak_memory_bytes,
        "state_bytes": ev.state_bytes,
    }


def step_record(merged: MergedStep) -> dict[str, Any]:
    """The metrics-log line of one merged step."""
    record: dict[str, Any] = {
        "type": "step",
        "step": merged.step,
        "time": merged.ts,
        "epoch": merged.epoch,
        "samples": merged.samples,
        "loss": merged.loss,
        "lr": merged.lr,
        "grad_norm": merged.grad_norm,
        "step_time_s": merged.duration_s,
        "stages": {str(stage): _times(ev) for stage, ev in sorted(merged.stages.items())},
    }
    replicas = merged.replicas()
    if replicas:
        record["replicas"] = {
            str(replica): {str(stage): _times(ev) for stage, ev in stages.items()}
            for replica, stages in replicas.items()
        }
    for key, value in merged.metrics.items():
        record.setdefault(key, value)
    return record


def eval_record(ev: EvalEnded) -> dict[str, Any]:
    """The metrics-log line of one evaluation."""
    record: dict[str, Any] = {
        "type": "eval",
        "step": ev.step,
        "time": ev.ts,
        "duration_s": ev.duration_s,
        "samples": ev.samples,
    }
    if ev.sets:
        record["sets"] = dict(ev.sets)
    record["metrics"] = dict(ev.metrics)
    return record


class MetricsLog(Hook):
    """Write one JSON line per step and per evaluation.

    Options: ``dir`` (write ``DIR/metrics.jsonl``) or ``path`` (this file);
    default ``RUN_DIR/metrics.jsonl``.
    """

    name = "metrics"
    default_priority = 100

    def __init__(
        self,
        *,
        dir: str | Path | None = None,
        path: str | Path | None = None,
        priority: int | None = None,
    ) -> None:
        super().__init__(priority=priority)
        self.output = RunOutput(
            self.name,
            FILENAME,
            path=path_option(self.name, "path", path),
            directory=path_option(self.name, "dir", dir),
        )
        self.file: JsonLinesFile | None = None
        self._merger = StepMerger(lambda: self.state)
        self._last_step = 0
        """The last step written to the open file."""

    def _writer(self) -> JsonLinesFile | None:
        if self.file is None:
            self.file = self.output.open(self.state.run)
            if self.file is not None:
                self.log.info("writing metrics", path=safe_text(self.file.path))
        return self.file

    @on(RunStarted)
    def run_started(self, ev: RunStarted) -> None:
        """A new run: pending steps of the old one are gone; its run_dir may differ."""
        self._merger.reset()
        if self.file is not None and self.output.fixed is None:
            new = self.output.resolve(ev)
            if new != self.file.path:
                self.file.close()
                self.file = None
                self._last_step = 0
        if self.file is not None and ev.start_step < self._last_step:
            self.file.flush()
            dropped = rewind_json_lines(self.file.path, ev.start_step)
            self.log.info(
                "metrics rewound to the restart", step=ev.start_step, lines_dropped=dropped
            )
            self._last_step = ev.start_step

    @on(StepEnded)
    def step_ended(self, ev: StepEnded) -> None:
        """Write the steps this event completed."""
        for merged in self._merger.add(ev):
            self._write(step_record(merged))
            self._last_step = max(self._last_step, merged.step)

    @on(EvalEnded)
    def eval_ended(self, ev: EvalEnded) -> None:
        """Write the evaluation."""
        if not self.of_this_run(ev):
            return
        self._write(eval_record(ev))

    @on(RunEnded)
    def run_ended(self, ev: RunEnded) -> None:
        """Write steps some stage never reported (lost events), then flush."""
        if not self.of_this_run(ev):
            return
        for merged in self._merger.flush():
            self._write(step_record(merged))
            self._last_step = max(self._last_step, merged.step)
        if self.file is not None:
            self.file.flush()

    def _write(self, record: dict[str, Any]) -> None:
        writer = self._writer()
        if writer is not None:
            writer.write(record)

    async def teardown(self) -> None:
        """Close the file."""
        if self.file is not None:
            self.file.close()
