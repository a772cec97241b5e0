"""Memory monitor (short name ``memory``): peak memory per stage, warning above a threshold.

Reads ``peak_memory_bytes`` from every stage's `StepEnded` (accelerator memory
on CUDA, what the stage reports on CPU). Logs a stage's peak when it first
appears and whenever it grew by more than ``growth`` since the last line; warns
once per stage when the peak passes ``threshold``; summarizes at run end.
With data parallelism a stage's peak is that of its highest replica (each
replica has its own device; the fullest one runs out first), and the lines
name that replica when it is not 0.
"""

from __future__ import annotations

from evtrain.events import RunEnded, RunStarted, StepEnded
from evtrain.formatting import fmt_bytes, per_stage
from evtrain.hooks.hook import Hook, on
from evtrain.hooks.options import float_option, size_option
from evtrain.steps import place_fields, step_problem


class MemoryMonitor(Hook):
    """Track peak memory per stage.

    Options: ``threshold`` (bytes, or text like ``"8GiB"``; warn above it;
    default none), ``growth`` (fractional growth of a stage's peak that is
    logged again, default 0.1).
    """

    name = "memory"
    default_priority = 100

    def __init__(
        self,
        *,
        threshold: int | str | None = None,
        growth: float = 0.1,
        priority: int | None = None,
    ) -> None:
        super().__init__(priority=priority)
        self.threshold = size_option(self.name, "threshold", threshold)
        self.growth = float_option(self.name, "growth", growth)
        self.peak: dict[int, int] = {}
        self.warned: set[int] = set()
        self._logged: dict[int, int] = {}
        self._run_id: str | None = None

    @on(RunStarted)
    def run_started(self, ev: RunStarted) -> None:
        """A new run: new peaks."""
        self._enter_run(ev.run_id)

    def _enter_run(self, run_id: str) -> None:
        # Whichever event of a run comes first: a stage's step can overtake the
        # run's start on the bus, and must not be forgotten when the start comes.
        if run_id != self._run_id:
            self._run_id = run_id
            self.peak.clear()
            self.warned.clear()
            self._logged.clear()

    @on(StepEnded)
    def step_ended(self, ev: StepEnded) -> None:
        """Fold in the stage's peak; log growth, warn above the threshold."""
        if ev.peak_memory_bytes is None or step_problem(ev, self.state) is not None:
            return
        self._enter_run(ev.run_id)
        peak = max(ev.peak_memory_bytes, self.peak.get(ev.stage, 0))
        self.peak[ev.stage] = peak
        logged = self._logged.get(ev.stage)
        if logged is None or peak > logged * (1 + self.growth):
            self._logged[ev.stage] = peak
            self.log.info(
                "peak memory",
                **place_fields(ev.stage, ev.replica),
                step=ev.step,
                peak=fmt_bytes(peak),
                peak_bytes=peak,
            )
        if self.threshold is not None and peak > self.threshold and ev.stage not in self.warned:
            self.warned.add(ev.stage)
            self.log.warning(
                "peak memory above threshold",
                **place_fields(ev.stage, ev.replica),
                step=ev.step,
                peak=fmt_bytes(peak),
                threshold=fmt_bytes(self.threshold),
                peak_bytes=peak,
            )

    @on(RunEnded)
    def run_ended(self, ev: RunEnded) -> None:
        """The run's peak per stage."""
        if not self.of_this_run(ev):
            return
        if self.peak:
            self.log.info(
                "peak memory per stage",
                peaks=per_stage({s: fmt_bytes(b) for s, b in self.peak.items()}),
            )
