"""The Prometheus exporter's metrics, declared once: the exporter builds them from
`CATALOGUE`, and docs/reference.md's metrics table is checked against it.

Names follow the Prometheus conventions: ``evtrain_`` prefix, base units
(seconds, bytes, ratios), ``_total`` on counters (prometheus-client adds it
to `MetricSpec.name`), and only bounded labels (`STAGE_LABELS` is one series
per stage process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["CATALOGUE", "STAGE_LABELS", "TENSOR_RANK_LABELS", "MetricSpec", "Metrics"]

STAGE_LABELS = ("stage", "replica")
"""The labels of every per-stage series: one series per stage process."""
TENSOR_RANK_LABELS = (*STAGE_LABELS, "tp")
"""The labels of the per-tensor-rank series: one series per process of a run with tensor
parallelism (a stage process is its tensor rank 0)."""
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CHECKPOINT_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class MetricSpec:
    """One metric: the exporter's name for it, what it is called and what it means."""

    attr: str
    """The attribute of `Metrics` that holds it."""
    name: str
    """The registered name (a counter is exposed as ``NAME_total``)."""
    kind: Literal["counter", "gauge", "histogram"]
    labels: tuple[str, ...]
    meaning: str
    """One line for ``# HELP`` and the docs (Markdown)."""
    buckets: tuple[float, ...] | None = None

    @property
    def exposed(self) -> str:
        """The name a scrape shows (histograms add ``_bucket``/``_sum``/``_count``)."""
        return self.name + "_total" if self.kind == "counter" else self.name

    def create(self, registry: CollectorRegistry) -> Any:
        text = self.meaning.replace("`", "")
        text = text[0].upper() + text[1:] + "."
        if self.kind == "counter":
            return Counter(self.name, text, self.labels, registry=registry)
        if self.kind == "gauge":
            return Gauge(self.name, text, self.labels, registry=registry)
        assert self.buckets is not None
        return Histogram(self.name, text, self.labels, buckets=self.buckets, registry=registry)


