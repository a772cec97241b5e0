"""Stragglers: a stage, replica or tensor rank whose steps run persistently slower than
its peers'.

A pipeline runs at the pace of its slowest stage, and the others wait on it:
their step times grow with its own, so step time alone does not tell which
stage is slow. Busy time does: on a device, a step's duration less the time
spent blocked on other stages (`evtrain.events.StepEnded.comm_wait_s`); on
the CPU, the CPU time of the thread that ran the step (`StepEnded.cpu_s`),
which a thread waiting for a core does not accrue — processes that share
cores would otherwise be named in turn.

* **Replicas** of one stage do the same work: a replica whose work is more
  than `SLOWER` times the median of its stage's other replicas', over the
  last `WINDOW` steps, is a straggler from the first steps on. On a device
  its work is its forward time, not its busy time: the replicas' gradient
  all-reduce completes inside the last backward, where the fast replicas
  wait for the slow one.
* **Stages** do different work (the split is never perfectly even), so each
  stage is measured against its own start: its busy time over the median of
  the other stages', over `BASELINE` steps after `WARMUP`. A stage whose
  ratio, over the last `WINDOW` steps, has grown more than `SLOWER` times
  is a straggler: it slowed down and the others did not (a machine-wide
  slowdown names nobody). A stage slow from its first step is the split's
  imbalance, which ``evtrain top`` shows.

* **Tensor ranks** of one replica do the same work, and a tensor rank above 0
  publishes its own times (`evtrain.events.TensorRankStepEnded`): on the CPU,
  a tensor rank whose CPU time is more than `SLOWER` times the median of its
  replica's other tensor ranks' is named alone, as a replica is. On a device
  its forward waits inside its all-reduces for the slowest tensor rank, so
  their host times are alike: a slow tensor rank slows its whole replica, and
  is named as that replica (or stage).

Either way only one that costs the step at least `MIN_SHARE` of its time is
named. A straggler is named once it is one, and again once it is not any more
(below `RECOVERED`): `StragglerWatch.step_ended` returns the change, which
the launcher prints (the first time) and publishes
(`evtrain.events.StragglerReported`); the exporter keeps it as
``evtrain_straggler``. Steps whose events did not all arrive are skipped.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from evtrain.events import RunStarted, StepEnded, StragglerReported, TensorRankStepEnded
from evtrain.steps import work_seconds

__all__ = [
    "BASELINE",
    "RECOVERED",
    "SLOWER",
    "WARMUP",
    "WINDOW",
    "StragglerNotices",
    "StragglerWatch",
]

WARMUP = 2
"""Steps not measured at the start (shape agreement, first allocations, compilation)."""
BASELINE = 10
"""Steps after `WARMUP` that set each stage's ratio to its peers."""
WINDOW = 10
"""Steps whose median is compared: one slow step is no straggler."""
SLOWER = 2.0
"""How much slower than expected a straggler is. Processes that share cores drift by
half that from their start, with nothing wrong."""
RECOVERED = 1.5
"""How much slower than expected a straggler may still be once it is not one any more."""
MIN_SHARE = 0.1
"""A straggler costs the step at least this share of its time (the median over the window
of its extra time over the step's duration): a tiny forward twice as slow as its peers'
costs nothing and is mostly timer and scheduling noise."""
_PENDING_STEPS = 16
"""Incomplete steps kept while waiting for their last events."""

Place = tuple[int, int, int]
"""(stage, replica, tensor rank)."""


@dataclass
class _Series:
    """One stage's (or replica's) ratios to its peers, recent first out."""

    baseline: list[float] = field(default_factory=list)
    recent: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    """(ratio to its peers, extra time over the step's duration) of the recent steps."""
    straggling: bool = False


