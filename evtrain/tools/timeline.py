"""Pipeline timelines: recorded microbatch spans as a Chrome/Perfetto trace or a picture.

A run records its events with the recorder hook into ``RUN_DIR/events.jsonl``
(one JSON object per event, `evtrain.events.to_builtins`). With
``microbatch_spans="all"`` (or ``"sampled"``) the stages publish a
`MicrobatchForward`, `MicrobatchBackward` or `MicrobatchWait` span for every
compute and every blocking wait, with wall-clock start and end. This module
turns them into

* a Chrome trace (`chrome_trace`): ``ph: "X"`` complete events, one process,
  one track (``tid``) per stage, named ``F3`` / ``B3`` / ``wait recv_act``,
  microseconds relative to the first span shown — open it in
  https://ui.perfetto.dev or ``chrome://tracing``;
* a PNG (`render_png`): one row per stage, forward and backward in two
  colours, waits grey and hatched, idle time white, so the pipeline bubble is
  what stays white.

With data parallelism every stage process has its own track: a run of P
stages x D replicas has P x D of them, named ``stage 1 · replica 0``, the
replicas of a stage next to each other (a run without replicas keeps the
names ``stage 0``, ``stage 1``). A replica's wait for the gradient reduction
at the end of a step is a wait like any other: ``wait reduce``.

`spans_from_simulation` gives the same spans for a simulated step
(`evtrain.stages.simulator.SimulationResult`), so the renderer can be
checked against a timeline known exactly. ``evtrain timeline RUN_DIR`` is the
command-line front end (`evtrain.cli.timeline`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from evtrain.errors import UsageError
from evtrain.events import (
    Message,
    MicrobatchBackward,
    MicrobatchForward,
    MicrobatchSpan,
    MicrobatchWait,
    RunStarted,
)
from evtrain.exporters.recorder import read_recording
from evtrain.launcher.run_record import without_redone

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from evtrain.stages.simulator import SimulationResult

__all__ = [
    "EVENTS_FILE",
    "KIND_COLOURS",
    "RecordedRun",
    "StepRange",
    "TimelineSpan",
    "chrome_trace",
    "draw_timeline",
    "filter_steps",
    "load_run",
    "load_run_spans",
    "parse_steps",
    "read_events",
    "render_png",
    "spans_from_events",
    "spans_from_simulation",
    "stage_busy_fractions",
    "write_chrome_trace",
]

EVENTS_FILE = "events.jsonl"
"""The recorder's file inside a run directory."""

SpanKind = Literal["forward", "backward", "wait"]

KIND_COLOURS: dict[str, str] = {"forward": "#4878d0", "backward": "#ee854a", "wait": "#b0b0b0"}
"""Fill colour of each span kind in the PNG (idle time stays white)."""

_SPAN_TAGS: dict[str, SpanKind] = {
    str(MicrobatchForward.__struct_config__.tag): "forward",
    str(MicrobatchBackward.__struct_config__.tag): "backward",
    str(MicrobatchWait.__struct_config__.tag): "wait",
}
_RUN_STARTED_TAG = str(RunStarted.__struct_config__.tag)
_NO_SPANS_HINT = (
    "run with microbatch_spans='all' (or --spans all) and the recorder hook "
    "(hooks=[..., dict(type='recorder')])"
)


@dataclass(frozen=True, slots=True)
class TimelineSpan:
    """One interval on one stage process's track; ``start``/``end`` in seconds."""

    stage: int
    kind: SpanKind
    start: float
    end: float
    step: int = 0
    microbatch: int = 0
    op: str = ""
    """For waits: what the stage waited for (``recv_act``, ``recv_grad``, ``reduce``...);
    for a split backward's halves: ``input`` or ``weight``."""
    source: str = ""
    """The publishing process (``stage/1``, ``stage/1/2``)."""
    replica: int = 0
    """The stage's data-parallel replica (0 without data parallelism)."""
    chunk: int = 0
    """The stage's local model chunk (interleaved and zbv), shown as ``F3@1``."""

    @property
    def duration(self) -> float:
        """``end - start`` in seconds (never negative)."""
        return max(0.0, self.end - self.start)

    @property
    def label(self) -> str:
        """``F3`` (forward of microbatch 3), ``B3`` (or its halves ``I3``, ``W3``),
        ``F3@1`` on model chunk 1, or ``wait recv_act``."""
        chunk = f"@{self.chunk}" if self.chunk else ""
        if self.kind == "forward":
            return f"F{self.microbatch}{chunk}"
        if self.kind == "backward":
            part = {"input": "I", "weight": "W"}.get(self.op, "B")
            return f"{part}{self.microbatch}{chunk}"
        return f"wait {self.op}" if self.op else "wait"