CATALOGUE: tuple[MetricSpec, ...] = (
    MetricSpec("steps", "evtrain_steps", "counter", (), "optimizer steps finished"),
    MetricSpec("samples", "evtrain_samples", "counter", (), "training samples consumed"),
    MetricSpec(
        "steps_done",
        "evtrain_steps_done",
        "gauge",
        (),
        "steps done in the run, counting resumed ones",
    ),
    MetricSpec("max_steps", "evtrain_run_max_steps", "gauge", (), "the run's max_steps"),
    MetricSpec("num_stages", "evtrain_run_stages", "gauge", (), "pipeline stages of the run"),
    MetricSpec(
        "running", "evtrain_run_running", "gauge", (), "1 between run.started and run.ended"
    ),
    MetricSpec(
        "start_time", "evtrain_run_start_time_seconds", "gauge", (), "Unix time the run started"
    ),
    MetricSpec(
        "run_info",
        "evtrain_run_info",
        "gauge",
        ("run_id", "name", "schedule", "stages", "replicas", "tensor_ranks"),
        "1 for the run being watched: its id, name, schedule and shape (stages x replicas x "
        "tensor ranks); one series at a time",
    ),
    MetricSpec(
        "build_info",
        "evtrain_build_info",
        "gauge",
        ("version",),
        "1, labelled with evtrain's version",
    ),
    MetricSpec(
        "last_step_time",
        "evtrain_last_step_timestamp_seconds",
        "gauge",
        (),
        "Unix time the latest step of the run ended",
    ),
    MetricSpec(
        "runs_ended",
        "evtrain_runs_ended",
        "counter",
        ("status",),
        "runs that ended: completed, stopped, failed",
    ),
    MetricSpec("loss", "evtrain_loss", "gauge", (), "training loss of the latest step"),
    MetricSpec("grad_norm", "evtrain_grad_norm", "gauge", (), "gradient norm of the latest step"),
    MetricSpec(
        "lr", "evtrain_learning_rate", "gauge", STAGE_LABELS, "learning rate of the latest step"
    ),
    MetricSpec(
        "step_metric",
        "evtrain_step_metric",
        "gauge",
        ("metric",),
        "values reported with `evtrain.report` during a step",
    ),
    MetricSpec(
        "step_duration",
        "evtrain_step_duration_seconds",
        "histogram",
        STAGE_LABELS,
        "step time per stage",
        buckets=STEP_BUCKETS,
    ),
    MetricSpec(
        "forward", "evtrain_forward_seconds", "counter", STAGE_LABELS, "time in forward computation"
    ),
    MetricSpec(
        "backward",
        "evtrain_backward_seconds",
        "counter",
        STAGE_LABELS,
        "time in backward computation",
    ),
    MetricSpec(
        "comm_wait",
        "evtrain_comm_wait_seconds",
        "counter",
        STAGE_LABELS,
        "time blocked on point-to-point communication",
    ),
    MetricSpec(
        "bubble",
        "evtrain_bubble_ratio",
        "gauge",
        STAGE_LABELS,
        "comm wait / step time over the latest steps",
    ),
    MetricSpec(
        "peak_memory",
        "evtrain_peak_memory_bytes",
        "gauge",
        STAGE_LABELS,
        "peak memory the stage reported (CUDA: max allocated; CPU: peak RSS)",
    ),
    MetricSpec(
        "state_bytes",
        "evtrain_stage_state_bytes",
        "gauge",
        STAGE_LABELS,
        "parameters and optimizer state the process holds (its shards when sharded)",
    ),
    MetricSpec("evals", "evtrain_evals", "counter", (), "evaluations finished"),
    MetricSpec(
        "eval_metric",
        "evtrain_eval_metric",
        "gauge",
        ("set", "metric"),
        "latest evaluation results (loss, accuracy...); `set` is the eval set's name, "
        "empty for a single unnamed set",
    ),
    MetricSpec(
        "eval_duration",
        "evtrain_eval_duration_seconds",
        "gauge",
        (),
        "duration of the latest evaluation",
    ),
    MetricSpec(
        "eval_step", "evtrain_eval_last_step", "gauge", (), "steps done at the latest evaluation"
    ),
    MetricSpec("checkpoints", "evtrain_checkpoints", "counter", (), "checkpoints committed"),
    MetricSpec(
        "checkpoint_time",
        "evtrain_checkpoint_last_timestamp_seconds",
        "gauge",
        (),
        "Unix time the latest checkpoint was committed",
    ),
    MetricSpec(
        "checkpoint_failures",
        "evtrain_checkpoint_failures",
        "counter",
        (),
        "checkpoint shards that failed",
    ),
    MetricSpec(
        "checkpoint_duration",
        "evtrain_checkpoint_duration_seconds",
        "histogram",
        (),
        "time from checkpoint request to commit",
        buckets=CHECKPOINT_BUCKETS,
    ),
    MetricSpec(
        "checkpoint_step",
        "evtrain_checkpoint_last_step",
        "gauge",
        (),
        "steps done at the last committed checkpoint",
    ),
    MetricSpec(
        "checkpoint_size",
        "evtrain_checkpoint_size_bytes",
        "gauge",
        (),
        "size of the last committed checkpoint",
    ),
    MetricSpec(
        "checkpoint_blocked",
        "evtrain_checkpoint_blocked_seconds",
        "counter",
        STAGE_LABELS,
        "training time checkpoint saves blocked",
    ),
    MetricSpec(
        "dropped",
        "evtrain_events_dropped",
        "counter",
        ("source",),
        "events a publisher dropped (queue full)",
    ),
    MetricSpec(
        "missing",
        "evtrain_events_missing",
        "counter",
        ("source", "observer"),
        "sequence gaps: events of `source` that subscriber `observer` never received",
    ),
    MetricSpec(
        "hook_errors", "evtrain_hook_errors", "counter", ("hook",), "hook handlers that raised"
    ),
    MetricSpec(
        "stage_up",
        "evtrain_stage_up",
        "gauge",
        STAGE_LABELS,
        "1 while the stage is alive (started, not stopped or failed, heard from recently)",
    ),
    MetricSpec(
        "stage_last_seen",
        "evtrain_stage_last_seen_timestamp_seconds",
        "gauge",
        STAGE_LABELS,
        "Unix time of the stage's latest event",
    ),
    MetricSpec(
        "stage_failures", "evtrain_stage_failures", "counter", STAGE_LABELS, "stage failures"
    ),
    MetricSpec(
        "instruction",
        "evtrain_stage_instruction_seconds",
        "gauge",
        (*STAGE_LABELS, "instruction"),
        "seconds the stage has been in its current instruction, as of its latest heartbeat "
        "(`instruction`: Forward, RecvGrad, LoadBatch, SaveCheckpoint..., idle between "
        "steps; one series per stage)",
    ),
    MetricSpec(
        "straggler",
        "evtrain_straggler",
        "gauge",
        STAGE_LABELS,
        "1 while the stage process is a straggler: its stage slower than the other stages "
        "relative to the start, it slower than its stage's other replicas, or one of its "
        "tensor ranks slower than the others",
    ),
    MetricSpec(
        "tensor_rank_work",
        "evtrain_tensor_rank_work_seconds",
        "counter",
        TENSOR_RANK_LABELS,
        "each tensor rank's own work in steps (CPU seconds on the CPU, forward seconds on a "
        "device), what tensor ranks are compared by; with tensor parallelism only",
    ),
    MetricSpec(
        "tensor_rank_peak_memory",
        "evtrain_tensor_rank_peak_memory_bytes",
        "gauge",
        TENSOR_RANK_LABELS,
        "peak memory each tensor rank reported (CUDA: max allocated; CPU: peak RSS); "
        "with tensor parallelism only",
    ),
    MetricSpec(
        "tensor_rank_straggler",
        "evtrain_tensor_rank_straggler",
        "gauge",
        TENSOR_RANK_LABELS,
        "1 while the tensor rank is a straggler: its CPU time above its replica's other "
        "tensor ranks'; with tensor parallelism only",
    ),
    MetricSpec(
        "hangs",
        "evtrain_hangs_reported",
        "counter",
        (),
        "hangs the launcher reported: no stage progressed for the hang timeout",
    ),
)


class Metrics:
    """The metrics of one registry, each under its `MetricSpec.attr`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        for spec in CATALOGUE:
            setattr(self, spec.attr, spec.create(registry))

    def __getattr__(self, name: str) -> Any:
        # Only reached for a name the catalogue does not define.
        raise AttributeError(f"no metric {name!r} in the catalogue")
