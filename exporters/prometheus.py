"""The Prometheus exporter (short name ``prometheus``): serves ``/metrics`` over HTTP.

One hook process owns its own `CollectorRegistry`, keeps it up to date from the
events and serves it with prometheus-client's WSGI app on ``addr``
(default loopback) and ``port`` (default 9431; 0 picks a free port). The bound
port is logged and written to ``RUN_DIR/prometheus.port`` (or
``DIR/prometheus.port`` with the ``dir`` option) so tools and tests find it.

The metrics and their meanings are declared in
`evtrain.exporters.prometheus_catalogue` (and listed in docs/reference.md).
Labels are bounded: ``stage`` and ``replica`` (one series per stage process),
``metric`` (eval or reported metric names, capped at `MAX_LABEL_VALUES`),
``set`` (named eval sets, capped alike), ``source``/``observer`` (bus
processes), ``hook``, ``status`` — never a step number or run id.

Data parallelism: a run of P stages x D replicas (``RunStarted.data_parallel``)
has P x D stage processes, each with its own series; a run without replicas
has ``replica="0"`` only. A (stage, replica) pair has series only within the
run's P x D once `RunStarted` told them, at most `MAX_PLACES` pairs. The
run-wide figures (steps, samples, loss, gradient norm, reported values) come
from replica 0's events alone: every replica reports the same step, the global
batch and the mean loss, so counting theirs too would count each step D times.
Checkpoint shards are replica 0's, so is its blocked time. A stage process
publishes as ``stage/S`` (replica 0) or ``stage/S/D``: those are the
``source`` values of its drop and gap series.

Bubble ratio: the fraction of a stage's step time spent blocked on
point-to-point receives/sends (``comm_wait_s / duration_s``, summed over the
last ``window`` steps) — the pipeline bubble as that stage experiences it,
and what 1F1B/GPipe theory predicts as (P-1)/(M+P-1). Over any range the same
ratio is ``rate(evtrain_comm_wait_seconds_total[5m]) /
rate(evtrain_step_duration_seconds_sum[5m])``.

Stage up: 1 once the stage process started, as long as any event of it
(heartbeat, step, stage.started) arrived within ``stale_after`` seconds; 0
after it stopped or failed, when the run ended, or when it went silent.

Counters never decrease and never take a poisoned value. Steps are counted
by how far each step number is ahead of the latest (`StepCount`: a jump
counts at most `MAX_STEP_JUMP` steps, and an absurd number cannot freeze the
count); step events that are none of the run's steps (`step_problem`) count
nothing. ``samples`` count only up to `MAX_STEP_SAMPLES` per step, drops and
gaps only up to `MAX_GAP` per report; seconds are finite and bounded by the
event schema. What is not counted is logged with a rate limit.

Labelled counters start at 0 for the label values known in advance, so a
dashboard shows 0 rather than no data: every status of
``evtrain_runs_ended_total``; each stage process of the run once `RunStarted`
told their number (``stage`` counters, ``stage/S`` and ``stage/S/D``
sources); and every hook and observer that announced itself with
`HookStarted`. Each label takes at most `MAX_LABEL_VALUES` distinct values
(`safe_text`, cut to `MAX_LABEL_LENGTH`) and the gap counter at most
`MAX_GAP_SERIES` (source, observer) pairs; the series of stage processes a
new run does not have are dropped at its `RunStarted`.

The last scrape: after ``run.ended`` the hook keeps serving until Prometheus
(a request with its ``User-Agent``) collected the final values, at most
twice the scrape interval it observed (`MAX_LINGER` seconds at most, or the
``linger`` option); never scraped by Prometheus, it stops at once.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import itertools
import socket
import statistics
import threading
import time
import typing
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import anyio
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from evtrain.bus.sequence import MAX_GAP
from evtrain.errors import UsageError
from evtrain.events import (
    MAX_SECONDS,
    BusDrops,
    BusGaps,
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointShardSaved,
    EvalEnded,
    Event,
    HangReported,
    Heartbeat,
    HookError,
    HookStarted,
    RunEnded,
    RunStarted,
    StageFailed,
    StageStarted,
    StageStopped,
    StepEnded,
    StragglerReported,
    TensorRankStepEnded,
    doing_kind,
)
from evtrain.exporters.prometheus_catalogue import Metrics
from evtrain.formatting import safe_text
from evtrain.hooks.hook import Hook, on
from evtrain.hooks.options import float_option, int_option, path_option, str_option
from evtrain.hooks.run_output import RunOutput
from evtrain.ratelimit import RateLimitedLog
from evtrain.run_state import MAX_PLACES, stage_source
from evtrain.steps import StageReplica, StepCount, place_fields, step_problem, work_seconds

DEFAULT_PORT = 9431
"""Not 9400: NVIDIA's DCGM exporter, common on GPU machines, listens there."""