@dataclass(frozen=True, slots=True)
class StepRange:
    """Steps ``first..last`` inclusive; ``None`` leaves that end open."""

    first: int | None = None
    last: int | None = None

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        return (self.first is None or step >= self.first) and (
            self.last is None or step <= self.last
        )

    def __str__(self) -> str:
        first = "" if self.first is None else str(self.first)
        last = "" if self.last is None else str(self.last)
        return first if self.first == self.last and first else f"{first}:{last}"


def parse_steps(text: str) -> StepRange:
    """Parse ``"10:12"`` (steps 10, 11 and 12), ``"10:"``, ``":12"`` or ``"10"``.

    Both ends are inclusive. Raises `UsageError` for anything else.
    """
    raw = text.strip()
    first_text, sep, last_text = raw.partition(":")
    try:
        first = int(first_text) if first_text.strip() else None
        last = (int(last_text) if last_text.strip() else None) if sep else first
    except ValueError:
        raise UsageError(
            f"--steps expects FIRST:LAST (inclusive, either may be left out) or one step, "
            f"got {text!r}"
        ) from None
    if not sep and first is None:
        raise UsageError(f"--steps expects FIRST:LAST or one step, got {text!r}")
    if (first is not None and first < 0) or (last is not None and last < 0):
        raise UsageError(f"--steps must not be negative, got {text!r}")
    if first is not None and last is not None and last < first:
        raise UsageError(f"--steps {text!r} is empty: {last} comes before {first}")
    return StepRange(first, last)


# ----------------------------------------------------------------- reading


def read_events(path: str | Path, *, types: Iterable[str] | None = None) -> Iterator[Message]:
    """The events of a recorder file, in file order, as `evtrain.events` Structs.

    ``types`` keeps only those tags (``"microbatch.forward"``...), which skips
    decoding everything else. Lines that are not valid events are skipped and
    counted (see `evtrain.exporters.recorder.read_recording`).
    """
    return read_recording(path, types=types)


def spans_from_events(events: Iterable[object]) -> list[TimelineSpan]:
    """The microbatch spans among ``events``, sorted by start time (others are ignored)."""
    spans: list[TimelineSpan] = []
    for ev in events:
        if not isinstance(ev, MicrobatchSpan):
            continue
        kind = _SPAN_TAGS.get(str(type(ev).__struct_config__.tag))
        if kind is None:
            continue
        spans.append(
            TimelineSpan(
                stage=ev.stage,
                kind=kind,
                start=ev.start,
                end=ev.end,
                step=ev.step,
                microbatch=ev.microbatch,
                op=ev.op
                if isinstance(ev, MicrobatchWait)
                else ev.part
                if isinstance(ev, MicrobatchBackward)
                else "",
                source=ev.source,
                replica=ev.replica,
                chunk=ev.chunk,
            )
        )
    spans.sort(key=lambda s: (s.start, s.stage, s.replica))
    return spans


@dataclass(frozen=True, slots=True)
class RecordedRun:
    """What a recorder file holds for a timeline: the spans and the run's description."""

    spans: list[TimelineSpan]
    """Every microbatch span, sorted by start time."""
    run: RunStarted | None
    """The last `RunStarted` in the file (None when the recorder joined later)."""

    @property
    def title(self) -> str:
        """``"digits: 2 stages, 4 microbatches, 1f1b"`` (or ``"evtrain"`` without run info);
        with data parallelism ``"digits: 2 stages x 2 replicas, ..."``."""
        if self.run is None:
            return "evtrain"
        r = self.run
        replicas = f" x {r.data_parallel} replicas" if r.data_parallel > 1 else ""
        shape = f"{r.num_stages} stages{replicas}"
        return f"{r.name}: {shape}, {r.num_microbatches} microbatches, {r.schedule}"


