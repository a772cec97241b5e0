"""TensorBoard scalars (short name ``tensorboard``; needs the ``tensorboard`` extra).

Writes, with `torch.utils.tensorboard.SummaryWriter`, at the step number of
the events (steps done, so the first step is 1):

* ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/samples_per_s``,
  ``train/step_time_s`` and every value reported with `evtrain.report` as
  ``train/NAME``;
* ``stage{s}/forward_s``, ``stage{s}/backward_s``, ``stage{s}/comm_wait_s``,
  ``stage{s}/duration_s``, ``stage{s}/peak_memory_bytes``; with data
  parallelism these are replica 0's, and replica ``d`` > 0 has its own under
  ``stage{s}_replica{d}/``;
* ``eval/NAME`` for every eval metric; with named eval sets the name carries
  its set (``eval/val/accuracy``, ``eval/test/loss``): under ``eval/``, a set
  called ``train`` stays apart from the training scalars.

torch and tensorboard are imported only when the hook is built, and a missing
``tensorboard`` package is a `UsageError` naming the extra to install.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evtrain.errors import UsageError
from evtrain.events import EvalEnded, RunEnded, RunStarted, StepEnded
from evtrain.hooks.hook import Hook, on
from evtrain.hooks.options import int_option, path_option
from evtrain.steps import MergedStep, StepMerger, StepWindow

DIRNAME = "tensorboard"


def _summary_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise UsageError(
            "hook tensorboard needs the tensorboard package: "
            f"pip install 'evtrain[tensorboard]' ({exc})"
        ) from None
    return SummaryWriter


class TensorBoardWriter(Hook):
    """Write training, per-stage and eval scalars for TensorBoard.

    Options: ``dir`` (the log directory; default ``RUN_DIR/tensorboard``),
    ``flush_secs`` (default 10).
    """

    name = "tensorboard"
    default_priority = 100

    def __init__(
        self,
        *,
        dir: str | Path | None = None,
        flush_secs: int = 10,
        priority: int | None = None,
    ) -> None:
        super().__init__(priority=priority)
        self._writer_class = _summary_writer_class()
        self.dir = path_option(self.name, "dir", dir)
        self.flush_secs = int_option(self.name, "flush_secs", flush_secs)
        self.writer: Any = None
        self._merger = StepMerger(lambda: self.state)
        self._window = StepWindow(20)

    def _open(self) -> Any:
        if self.writer is None:
            logdir = self.dir
            run = self.state.run
            if logdir is None and run is not None and run.run_dir:
                logdir = Path(run.run_dir) / DIRNAME
            if logdir is None:
                return None
            self.writer = self._writer_class(log_dir=str(logdir), flush_secs=self.flush_secs)
            self.log.info("writing tensorboard scalars", dir=str(logdir))
        return self.writer

    @on(RunStarted)
    def run_started(self, ev: RunStarted) -> None:
        """A new run: forget pending steps."""
        self._merger.reset()
        self._window.clear()

    @on(StepEnded)
    def step_ended(self, ev: StepEnded) -> None:
        """Scalars of every completed step."""
        for merged in self._merger.add(ev):
            self._write_step(merged)

    def _write_step(self, merged: MergedStep) -> None:
        self._window.add(merged)
        writer = self._open()
        if writer is None:
            return
        x = merged.step
        scalars: dict[str, float | None] = {
            "train/loss": merged.loss,
            "train/lr": merged.lr,
            "train/grad_norm": merged.grad_norm,
            "train/samples_per_s": self._window.samples_per_s(),
            "train/step_time_s": merged.duration_s,
        }
        scalars.update({f"train/{k}": v for k, v in merged.metrics.items()})
        for (stage, replica), sev in merged.events.items():
            group = f"stage{stage}_replica{replica}" if replica else f"stage{stage}"
            scalars[f"{group}/duration_s"] = sev.duration_s
            scalars[f"{group}/forward_s"] = sev.forward_s
            scalars[f"{group}/backward_s"] = sev.backward_s
            scalars[f"{group}/comm_wait_s"] = sev.comm_wait_s
            if sev.peak_memory_bytes is not None:
                scalars[f"{group}/peak_memory_bytes"] = float(sev.peak_memory_bytes)
        for tag, value in scalars.items():
            if value is not None:
                writer.add_scalar(tag, value, x, walltime=merged.ts or None)

    @on(EvalEnded)
    def eval_ended(self, ev: EvalEnded) -> None:
        """One scalar per eval metric."""
        if not self.of_this_run(ev):
            return
        writer = self._open()
        if writer is None:
            return
        for key, value in ev.metrics.items():
            writer.add_scalar(f"eval/{key}", value, ev.step, walltime=ev.ts or None)

    @on(RunEnded)
    def run_ended(self, ev: RunEnded) -> None:
        """Write steps some stage never reported (lost events), then flush."""
        if not self.of_this_run(ev):
            return
        for merged in self._merger.flush():
            self._write_step(merged)
        if self.writer is not None:
            self.writer.flush()

    async def teardown(self) -> None:
        """Close the event file."""
        if self.writer is not None:
            self.writer.close()