PORT_FILENAME = "prometheus.port"
MAX_LABEL_VALUES = 200
"""Distinct values of one label (metric names, stages, sources, hooks): a bug in user
code or a made-up event cannot explode the series."""
MAX_LABEL_LENGTH = 200
MAX_GAP_SERIES = 1000
"""Distinct (source, observer) pairs of ``evtrain_events_missing_total``."""
MAX_STEP_SAMPLES = 2**32
"""Most samples one optimizer step may count (more than any batch)."""
PROMETHEUS_USER_AGENT = "Prometheus/"
"""How the ``User-Agent`` of Prometheus's scrapes begins."""
MAX_LINGER = 30.0
"""Longest wait for the last scrape after the run ended."""
_SERVE_GRACE = 0.2
"""Seconds to let the last scrape's response leave after it was collected."""
RUN_STATUSES: tuple[str, ...] = typing.get_args(typing.get_type_hints(RunEnded)["status"])


class _StageLiveness:
    """When each stage process was last heard from and whether it left; read by scrapes."""

    def __init__(self, stale_after: float) -> None:
        self.stale_after = stale_after
        self._lock = threading.Lock()
        self._seen: dict[StageReplica, float] = {}
        self._down: set[StageReplica] = set()

    def seen(self, place: StageReplica) -> None:
        with self._lock:
            self._seen[place] = time.monotonic()
            self._down.discard(place)

    def down(self, place: StageReplica) -> None:
        with self._lock:
            self._down.add(place)

    def all_down(self) -> None:
        with self._lock:
            self._down.update(self._seen)

    def forget(self, place: StageReplica) -> None:
        with self._lock:
            self._seen.pop(place, None)
            self._down.discard(place)

    def up(self, place: StageReplica) -> float:
        with self._lock:
            last = self._seen.get(place)
            if last is None or place in self._down:
                return 0.0
            return 1.0 if time.monotonic() - last <= self.stale_after else 0.0


class _Labels:
    """The values one label took, at most `MAX_LABEL_VALUES`."""

    def __init__(self) -> None:
        self.values: set[str] = set()

    def admit(self, value: str) -> str | None:
        """``value`` as the label takes it (`safe_text`, cut), or None when the label is full."""
        value = safe_text(value, MAX_LABEL_LENGTH)
        if value in self.values:
            return value
        if len(self.values) >= MAX_LABEL_VALUES:
            return None
        self.values.add(value)
        return value