def load_run(run_dir: str | Path) -> RecordedRun:
    """Read ``RUN_DIR/events.jsonl`` (or a given ``.jsonl`` file) for a timeline.

    Of a resumed run each step's spans come from the launch that went on
    (`evtrain.launcher.run_record.without_redone`).

    Raises `UsageError` when the file is missing or holds no microbatch spans.
    """
    path = Path(run_dir).expanduser()
    if not path.exists():
        raise UsageError(f"run directory not found: {path}")
    events_path = path if path.is_file() else path / EVENTS_FILE
    if not events_path.is_file():
        raise UsageError(f"no {EVENTS_FILE} in {path}: {_NO_SPANS_HINT}")
    run: RunStarted | None = None
    span_events = []
    recorded = read_events(events_path, types=[*_SPAN_TAGS, _RUN_STARTED_TAG])
    for ev in without_redone(events_path, recorded):
        if isinstance(ev, RunStarted):
            run = ev
        else:
            span_events.append(ev)
    spans = spans_from_events(span_events)
    if not spans:
        raise UsageError(f"{events_path} holds no microbatch spans: {_NO_SPANS_HINT}")
    return RecordedRun(spans, run)


def load_run_spans(run_dir: str | Path) -> list[TimelineSpan]:
    """The microbatch spans of `load_run`."""
    return load_run(run_dir).spans


_SIMULATED_KINDS: dict[str, SpanKind] = {
    "forward": "forward",
    "backward": "backward",
    "weight": "backward",
    "reduce": "wait",
}


def spans_from_simulation(
    result: SimulationResult, *, seconds_per_unit: float = 1e-3, step: int = 0
) -> list[TimelineSpan]:
    """A simulated step's spans (cost units become ``seconds_per_unit`` seconds).

    The simulator's only wait is the gradient reduction, a ``wait reduce`` as
    a data-parallel run records it; whatever is neither is the bubble.
    """
    spans = [
        TimelineSpan(
            stage=stage,
            kind=_SIMULATED_KINDS[span.kind],
            start=span.start * seconds_per_unit,
            end=span.end * seconds_per_unit,
            step=step,
            microbatch=span.microbatch,
            op={"reduce": "reduce", "weight": "weight"}.get(span.kind, ""),
            source=f"stage/{stage}",
            chunk=span.chunk,
        )
        for stage, timeline in enumerate(result.timelines)
        for span in timeline
    ]
    spans.sort(key=lambda s: (s.start, s.stage))
    return spans


def filter_steps(spans: Iterable[TimelineSpan], steps: StepRange | None) -> list[TimelineSpan]:
    """The spans whose step lies in ``steps`` (all of them for ``None``)."""
    if steps is None:
        return list(spans)
    return [s for s in spans if s.step in steps]


# ------------------------------------------------------------------ tracks


def _tracks(spans: Sequence[TimelineSpan]) -> dict[tuple[int, int], int]:
    """(stage, replica) -> track number, in stage order, then replica.

    Without replicas, track == stage; the replicas of a stage (data
    parallelism) get a track each, next to each other.
    """
    keys = sorted({(s.stage, s.replica) for s in spans})
    if all(replica == 0 for _, replica in keys):
        return {key: key[0] for key in keys}
    return {key: i for i, key in enumerate(keys)}


def _track_names(tracks: dict[tuple[int, int], int]) -> dict[int, str]:
    """Track number -> ``stage 1``, or ``stage 1 · replica 0`` when some stage has replicas."""
    replicated = any(replica for _, replica in tracks)
    return {
        tid: f"stage {stage} · replica {replica}" if replicated else f"stage {stage}"
        for (stage, replica), tid in tracks.items()
    }