class StragglerWatch:
    """Finds stragglers among ``stages`` x ``replicas`` x ``tensor_ranks`` from their
    `StepEnded` (and `TensorRankStepEnded`) events."""

    def __init__(
        self, stages: int, replicas: int, *, tensor_ranks: int = 1, start_step: int = 0
    ) -> None:
        self.stages = stages
        self.replicas = replicas
        self.tensor_ranks = tensor_ranks
        self.start_step = start_step
        self._steps: dict[int, dict[Place, tuple[float, float, float]]] = {}
        """Each incomplete step's (duration, busy, work) seconds by process: what
        stages, replicas and tensor ranks are compared by."""
        self._stage_series = {s: _Series() for s in range(stages)}
        self._replica_series: dict[Place, _Series] = {}
        self._tensor_series: dict[Place, _Series] = {}

    def step_ended(self, ev: StepEnded | TensorRankStepEnded) -> list[StragglerReported]:
        """Fold ``ev`` in; what changed once its step is complete."""
        tp = ev.tp if isinstance(ev, TensorRankStepEnded) else 0
        if not (
            0 <= ev.stage < self.stages
            and 0 <= ev.replica < self.replicas
            and 0 <= tp < self.tensor_ranks
        ):
            return []
        if ev.step <= self.start_step + WARMUP:
            return []
        busy = ev.cpu_s if ev.cpu_s > 0 else max(ev.duration_s - ev.comm_wait_s, 0.0)
        own = work_seconds(ev)
        step = self._steps.setdefault(ev.step, {})
        step[(ev.stage, ev.replica, tp)] = (ev.duration_s, busy, own)
        if len(step) < self.stages * self.replicas * self.tensor_ranks:
            for old in sorted(self._steps)[:-_PENDING_STEPS]:
                del self._steps[old]  # its other events were lost
            return []
        del self._steps[ev.step]
        duration = max(d for d, _, _ in step.values())
        work = {place: w for place, (_, _, w) in step.items()}
        changes = []
        if self.tensor_ranks > 1 and ev.cpu_s > 0:
            changes += self._among_peers(ev.step, work, self._tensor_series, duration, tensor=True)
        # Replicas and stages by their tensor rank 0: a slow tensor rank is its own.
        firsts = {place: w for place, w in work.items() if place[2] == 0}
        if self.replicas > 1:
            changes += self._among_peers(ev.step, firsts, self._replica_series, duration)
        busy_s = {(s, r): b for (s, r, t), (_, b, _) in step.items() if t == 0}
        return changes + self._stages(ev.step, busy_s, duration)

    def _among_peers(
        self,
        step: int,
        work: dict[Place, float],
        series: dict[Place, _Series],
        duration: float,
        *,
        tensor: bool = False,
    ) -> list[StragglerReported]:
        """Each process's work against the median of its peers': the other tensor ranks
        of its replica (``tensor``), or the other replicas of its stage."""

        def peers(place: Place) -> tuple[int, ...]:
            return place[:2] if tensor else place[:1]

        changes = []
        for place, own in sorted(work.items()):
            others = [w for p, w in work.items() if p != place and peers(p) == peers(place)]
            expected = statistics.median(others)
            ratio = own / expected if expected > 0 else 1.0
            own_series = series.setdefault(place, _Series())
            own_series.recent.append((ratio, _share(own - expected, duration)))
            change = _judge(own_series, 1.0)
            if change is not None:
                stage, replica, tp = place
                changes.append(_report(step, stage, replica, *change, tp=tp if tensor else None))
        return changes

    def _stages(
        self, step: int, busy: dict[tuple[int, int], float], duration: float
    ) -> list[StragglerReported]:
        if self.stages < 2:
            return []
        # A stage's replicas do the same work: their median is the stage's time.
        per_stage = {
            s: statistics.median(b for (stage, _), b in busy.items() if stage == s)
            for s in range(self.stages)
        }
        changes = []
        for stage, own in per_stage.items():
            expected = statistics.median(b for s, b in per_stage.items() if s != stage)
            ratio = own / expected if expected > 0 else 1.0
            series = self._stage_series[stage]
            if len(series.baseline) < BASELINE:
                series.baseline.append(ratio)
                continue
            usual = statistics.median(series.baseline)
            series.recent.append((ratio, _share(own - usual * expected, duration)))
            change = _judge(series, usual)
            if change is not None:
                changes.append(_report(step, stage, None, *change))
        return changes


def _share(extra_s: float, duration: float) -> float:
    return extra_s / duration if duration > 0 else 0.0


def _judge(series: _Series, usual: float) -> tuple[float, bool] | None:
    """(slowdown, straggling) when ``series`` became or stopped being a straggler, else
    None. ``usual``: its usual ratio to its peers."""
    if len(series.recent) < WINDOW or usual <= 0:
        return None
    slowdown = statistics.median(r for r, _ in series.recent) / usual
    costly = statistics.median(share for _, share in series.recent) >= MIN_SHARE
    if not series.straggling and slowdown > SLOWER and costly:
        series.straggling = True
    elif series.straggling and slowdown < RECOVERED:
        series.straggling = False
    else:
        return None
    return slowdown, series.straggling


def _report(
    step: int,
    stage: int,
    replica: int | None,
    slowdown: float,
    straggling: bool,
    *,
    tp: int | None = None,
) -> StragglerReported:
    return StragglerReported(
        step=step,
        stage=stage,
        replica=replica or 0,
        whole_stage=replica is None,
        tp=tp,
        slowdown=round(slowdown, 3),
        straggling=straggling,
    )


class StragglerNotices:
    """Node 0's stragglers of the current attempt: each change published, each
    straggler named on the console once."""

    def __init__(
        self, send: Callable[[StragglerReported], None], warn: Callable[[str], None]
    ) -> None:
        self._send = send
        self._warn = warn
        self._watch: StragglerWatch | None = None
        self._named: set[tuple[int, int | None, int | None]] = set()

    def run_started(self, msg: RunStarted) -> None:
        # Each attempt starts over: its processes may be other ones.
        self._watch = StragglerWatch(
            msg.num_stages,
            msg.data_parallel,
            tensor_ranks=msg.tensor_parallel,
            start_step=msg.start_step,
        )

    def step_ended(self, msg: StepEnded | TensorRankStepEnded) -> None:
        if self._watch is None:
            return
        for change in self._watch.step_ended(msg):
            self._send(change)
            key = (change.stage, None if change.whole_stage else change.replica, change.tp)
            if change.straggling and key not in self._named:
                self._named.add(key)
                self._warn(change.describe())