class _Scrapes:
    """When Prometheus scraped: a request whose ``User-Agent`` is Prometheus's, noted
    once its response was made. Any other reader of /metrics (a curl, a test) is no
    scrape: the values it saw never reach the time-series database."""

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=16)
        self._lock = threading.Lock()

    def note(self) -> None:
        with self._lock:
            self._times.append(time.monotonic())

    @property
    def last(self) -> float | None:
        """When the latest scrape was collected (monotonic clock)."""
        with self._lock:
            return self._times[-1] if self._times else None

    def interval(self) -> float | None:
        """The median time between recent scrapes (None before two)."""
        with self._lock:
            times = list(self._times)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return statistics.median(gaps) if gaps else None

    def app(self, registry: CollectorRegistry) -> Callable[..., Iterable[bytes]]:
        """prometheus-client's WSGI app for ``registry``, noting Prometheus's scrapes."""
        metrics = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
            body = metrics(environ, start_response)
            if environ.get("HTTP_USER_AGENT", "").startswith(PROMETHEUS_USER_AGENT):
                self.note()
            return body

        return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged (prometheus-client's own server does the same)."""


def _serve(addr: str, port: int, app: Callable[..., Iterable[bytes]]) -> WSGIServer:
    """Serve ``app`` on ``addr:port`` (IPv4 or IPv6) in a daemon thread."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    server = make_server(str(sockaddr[0]), port, app, Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _add_seconds(counter: Any, seconds: float, not_counted: RateLimitedLog) -> None:
    # Decoding already checked the bound; a message built in-process was not decoded.
    if 0.0 <= seconds <= MAX_SECONDS:
        counter.inc(seconds)
    else:
        not_counted("seconds out of range", seconds=seconds)


class _TensorRankSeries:
    """The ``evtrain_tensor_rank_*`` series of a run with tensor parallelism: one per
    (stage, replica, tensor rank) process, at most `MAX_PLACES`, at 0 from its first
    labels on, dropped when a run's shape no longer holds it."""

    def __init__(self, m: Metrics, not_counted: RateLimitedLog) -> None:
        self.m = m
        self.not_counted = not_counted
        self._tp = _Labels()
        self._places: set[tuple[int, int, int]] = set()
        """(stage, replica, tensor rank) with series."""

    def labels(
        self, stage_labels: tuple[str, str], place: tuple[int, int, int]
    ) -> tuple[str, str, str] | None:
        """The labels of tensor rank ``place`` of the stage process ``stage_labels`` names
        (None past the caps)."""
        stage, replica, tp = place
        if place not in self._places and len(self._places) >= MAX_PLACES:
            self.not_counted("too many tensor ranks", tp=tp, **place_fields(stage, replica))
            return None
        tp_label = self._tp.admit(str(tp))
        if tp_label is None:
            self.not_counted("too many tensor rank labels", tp=tp)
            return None
        labels = (*stage_labels, tp_label)
        if place not in self._places:
            self._places.add(place)
            self.m.tensor_rank_work.labels(*labels)
            self.m.tensor_rank_straggler.labels(*labels)
        return labels

    def step(self, labels: tuple[str, str, str], ev: StepEnded | TensorRankStepEnded) -> None:
        """A tensor rank's own step: its work and peak memory."""
        _add_seconds(self.m.tensor_rank_work.labels(*labels), work_seconds(ev), self.not_counted)
        if ev.peak_memory_bytes is not None:
            self.m.tensor_rank_peak_memory.labels(*labels).set(ev.peak_memory_bytes)

    def straggling(self, labels: tuple[str, str, str], straggling: bool) -> None:
        self.m.tensor_rank_straggler.labels(*labels).set(1 if straggling else 0)

    def forget_outside(self, run: RunStarted) -> None:
        """Drop the series of tensor ranks ``run`` does not have."""
        gone = [
            p
            for p in self._places
            if run.tensor_parallel < 2
            or p[0] >= run.num_stages
            or p[1] >= run.data_parallel
            or p[2] >= run.tensor_parallel
        ]
        for place in gone:
            labels = tuple(map(str, place))
            for metric in (
                self.m.tensor_rank_work,
                self.m.tensor_rank_peak_memory,
                self.m.tensor_rank_straggler,
            ):
                with contextlib.suppress(KeyError):
                    metric.remove(*labels)
            self._places.discard(place)
        self._tp.values = {str(p[2]) for p in self._places}


class PrometheusExporter(Hook):
    """Serve the run's metrics on ``http://ADDR:PORT/metrics``.

    Options: ``port`` (default 9431; 0 = any free port), ``addr`` (default
    ``127.0.0.1``; ``0.0.0.0`` to expose it), ``dir`` (where to write
    ``prometheus.port``; default the run directory), ``stale_after``
    (seconds without a stage event before ``evtrain_stage_up`` drops to 0,
    default 30), ``window`` (steps in ``evtrain_bubble_ratio``, default 20),
    ``linger`` (most seconds to wait after the run ended for a last scrape;
    default: twice the observed scrape interval, at most `MAX_LINGER`;
    0 stops at once).
    """

    name = "prometheus"
    default_priority = 100

    def __init__(
        self,
        *,
        port: int = DEFAULT_PORT,
        addr: str = "127.0.0.1",
        dir: str | Path | None = None,
        stale_after: float = 30.0,
        window: int = 20,
        linger: float | None = None,
        priority: int | None = None,
    ) -> None:
        super().__init__(priority=priority)
        self.port = int_option(self.name, "port", port, minimum=0)
        if self.port > 65535:
            raise UsageError(f"hook prometheus: option 'port' must be <= 65535, got {port!r}")
        self.addr = str_option(self.name, "addr", addr)
        self.output = RunOutput(
            self.name, PORT_FILENAME, directory=path_option(self.name, "dir", dir)
        )
        self.window = int_option(self.name, "window", window)
        self.linger = None if linger is None else float_option(self.name, "linger", linger)
        self.liveness = _StageLiveness(
            float_option(self.name, "stale_after", stale_after, strict=True)
        )
        self.registry = CollectorRegistry(auto_describe=True)
        self.scrapes = _Scrapes()
        self.bound_port: int | None = None
        self._server: Any = None
        self._port_file: Path | None = None
        self._steps = StepCount()
        self._run_id: str | None = None
        self._ended_at: float | None = None
        self._waits: dict[StageReplica, deque[tuple[float, float]]] = {}
        self._instructions: dict[StageReplica, str] = {}
        """The instruction label of each stage's one ``evtrain_stage_instruction_seconds``."""
        self._metric_names = _Labels()
        self._eval_sets = _Labels()
        self._stages = _Labels()
        self._replicas = _Labels()
        self._sources = _Labels()
        self._hooks = _Labels()
        self._observers: set[str] = set()
        self._gap_pairs: set[tuple[str, str]] = set()
        self._places: set[StageReplica] = set()
        """(stage, replica) pairs with series."""
        self._straggling: dict[StageReplica, set[int | None]] = {}
        """Per stage process: what of it is a straggler (None: the process, or a tensor
        rank of it)."""
        self.not_counted = RateLimitedLog(self.log, "event values not counted")
        self.m = Metrics(self.registry)
        self.tensor_ranks = _TensorRankSeries(self.m, self.not_counted)
        self.m.build_info.labels(_version()).set(1)
        for status in RUN_STATUSES:
            self.m.runs_ended.labels(status)

    # -- serving ------------------------------------------------------------------

    async def setup(self) -> None:
        """Bind and serve /metrics; write the port file if its place is known."""
        try:
            self._server = _serve(self.addr, self.port, self.scrapes.app(self.registry))
        except OSError as exc:
            raise UsageError(
                f"hook prometheus: cannot serve on {self.addr}:{self.port}: {exc.strerror or exc}"
            ) from None
        self.bound_port = int(self._server.server_port)
        self.log.info(
            "serving prometheus metrics",
            url=f"http://{self.addr}:{self.bound_port}/metrics",
            port=self.bound_port,
        )
        self._write_port_file()
        if self._runner is not None:
            for hook in self._runner.hooks:
                self._hook_known(hook.hook_name())

    def _write_port_file(self) -> None:
        if self.bound_port is None:
            return
        path = self.output.resolve(self.state.run if self._runner is not None else None)
        if path is None or path == self._port_file:
            return
        self._port_file = path  # tried once per place, whatever happens
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(f"{self.bound_port}\n")
            tmp.replace(path)  # readers never see a half-written file
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
            self.log.warning(
                "cannot write the port file",
                path=safe_text(str(path), 300),
                error=safe_text(str(exc), 300),
            )

    async def teardown(self) -> None:
        """Wait for the last scrape (see the module's docs), then stop the HTTP server."""
        if self._server is None:
            return
        await self._last_scrape()
        self._server.shutdown()
        self._server.server_close()
        self._server = None

    async def _last_scrape(self) -> None:
        ended = self._ended_at
        if ended is None or self.scrapes.last is None or self.linger == 0:
            return  # no run end to show, or nobody scrapes us
        if self.linger is not None:
            limit = self.linger
        else:
            interval = self.scrapes.interval()
            limit = MAX_LINGER if interval is None else min(MAX_LINGER, 2 * interval)
        deadline = ended + limit
        while time.monotonic() < deadline:
            last = self.scrapes.last
            if last is not None and last > ended:
                await anyio.sleep(_SERVE_GRACE)
                return
            await anyio.sleep(0.05)
        self.log.info("no scrape after the run ended", waited_s=round(limit, 1))

    # -- labels -----------------------------------------------------------------------

    def _place(self, stage: int, replica: int, ev: Event) -> tuple[str, str] | None:
        """The (``stage``, ``replica``) labels of a stage process of the run (None for one
        it cannot have)."""
        if not self.of_this_run(ev):
            self.not_counted("stage event of another run", **place_fields(stage, replica))
            return None
        problem = self.state.place_problem(stage, replica)
        if problem is not None:
            self.not_counted(problem, **place_fields(stage, replica))
            return None
        place = (stage, replica)
        if place not in self._places and len(self._places) >= MAX_PLACES:
            self.not_counted("too many stage processes", **place_fields(stage, replica))
            return None
        stage_label = self._stages.admit(str(stage))
        replica_label = self._replicas.admit(str(replica))
        if stage_label is None or replica_label is None:
            self.not_counted("too many stage labels", **place_fields(stage, replica))
            return None
        labels = (stage_label, replica_label)
        if place not in self._places:
            self._places.add(place)
            self.m.stage_up.labels(*labels).set_function(lambda: self.liveness.up(place))
            # Series at 0, so a dashboard shows 0 for a stage that never did this.
            for counter in (
                self.m.forward,
                self.m.backward,
                self.m.comm_wait,
                self.m.stage_failures,
                self.m.straggler,
            ):
                counter.labels(*labels)
            if replica == 0:  # only replica 0 writes checkpoint shards
                self.m.checkpoint_blocked.labels(*labels)
            source = self._sources.admit(stage_source(stage, replica))
            if source is not None:
                self.m.dropped.labels(source)
                for observer in self._observers:
                    self._gap_series(source, observer)
        return labels

    def _tensor_place(
        self, stage: int, replica: int, tp: int, ev: Event
    ) -> tuple[str, str, str] | None:
        """The (``stage``, ``replica``, ``tp``) labels of a process of a run with tensor
        parallelism (None for one it cannot have, or a run without)."""
        run = self.state.run
        if run is None or run.tensor_parallel < 2:
            return None
        if tp >= run.tensor_parallel:
            self.not_counted("tensor rank beyond the run's tensor_parallel", tp=tp)
            return None
        labels = self._place(stage, replica, ev)
        return None if labels is None else self.tensor_ranks.labels(labels, (stage, replica, tp))

    def _forget_places_outside(self, num_stages: int, data_parallel: int) -> None:
        """Drop the series of stage processes the run does not have (a previous run's, or
        made up)."""
        per_stage = (
            self.m.lr,
            self.m.step_duration,
            self.m.forward,
            self.m.backward,
            self.m.comm_wait,
            self.m.bubble,
            self.m.peak_memory,
            self.m.state_bytes,
            self.m.checkpoint_blocked,
            self.m.stage_up,
            self.m.stage_last_seen,
            self.m.stage_failures,
            self.m.straggler,
        )
        gone = sorted(p for p in self._places if p[0] >= num_stages or p[1] >= data_parallel)
        for place in gone:
            labels = (str(place[0]), str(place[1]))
            for metric in per_stage:
                with contextlib.suppress(KeyError):  # the process never had this one
                    metric.remove(*labels)
            self._places.discard(place)
            self._waits.pop(place, None)
            self._straggling.pop(place, None)
            kind = self._instructions.pop(place, None)
            if kind is not None:
                with contextlib.suppress(KeyError):
                    self.m.instruction.remove(*labels, kind)
            self.liveness.forget(place)
        self._stages.values -= {str(p[0]) for p in gone} - {str(p[0]) for p in self._places}
        self._replicas.values -= {str(p[1]) for p in gone} - {str(p[1]) for p in self._places}

    def _seen(
        self, stage: int, replica: int, ev: StageStarted | Heartbeat | StepEnded
    ) -> tuple[str, str] | None:
        labels = self._place(stage, replica, ev)
        if labels is not None:
            self.liveness.seen((stage, replica))
            if ev.ts:
                self.m.stage_last_seen.labels(*labels).set(ev.ts)
        return labels

    def _observer_known(self, observer: str) -> None:
        """A subscriber that reports gaps: a 0 series for it and each stage of the run."""
        label = self._sources.admit(observer)
        if label is None or label in self._observers:
            return
        self._observers.add(label)
        for place in sorted(self._places):
            source = self._sources.admit(stage_source(*place))
            if source is not None:
                self._gap_series(source, label)

    def _gap_series(self, source: str, observer: str) -> Any:
        """The gap counter of (source, observer); None once `MAX_GAP_SERIES` exist."""
        pair = (source, observer)
        if pair not in self._gap_pairs:
            if len(self._gap_pairs) >= MAX_GAP_SERIES:
                self.not_counted("too many gap series", source=source, observer=observer)
                return None
            self._gap_pairs.add(pair)
        return self.m.missing.labels(source, observer)

    def _hook_known(self, name: str) -> None:
        label = self._hooks.admit(name)
        if label is not None:
            self.m.hook_errors.labels(label)

    def _add_seconds(self, counter: Any, seconds: float) -> None:
        _add_seconds(counter, seconds, self.not_counted)

    def _count(self, counter: Any, amount: int, limit: int, kind: str) -> None:
        if not 0 <= amount <= limit:
            self.not_counted(kind, amount=amount, limit=limit)
            return
        counter.inc(amount)

    # -- events ---------------------------------------------------------------------

    @on(RunStarted)
    def run_started(self, ev: RunStarted) -> None:
        """Run shape; a new run counts steps from its own start."""
        self._enter_run(ev.run_id)
        self.m.max_steps.set(ev.max_steps)
        self.m.num_stages.set(ev.num_stages)
        self.m.running.set(1)
        self.m.start_time.set(ev.ts)
        self.m.steps_done.set(ev.start_step)
        self.m.run_info.clear()  # one run at a time: its labels do not pile up
        self.m.run_info.labels(
            safe_text(ev.run_id, 100),
            safe_text(ev.name, 100),
            safe_text(ev.schedule, 40),
            str(ev.num_stages),
            str(ev.data_parallel),
            str(ev.tensor_parallel),
        ).set(1)
        self._ended_at = None
        self._write_port_file()
        if self._runner is not None:
            self._observer_known(f"hook/{self.runner.name}")
        self._forget_places_outside(ev.num_stages, ev.data_parallel)
        self.tensor_ranks.forget_outside(ev)
        for stage in range(ev.num_stages):
            for replica in range(ev.data_parallel):
                if self._place(stage, replica, ev) is None:
                    return  # the caps are reached: the rest would not be admitted either
                tensor_ranks = range(ev.tensor_parallel) if ev.tensor_parallel > 1 else ()
                if any(self._tensor_place(stage, replica, tp, ev) is None for tp in tensor_ranks):
                    return

    @on(RunEnded)
    def run_ended(self, ev: RunEnded) -> None:
        """The run is over: every stage is down."""
        if not self.of_this_run(ev):
            return
        self.m.running.set(0)
        self.m.runs_ended.labels(ev.status).inc()
        self.liveness.all_down()
        self._ended_at = time.monotonic()

    @on(HookStarted)
    def hook_started(self, ev: HookStarted) -> None:
        """A hook process attached: its hooks and its source are label values from now."""
        for name in ev.hooks:
            self._hook_known(name)
        self._observer_known(ev.source)

    @on(StageStarted)
    def stage_started(self, ev: StageStarted) -> None:
        """The stage process is up."""
        self._seen(ev.stage, ev.replica, ev)

    @on(Heartbeat)
    def heartbeat(self, ev: Heartbeat) -> None:
        """A stage process is alive (heartbeats of other processes carry no stage); the
        instruction it is in."""
        if ev.stage is None:
            return
        labels = self._seen(ev.stage, ev.replica, ev)
        if labels is None:
            return
        kind = doing_kind(ev.doing)
        place = (ev.stage, ev.replica)
        previous = self._instructions.get(place)
        if previous is not None and previous != kind:
            with contextlib.suppress(KeyError):
                self.m.instruction.remove(*labels, previous)
        self._instructions[place] = kind
        self.m.instruction.labels(*labels, kind).set(ev.doing_s)

    @on(StragglerReported)
    def straggler(self, ev: StragglerReported) -> None:
        """A stage, replica or tensor rank became a straggler, or stopped being one: a
        stage process is one while it or any of its tensor ranks is."""
        tp = ev.tensor_rank
        if tp is not None:
            tensor_labels = self._tensor_place(ev.stage, ev.replica, tp, ev)
            if tensor_labels is None:
                return
            self.tensor_ranks.straggling(tensor_labels, ev.straggling)
        for replica in ev.replicas(self.state.data_parallel or 1):
            labels = self._place(ev.stage, replica, ev)
            if labels is None:
                continue
            straggling = self._straggling.setdefault((ev.stage, replica), set())
            if ev.straggling:
                straggling.add(tp)
            else:
                straggling.discard(tp)
            self.m.straggler.labels(*labels).set(1 if straggling else 0)

    @on(HangReported)
    def hang_reported(self, ev: HangReported) -> None:
        """The launcher found the run hung."""
        if self.of_this_run(ev):
            self.m.hangs.inc()

    @on(StageStopped)
    def stage_stopped(self, ev: StageStopped) -> None:
        """The stage process left normally."""
        if self._place(ev.stage, ev.replica, ev) is not None:
            self.liveness.down((ev.stage, ev.replica))

    @on(StageFailed)
    def stage_failed(self, ev: StageFailed) -> None:
        """The stage process raised."""
        labels = self._place(ev.stage, ev.replica, ev)
        if labels is not None:
            self.m.stage_failures.labels(*labels).inc()
            self.liveness.down((ev.stage, ev.replica))

    def _enter_run(self, run_id: str) -> None:
        if run_id != self._run_id:
            self._run_id = run_id
            self._steps.reset()
            self._waits.clear()

    @on(StepEnded)
    def step_ended(self, ev: StepEnded) -> None:
        """Per-process times and memory; run-wide values once per step, from replica 0."""
        problem = step_problem(ev, self.state)
        if problem is not None:
            self.not_counted(problem, step=ev.step, **place_fields(ev.stage, ev.replica))
            return
        if self.state.run is None:
            # No run.started yet (over tcp a later stage's first steps can arrive
            # before stage 0's): only a different run resets the step count.
            self._enter_run(ev.run_id)
        labels = self._seen(ev.stage, ev.replica, ev)
        if labels is None:
            return
        self.m.step_duration.labels(*labels).observe(ev.duration_s)
        self._add_seconds(self.m.forward.labels(*labels), ev.forward_s)
        self._add_seconds(self.m.backward.labels(*labels), ev.backward_s)
        self._add_seconds(self.m.comm_wait.labels(*labels), ev.comm_wait_s)
        waits = self._waits.setdefault((ev.stage, ev.replica), deque(maxlen=self.window))
        waits.append((ev.comm_wait_s, ev.duration_s))
        total = sum(d for _, d in waits)
        if total > 0:
            self.m.bubble.labels(*labels).set(sum(w for w, _ in waits) / total)
        if ev.peak_memory_bytes is not None:
            self.m.peak_memory.labels(*labels).set(ev.peak_memory_bytes)
        if ev.state_bytes is not None:
            self.m.state_bytes.labels(*labels).set(ev.state_bytes)
        if ev.lr is not None:
            self.m.lr.labels(*labels).set(ev.lr)
        self._tensor_rank_step(ev, 0)
        if ev.replica == 0:
            self._run_step(ev)

    def _tensor_rank_step(self, ev: StepEnded | TensorRankStepEnded, tp: int) -> None:
        labels = self._tensor_place(ev.stage, ev.replica, tp, ev)
        if labels is not None:
            self.tensor_ranks.step(labels, ev)

    @on(TensorRankStepEnded)
    def tensor_rank_step_ended(self, ev: TensorRankStepEnded) -> None:
        """The times and memory of a tensor rank above 0."""
        problem = step_problem(ev, self.state)
        if problem is not None:
            self.not_counted(problem, step=ev.step, tp=ev.tp, **place_fields(ev.stage, ev.replica))
            return
        self._tensor_rank_step(ev, ev.tp)

    def _run_step(self, ev: StepEnded) -> None:
        """The run-wide values of a step event of replica 0 (the others repeat them)."""
        if ev.loss is not None:
            self.m.loss.set(ev.loss)
        if ev.grad_norm is not None:
            self.m.grad_norm.set(ev.grad_norm)
        for key, value in ev.metrics.items():
            label = self._metric_names.admit(key)
            if label is not None:
                self.m.step_metric.labels(label).set(value)
        # Each stage reports every step; count a step once, when its first event arrives.
        # Steps whose every event was lost still happened; but an exporter that
        # joined mid-run counts from the step it saw (no spike in rate()).
        count = self._steps.advance(ev.step)
        if count:
            self.m.last_step_time.set(ev.ts)
            self.m.steps.inc(count)
            self._count(
                self.m.samples,
                ev.samples * count,
                MAX_STEP_SAMPLES * count,
                "samples per step above MAX_STEP_SAMPLES",
            )
            self.m.steps_done.set(ev.step)

    @on(EvalEnded)
    def eval_ended(self, ev: EvalEnded) -> None:
        """Latest eval results."""
        if not self.of_this_run(ev):
            return
        self.m.evals.inc()
        self.m.eval_duration.set(ev.duration_s)
        self.m.eval_step.set(ev.step)
        for key, value in ev.metrics.items():
            # "val/accuracy" is {set="val", metric="accuracy"}: one series per set
            # under one metric name. A single unnamed set has set="", which
            # Prometheus stores as no label at all, as before there were sets.
            name, sep, rest = key.partition("/")
            eval_set, metric = (name, rest) if sep and name in ev.sets else ("", key)
            set_label = self._eval_sets.admit(eval_set)
            label = self._metric_names.admit(metric)
            if set_label is not None and label is not None:
                self.m.eval_metric.labels(set_label, label).set(value)

    @on(CheckpointCommitted)
    def checkpoint_committed(self, ev: CheckpointCommitted) -> None:
        """A checkpoint is durable."""
        if not self.of_this_run(ev):
            return
        self.m.checkpoints.inc()
        self.m.checkpoint_time.set(ev.ts)
        self.m.checkpoint_duration.observe(ev.duration_s)
        self.m.checkpoint_step.set(ev.step)
        self.m.checkpoint_size.set(ev.bytes)

    @on(CheckpointShardSaved)
    def shard_saved(self, ev: CheckpointShardSaved) -> None:
        """Training time a stage's save blocked (replica 0 writes every shard)."""
        labels = self._place(ev.stage, 0, ev)
        if labels is not None:
            self._add_seconds(self.m.checkpoint_blocked.labels(*labels), ev.blocked_s)

    @on(CheckpointFailed)
    def checkpoint_failed(self, ev: CheckpointFailed) -> None:
        """A shard could not be written."""
        if not self.of_this_run(ev):
            return
        self.m.checkpoint_failures.inc()

    @on(BusDrops)
    def bus_drops(self, ev: BusDrops) -> None:
        """A publisher dropped events."""
        label = self._sources.admit(ev.source)
        if label is not None:
            self._count(self.m.dropped.labels(label), ev.dropped, MAX_GAP, "drops above MAX_GAP")

    @on(BusGaps)
    def bus_gaps(self, ev: BusGaps) -> None:
        """A subscriber (``observer``) missed events of ``from_source``."""
        source = self._sources.admit(ev.from_source)
        observer = self._sources.admit(ev.source)
        if source is None or observer is None:
            return
        counter = self._gap_series(source, observer)
        if counter is not None:
            self._count(counter, ev.missing, MAX_GAP, "gap above MAX_GAP")

    @on(HookError)
    def hook_error(self, ev: HookError) -> None:
        """A hook handler raised (``count`` times: repeated raises come in batches)."""
        label = self._hooks.admit(ev.hook)
        if label is not None:
            self._count(self.m.hook_errors.labels(label), ev.count, MAX_GAP, "errors above MAX_GAP")


def _version() -> str:
    """evtrain's installed version ("unknown" where it is not installed as a package)."""
    try:
        return importlib.metadata.version("evtrain")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