def stage_busy_fractions(spans: Sequence[TimelineSpan]) -> dict[int, dict[str, float]]:
    """Per stage: the shares of step time spent in ``forward``, ``backward``, ``wait`` and
    ``idle`` (the rest: the pipeline bubble plus host overhead); with replicas,
    over all of them together.

    Step time is the sum over the steps shown of each step's window, from its
    earliest span on any stage to its latest; the gaps between steps
    (optimizer, evaluation) are left out.
    """
    if not spans:
        return {}
    windows: dict[int, tuple[float, float]] = {}
    for s in spans:
        lo, hi = windows.get(s.step, (math.inf, -math.inf))
        windows[s.step] = (min(lo, s.start), max(hi, s.end))
    step_time = sum(hi - lo for lo, hi in windows.values())
    out: dict[int, dict[str, float]] = {}
    for stage in sorted({s.stage for s in spans}):
        mine = [s for s in spans if s.stage == stage]
        # Each replica of the stage spends the whole step time: shares are of their sum.
        total = step_time * len({s.replica for s in mine})
        fractions = {
            kind: (sum(s.duration for s in mine if s.kind == kind) / total if total > 0 else 0.0)
            for kind in KIND_COLOURS
        }
        fractions["idle"] = max(0.0, 1.0 - sum(fractions.values()))
        out[stage] = fractions
    return out


# ----------------------------------------------------------- chrome trace


def chrome_trace(spans: Sequence[TimelineSpan], *, title: str = "evtrain") -> dict[str, Any]:
    """The spans as a Chrome/Perfetto trace object (``{"traceEvents": [...]}``).

    One process (pid 0, named ``title``), one thread per stage process's
    track; ``ts``/``dur`` in microseconds relative to the earliest span;
    ``args`` carry step, microbatch, replica (with data parallelism) and (for
    waits) the operation.
    """
    tracks = _tracks(spans)
    names = _track_names(tracks)
    replicated = any(replica for _, replica in tracks)
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": title}},
    ]
    for tid, name in sorted(names.items()):
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
        )
        events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": 0,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    t0 = min((s.start for s in spans), default=0.0)
    for s in spans:
        args: dict[str, Any] = {"step": s.step, "microbatch": s.microbatch}
        if replicated:
            args["replica"] = s.replica
        if s.kind == "wait":
            args["op"] = s.op
        events.append(
            {
                "name": s.label,
                "cat": s.kind,
                "ph": "X",
                "ts": round((s.start - t0) * 1e6, 3),
                "dur": round(s.duration * 1e6, 3),
                "pid": 0,
                "tid": tracks[(s.stage, s.replica)],
                "args": args,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(
    spans: Sequence[TimelineSpan], path: str | Path, *, title: str = "evtrain"
) -> Path:
    """Write `chrome_trace` as JSON to ``path`` (parent directories are created)."""
    out = Path(path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(chrome_trace(spans, title=title), separators=(",", ":")))
    return out


# --------------------------------------------------------------------- png


def _step_offsets(
    spans: Sequence[TimelineSpan],
) -> tuple[dict[int, float], list[tuple[int, float]]]:
    """Per step, the seconds to subtract so steps sit back to back; and each step's x start.

    Steps are laid out one after the other with a small gap, whatever lay
    between them in wall time (the optimizer, an evaluation, or the 49 steps
    that ``"sampled"`` spans skip): each step's window runs from its
    earliest span on any stage to its latest.
    """
    windows: dict[int, tuple[float, float]] = {}
    for s in spans:
        lo, hi = windows.get(s.step, (math.inf, -math.inf))
        windows[s.step] = (min(lo, s.start), max(hi, s.end))
    ordered = sorted(windows.items(), key=lambda kv: kv[1][0])
    gap = 0.02 * max((hi - lo for _, (lo, hi) in ordered), default=0.0)
    offsets: dict[int, float] = {}
    starts: list[tuple[int, float]] = []
    x = 0.0
    for step, (lo, hi) in ordered:
        offsets[step] = lo - x
        starts.append((step, x))
        x += hi - lo + gap
    return offsets, starts


def draw_timeline(ax: Axes, spans: Sequence[TimelineSpan], *, title: str | None = None) -> None:
    """Draw the spans onto ``ax``: one row per stage process's track (stage 0 on top), x in ms.

    Row ``i`` covers ``y`` from ``i - 0.4`` to ``i + 0.4``. x is milliseconds
    since the start of the first step shown; with several steps, each step is
    placed right after the previous one (a dashed line marks where each
    begins), so time between steps that no span covers is not drawn. Waits
    are drawn under compute so a wait that overlaps a computation never
    hides it; what stays white is idle time, the pipeline bubble.
    """
    from matplotlib.patches import Patch

    tracks = _tracks(spans)
    offsets, step_starts = _step_offsets(spans)

    def x_ms(s: TimelineSpan) -> float:
        return (s.start - offsets[s.step]) * 1e3

    end_ms = max((x_ms(s) + s.duration * 1e3 for s in spans), default=1.0) or 1.0
    ax.set_facecolor("white")
    # One collection per (kind, track): thousands of spans still draw quickly.
    bars: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for s in spans:
        bars.setdefault((s.kind, tracks[(s.stage, s.replica)]), []).append(
            (x_ms(s), s.duration * 1e3)
        )
    for kind in ("wait", "forward", "backward"):
        for (bar_kind, row), ranges in bars.items():
            if bar_kind != kind:
                continue
            ax.broken_barh(
                ranges,
                (row - 0.4, 0.8),
                facecolors=KIND_COLOURS[kind],
                edgecolors="#555555" if kind == "wait" else "white",
                linewidth=0.3,
                hatch="////" if kind == "wait" else None,
            )
    for s in spans:
        # Labels only where they fit (a few pixels per character).
        if s.kind != "wait" and s.duration * 1e3 > end_ms / 60:
            ax.text(
                x_ms(s) + s.duration * 1e3 / 2,
                tracks[(s.stage, s.replica)],
                s.label,
                ha="center",
                va="center",
                fontsize=7,
                color="white",
                clip_on=True,
            )
    if len(step_starts) > 1:
        for step, start in step_starts:
            x = start * 1e3
            ax.axvline(x, color="#999999", linewidth=0.6, linestyle="--", zorder=0)
            ax.text(x, -0.6, f" step {step}", fontsize=7, color="#666666", va="bottom")
    names = _track_names(tracks)
    ax.set_yticks(sorted(names), [names[t] for t in sorted(names)])
    ax.set_ylim(max(names, default=0) + 0.6, -0.8)
    ax.set_xlim(0, end_ms * 1.01)
    ax.set_xlabel("time (ms)" if len(step_starts) < 2 else "time (ms), steps back to back")
    fractions = stage_busy_fractions(spans)
    if fractions:
        idle = sum(f["idle"] for f in fractions.values()) / len(fractions)
        subtitle = f"idle (white) {idle:.0%} of stage time"
        ax.set_title(f"{title} — {subtitle}" if title else subtitle, fontsize=10)
    ax.figure.legend(
        handles=[
            Patch(facecolor=KIND_COLOURS["forward"], label="forward"),
            Patch(facecolor=KIND_COLOURS["backward"], label="backward"),
            Patch(facecolor=KIND_COLOURS["wait"], hatch="////", edgecolor="#555555", label="wait"),
            Patch(facecolor="white", edgecolor="#555555", label="idle"),
        ],
        loc="outside lower center",
        ncol=4,
        fontsize=8,
        frameon=False,
    )


def render_png(
    spans: Sequence[TimelineSpan],
    path: str | Path,
    *,
    title: str | None = None,
    width: float = 12.0,
    dpi: int = 120,
) -> Path:
    """Draw the spans (see `draw_timeline`) into a PNG at ``path`` with matplotlib's Agg backend.

    Raises `UsageError` when matplotlib is missing or there is nothing to draw.
    """
    if not spans:
        raise UsageError(f"no microbatch spans to draw: {_NO_SPANS_HINT}")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("--png needs matplotlib: pip install -e '.[demo]'") from None
    rows = len(_tracks(spans))
    # A Figure with its own Agg canvas: no pyplot, no global backend switch.
    fig = Figure(figsize=(width, 1.4 + 0.55 * rows), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    draw_timeline(fig.add_subplot(), spans, title=title)
    out = Path(path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", facecolor="white")
    return out
