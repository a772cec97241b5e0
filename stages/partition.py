"""Splitting a job's model across pipeline stages and building one stage's part.

A job's model is a sequence of *units*, the pieces a stage boundary may fall
between:

* ``Job.layers``: unit i is layer i, built by its factory; the stage module
  (`StageModule`) chains its layers by the calling convention of
  `evtrain.stages.pytree`.
* ``Job.model``: the units are the model's submodules (in the order its
  forward first calls them, for a model run as written; in registration
  order for a pruned forward), with ``nn.ModuleList`` and ``nn.ModuleDict``
  containers expanded into their items, recursively (nanoGPT's ``GPT``: ``transformer.wte``,
  ``transformer.wpe``, ``transformer.drop``, ``transformer.h.0`` …
  ``transformer.ln_f``, ``lm_head``). For a model run as written, a module
  its forward calls several times is one unit per call (``name@k``), whose
  stages hold the module as one tied weight (`tied_groups`), and a unit
  inside which the forward calls a module more often than the unit is
  opened into its children (`_model_units`). A stage builds the whole model, keeps
  the units of its range and prunes the others (torchtitan's way): a pruned
  item of a ``ModuleDict`` is deleted, a ``ModuleList`` becomes a
  `KeptItems` holding the kept items under their original indices, any
  other pruned module is set to ``None``. The model's ``forward`` is the
  stage's forward, so it must follow this contract: skip a module that is
  ``None`` (``x = self.wte(idx) if self.wte is not None else idx``), iterate
  its containers instead of indexing them, and return what the next stage
  takes (``(h, mask)``) when its head is pruned — the next stage's forward
  then receives that by the calling convention. Buffers of the root and of
  containers (rotary tables) stay on every stage; a parameter outside every
  unit is refused. A stage of several model chunks (interleaved, zbv) keeps
  the units of all its chunks in one pruned model (what it optimizes and
  checkpoints) and runs each chunk through a view of it: a copy of the
  model's containers pruned to that chunk, sharing the units, parameters and
  buffers.

Either way state_dict keys are those of the unsplit model (``"3.weight"``,
``"transformer.h.4.attn.c_attn.weight"``), so checkpoints taken at one
number of stages load at another. Initialization does not depend on the
partition: layer i is always built with the CPU RNG seeded to
``derive_seed(job.seed, "layer", i)`` (see `build_layer`), a model with
``derive_seed(job.seed, "model")`` before it is pruned.

* `partition` — contiguous unit ranges per stage: split points, an explicit
  balance, or automatic by parameter count or estimated compute.
* `build_stage_module` — one stage's part; `build_full_model` — the unsplit
  model with identical weights (single-process reference, export).
* `tied_groups` — parameters that are one weight (`Job.tied`, shared
  parameters of a model, a module called on several stages), resolved to the
  stages that hold them.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from torch import nn

from evtrain.checkpoint.state_tree import set_stage_aliases
from evtrain.data import derive_seed
from evtrain.errors import SpecError
from evtrain.job import Job
from evtrain.job_fields import LayerFactory
from evtrain.stages.job_data import job_data
from evtrain.stages.pytree import call, map_tensors, spec_of
from evtrain.stages.schedules import chunk_place
from evtrain.stages.standins import (
    SLOT,
    ChunkPlan,
    ForwardTrace,
    absent,
    as_inputs,
    branches_on_units,
    call_slots,
    install,
    module_of,
    modules_of,
    plan_chunks,
    replace_unit,
    split_boundaries,
    trace_forward,
    unit_slots,
)
from evtrain.stages.survey import SurveyUnavailable, imbalance, survey
from evtrain.stages.tied import TiedGroup, resolve_ties

__all__ = [
    "KeptItems",
    "SplitPlan",
    "StageChunks",
    "StageModule",
    "build_full_model",
    "build_layer",
    "build_stage_chunks",
    "build_stage_module",
    "layer_param_counts",
    "meta_model",
    "meta_units",
    "partition",
    "plan_split",
    "stage_unit_modules",
    "stage_units",
    "tied_groups",
    "unit_names",
]

log = structlog.get_logger()


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _on_meta(what: str, factory: Any) -> nn.Module:
    """``factory()`` on the meta device (the CPU if it does not build there), RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                module = factory()
        except Exception as exc:
            log.warning(f"{what} does not build on meta; building on cpu", error=str(exc))
            with torch.device("cpu"):
                module = factory()
    if not isinstance(module, nn.Module):
        raise SpecError(
            "model" if what == "the model" else "layers",
            f"{what} factory returned {type(module).__name__}, not an nn.Module",
        )
    return module


def meta_model(job: Job) -> nn.Module:
    """``job.model`` built on the meta device: its structure and config, no storage."""
    if job.model is None:
        raise SpecError("model", "the job gives layers=, not a model")
    return _on_meta("the model", job.model)


def layer_param_counts(factories: Sequence[LayerFactory]) -> list[int]:
    """Parameters per layer, counted by building each layer on the meta device.

    Meta tensors have shapes but no storage, so even a huge model costs
    nothing here. A factory that fails on meta (e.g. it loads a file) is
    built on the CPU instead, then dropped.
    """
    return [_param_count(_on_meta(f"layer {i}", f)) for i, f in enumerate(factories)]


# ------------------------------------------------------------------ model units


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, nn.ModuleList | nn.ModuleDict | nn.Sequential)


def _is_stack(module: nn.Module) -> bool:
    """A container of two or more modules of one type: a model's repeated blocks."""
    items = list(module.children())
    return _is_container(module) and len(items) >= 2 and len({type(m) for m in items}) == 1


def _holds_stack(module: nn.Module) -> bool:
    return any(
        _is_stack(child) or (not _is_container(child) and _holds_stack(child))
        for child in module.children()
    )


def _expand(module: nn.Module, prefix: str, pruned: bool) -> Iterator[str]:
    """Units: containers are expanded; so are modules that hold a stack of blocks
    (Hugging Face's ``model`` of ``LlamaForCausalLM``), except a stack's own items."""
    in_stack = not pruned and _is_stack(module)
    for name, child in module.named_children():
        fqn = f"{prefix}{name}"
        if pruned:
            expand = isinstance(child, nn.ModuleList | nn.ModuleDict)
        else:
            expand = _is_container(child) or (not in_stack and _holds_stack(child))
        if expand:
            yield from _expand(child, fqn + ".", pruned)
        else:
            yield fqn


def model_unit_names(
    model: nn.Module, split_points: Sequence[str] | None = None, *, pruned: bool = False
) -> list[str]:
    """The units of a model: submodules in registration order (`_model_units` puts a
    model run as written in call order), containers and
    modules holding a stack expanded, and units holding a split point expanded
    until it is one."""
    names = list(_expand(model, "", pruned))
    for point in (module_of(p) for p in split_points or ()):
        while point not in names:
            outer = next((n for n in names if point.startswith(n + ".")), None)
            if outer is None:
                break  # _split_sizes names the problem
            at = names.index(outer)
            inner = [f"{outer}.{n}" for n, _ in model.get_submodule(outer).named_children()]
            if not inner:
                break
            names[at : at + 1] = inner
    if not names:
        raise SpecError("model", "the model has no submodules to place on stages")
    return names


def _check_outside_params(model: nn.Module, units: Sequence[str]) -> None:
    inside = set(modules_of(units))
    for fqn, module in model.named_modules():
        if fqn in inside or any(fqn.startswith(u + ".") for u in inside):
            continue
        for name, _ in module.named_parameters(recurse=False):
            raise SpecError(
                "model",
                f"parameter {(fqn + '.' if fqn else '') + name!r} belongs to no unit; "
                "put it inside a submodule so that one stage owns it",
            )


def meta_units(job: Job) -> list[tuple[str, nn.Module]]:
    """Every unit of the job as ``(display name, module on meta)``, in pipeline order."""
    if job.layers is not None:
        units = []
        for i, factory in enumerate(job.layers):
            module = _on_meta(f"layer {i}", factory)
            units.append((f"layer {i} ({type(module).__name__})", module))
        return units
    model = _on_meta("the model", job.model)
    names = _model_units(job, model)
    _check_outside_params(model, names)
    return [(n, model.get_submodule(module_of(n))) for n in names]


def _model_units(job: Job, model: nn.Module) -> list[str]:
    """The units of the split. For a model run as written: a unit inside which the
    forward calls a module more often than the unit itself is opened, and each call
    of a module called several times is a unit (`unit_slots`), in call order."""
    names = model_unit_names(model, job.split_points, pruned=job.pruned_forward)
    if not _as_written(job):
        return names
    trace = _trace(job, names)
    opened = _open_repeated(model, names, trace.module_calls)
    if opened != names:
        names = opened
        trace = _trace(job, names)
    return unit_slots(trace, names)


def _open_repeated(model: nn.Module, names: Sequence[str], calls: Mapping[str, int]) -> list[str]:
    """``names`` with each unit that calls a module inside it more often than it is
    called itself (ALBERT's encoder, calling one layer group at every depth) replaced
    by its children, so that the module's calls can be split; a unit with parameters
    of its own stays whole."""
    names = list(names)
    i = 0
    while i < len(names):
        unit = model.get_submodule(names[i])
        n = calls.get(names[i], 0)
        inner = (
            n
            and not unit._parameters
            and any(calls.get(f"{names[i]}.{fqn}", 0) > n for fqn, _ in unit.named_modules() if fqn)
        )
        if inner:
            names[i : i + 1] = _expand(unit, names[i] + ".", pruned=False)
        else:
            i += 1
    return names


def _split_boundaries(job: Job, names: Sequence[str]) -> frozenset[int] | None:
    """The unit indices a stage may start at, for a model run as written (None: any)."""
    if not _as_written(job):
        return None
    return split_boundaries(_trace(job, names), names)


def unit_names(job: Job) -> list[str]:
    """The units' names: layer indices as strings, or a model's module names."""
    if job.layers is not None:
        return [str(i) for i in range(len(job.layers))]
    return _model_units(job, _on_meta("the model", job.model))


def _unit_params(job: Job) -> list[list[tuple[str, nn.Parameter]]]:
    """Each unit's parameters with their unsplit names (shared ones under every name)."""
    if job.layers is not None:
        return [
            [
                (f"{i}.{n}", p)
                for n, p in _on_meta(f"layer {i}", f).named_parameters(remove_duplicate=False)
            ]
            for i, f in enumerate(job.layers)
        ]
    model = _on_meta("the model", job.model)
    names = _model_units(job, model)
    _check_outside_params(model, names)
    return [
        [
            (f"{module_of(u)}.{n}", p)
            for n, p in model.get_submodule(module_of(u)).named_parameters(remove_duplicate=False)
        ]
        for u in names
    ]


# ------------------------------------------------------------------- splitting


def _balanced_split(
    counts: Sequence[float], num_stages: int, allowed: Collection[int] | None = None
) -> list[int]:
    """Units per stage of the contiguous split minimizing the largest stage.

    Minimizes ``(max cost, max units)`` over stages in lexicographic order:
    cost first, then unit count, so cost-free units (ReLU) are spread evenly
    instead of piling up. A stage begins only at a unit index in ``allowed``
    (None: any). Exact dynamic program, O(num_stages * L^2) — fine for the
    few hundred units of a pipeline.
    """
    n = len(counts)
    if allowed is not None and len(allowed) < num_stages - 1:
        raise SpecError(
            "stages",
            f"{num_stages} stages, but the model's forward can be split at only "
            f"{len(allowed)} place{'s' if len(allowed) != 1 else ''} (between units it "
            f"has finished calling): use at most {len(allowed) + 1} stages",
        )
    infeasible = (float("inf"), n + 1)
    prefix = [0.0]
    for c in counts:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int) -> tuple[float, int]:
        return (prefix[j] - prefix[i], j - i)

    # best[k][j]: optimal (max cost, max units) for units[:j] in k+1 stages.
    best = [[cost(0, j) for j in range(n + 1)]]
    cut: list[list[int]] = [[0] * (n + 1)]
    for k in range(1, num_stages):
        row: list[tuple[float, int]] = [(0.0, 0)] * (n + 1)
        row_cut = [0] * (n + 1)
        for j in range(k + 1, n + 1):
            choice = None
            for i in range(k, j):
                if allowed is not None and i not in allowed:
                    continue
                value = max(best[k - 1][i], cost(i, j))
                if choice is None or value < choice:
                    choice, row_cut[j] = value, i
            row[j] = infeasible if choice is None else choice
        best.append(row)
        cut.append(row_cut)
    assert best[num_stages - 1][n] != infeasible
    sizes = []
    j = n
    for k in range(num_stages - 1, 0, -1):
        i = cut[k][j]
        sizes.append(j - i)
        j = i
    sizes.append(j)
    return sizes[::-1]


def _check_sizes(sizes: Sequence[Any], num_stages: int, n: int) -> list[int]:
    sizes = list(sizes)
    if len(sizes) != num_stages:
        raise SpecError("balance", f"has {len(sizes)} entries but stages is {num_stages}")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise SpecError("balance", f"every stage needs at least one unit, got {sizes}")
    if sum(sizes) != n:
        raise SpecError("balance", f"{sizes} places {sum(sizes)} units but there are {n}")
    return sizes


def _split_sizes(names: Sequence[str], points: Sequence[str]) -> list[int]:
    index = {name: i for i, name in enumerate(names)}
    starts = []
    for point in points:
        if point not in index:
            near = [
                n
                for n in names
                if n.startswith((point + ".", point + SLOT)) or point.startswith(n + ".")
            ]
            hint = f" (units inside it: {', '.join(near[:4])})" if near else ""
            raise SpecError(
                "split_points",
                f"{point!r} names no unit of the model{hint}; units are "
                f"{', '.join(names[:6])}{', ...' if len(names) > 6 else ''}",
            )
        starts.append(index[point])
    if starts != sorted(starts) or starts[0] == 0:
        raise SpecError(
            "split_points",
            f"{list(points)} must name units in model order, after the first unit {names[0]!r}",
        )
    bounds = [0, *starts, len(names)]
    return [b - a for a, b in itertools.pairwise(bounds)]


def _check_boundaries(
    field: str, names: Sequence[str], sizes: Sequence[int], allowed: Collection[int] | None
) -> None:
    """Refuse a split the forward cannot follow, naming the nearest ones it can."""
    if allowed is None:
        return
    for start in itertools.accumulate(sizes[:-1]):
        if start in allowed:
            continue
        near = sorted(allowed, key=lambda b: (abs(b - start), b))[:2]
        instead = " or ".join(repr(names[b]) for b in sorted(near))
        raise SpecError(
            field,
            f"a stage starting at {names[start]!r} splits the forward where it still calls "
            f"units before it; start the stage at {instead} instead"
            if near
            else f"the model's forward cannot be split before {names[start]!r}",
        )


def partition(
    job_or_layers: Job | Sequence[LayerFactory],
    num_stages: int | None = None,
    balance: Sequence[int] | str | None = None,
) -> list[range]:
    """Contiguous unit-index ranges, one per stage.

    With a `Job`, ``num_stages`` and ``balance`` default to ``job.num_chunks`` (its
    stages times its virtual stages: one range per model chunk) and
    ``job.balance`` (or the job's ``split_points``). With sizes the ranges
    follow them; ``"compute"`` minimizes the largest per-stage training-FLOP
    estimate (`evtrain.stages.survey`, falling back to parameter counts
    when the model cannot run on the meta device); otherwise (``"params"``,
    ``None``) the largest per-stage parameter count, every stage getting at
    least one unit. Deterministic, so every stage process computes the same
    answer.

    Raises `SpecError` (``stages``, ``balance`` or ``split_points``) for
    impossible requests.
    """
    if isinstance(job_or_layers, Job):
        job: Job | None = job_or_layers
        num_stages = job_or_layers.num_chunks if num_stages is None else num_stages
        balance = job_or_layers.balance if balance is None else balance
    else:
        job = None
        if num_stages is None:
            raise TypeError("partition() needs num_stages when given a list of layer factories")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise SpecError("stages", f"expected an integer >= 1, got {num_stages!r}")
    if job is not None and job.model is not None:
        names = unit_names(job)
    else:
        factories = job_or_layers if job is None else job.layers
        assert isinstance(factories, Sequence)
        names = [str(i) for i in range(len(factories))]
    n = len(names)
    if num_stages > n:
        listed = ", ".join(names[:6]) + (", ..." if n > 6 else "")
        raise SpecError(
            "stages",
            f"{num_stages} stages but only {n} units to place ({listed}); a split point "
            "inside a unit opens it up",
        )
    allowed = _split_boundaries(job, names) if job is not None else None
    if job is not None and job.split_points is not None and not isinstance(balance, tuple | list):
        sizes = _split_sizes(names, job.split_points)
        _check_boundaries("split_points", names, sizes, allowed)
    elif isinstance(balance, tuple | list):
        sizes = _check_sizes(balance, num_stages, n)
        _check_boundaries("balance", names, sizes, allowed)
    elif balance == "compute":
        if job is None:
            raise TypeError("balance='compute' needs a Job (its data gives the example input)")
        sizes = _balanced_split(unit_costs(job), num_stages, allowed)
    elif job is not None:
        sizes = _balanced_split(
            [sum(p.numel() for _, p in u) for u in _unit_params(job)], num_stages, allowed
        )
    else:
        sizes = _balanced_split(layer_param_counts(job_or_layers), num_stages)  # type: ignore[arg-type]
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def example_microbatch(job: Job) -> Any:
    """The first training microbatch's inputs, as stage 0 receives them."""
    return job_data(job).example_batch(job.microbatch_size)[0]


def unit_costs(job: Job) -> list[float]:
    """Estimated training cost per unit, from one microbatch on the meta device.

    Layers are surveyed one after the other (`evtrain.stages.survey`: counted
    forward and backward FLOPs plus an element floor). A model's units are
    not a chain — its ``forward`` decides how they connect — so the whole
    model runs once and each unit is charged three times the forward FLOPs
    counted while it ran. A model run as written whose forward reads values
    (Hugging Face's mask code) is counted on a model built on the CPU. Falls
    back to parameter counts, with a warning, when nothing can run it.
    """
    try:
        if job.model is not None:
            try:
                return _model_costs(job)
            except SurveyUnavailable:
                if not _as_written(job):
                    raise
                return _model_costs(job, _build_model(job))
        return [float(c) for c in survey(meta_units(job), example_microbatch(job)).costs]
    except SurveyUnavailable as exc:
        log.warning("no compute estimate; balancing by parameter count", reason=str(exc))
        return [float(sum(p.numel() for _, p in u)) for u in _unit_params(job)]


def _meta_example(job: Job) -> Any:
    return map_tensors(lambda t: torch.empty_like(t, device="meta"), example_microbatch(job))


def _on_meta_run(what: str, fn: Any) -> Any:
    try:
        with torch.device("meta"), torch.no_grad():
            return fn()
    except SpecError:
        raise
    except Exception as exc:
        raise SurveyUnavailable(what, f"{type(exc).__name__}: {exc}".splitlines()[0]) from exc


def _model_costs(job: Job, model: nn.Module | None = None) -> list[float]:
    """Each unit's training cost from one forward of the whole model: on the meta
    device, or on ``model`` (built on the CPU) with the first microbatch."""
    from torch.utils.flop_counter import FlopCounterMode

    on_meta = model is None
    if model is None:
        model = _on_meta("the model", job.model)
    names = _model_units(job, model)
    counter = FlopCounterMode(display=False)
    flops = [0] * len(names)
    slot_of = call_slots(names)
    calls: dict[str, int] = {}
    started: dict[str, tuple[int, int]] = {}
    for name in modules_of(names):
        unit = model.get_submodule(name)

        def before(_m: nn.Module, _args: Any, name: str = name) -> None:
            k = calls[name] = calls.get(name, -1) + 1
            # A unit called several times is one unit per call (``unit@k``).
            slot = slot_of(f"{name}#{k}")
            if slot >= 0:
                started[name] = (slot, counter.get_total_flops())

        def after(_m: nn.Module, _args: Any, _out: Any, name: str = name) -> None:
            if name in started:
                slot, at = started.pop(name)
                flops[slot] += counter.get_total_flops() - at

        unit.register_forward_pre_hook(before)
        unit.register_forward_hook(after)
    if on_meta:
        example = _meta_example(job)

        def run() -> None:
            with counter:
                call(model, example)

        _on_meta_run("the model", run)
    else:
        try:
            with _buffers_kept(model), torch.no_grad(), counter:
                call(model, example_microbatch(job))
        except Exception as exc:
            first_line = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise SurveyUnavailable("the model", first_line) from exc
    # Forward, input gradient and weight gradient cost about the same.
    return [3.0 * f for f in flops]


def _check_model_stages(job: Job, ranges: Sequence[range]) -> None:
    """Run each stage's pruned model on the previous one's output, on meta.

    A stage output that cannot cross a boundary is a `SpecError` naming the stage.
    """
    names = unit_names(job)
    value = _meta_example(job)
    for stage, units in enumerate(ranges):
        part = _on_meta("the model", job.model)
        _prune(part, names, units)
        where = f"stage {stage} ({names[units.start]}..{names[units.stop - 1]})"
        value = _on_meta_run(where, lambda part=part, value=value: call(part, value))
        if stage < len(ranges) - 1:
            spec_of(value, where)


def _as_written(job: Job) -> bool:
    return job.model is not None and not job.pruned_forward


def _trace(job: Job, names: Sequence[str], model: nn.Module | None = None) -> ForwardTrace:
    """One traced forward of the whole model (units ``names``) on the first
    training microbatch.

    Without ``model`` (planning before launch) it runs on the meta device,
    or, for a forward that reads values (a mask's), on a model built on the
    CPU; with ``model`` (a stage's, still whole) on that, its buffers (BatchNorm
    statistics) left as they were.
    """
    modules = modules_of(names)
    traces = _TRACES.setdefault(job, {})
    key = frozenset(modules)
    if key not in traces:
        traces[key] = _trace_once(job, modules, model)
    return traces[key]


_TRACES: weakref.WeakKeyDictionary[Job, dict[frozenset[str], ForwardTrace]] = (
    weakref.WeakKeyDictionary()
)
"""One traced forward per job, units and process: the units' order, the split
boundaries and every chunk's plan come from it."""


def _trace_once(job: Job, names: Sequence[str], model: nn.Module | None) -> ForwardTrace:
    if model is None:
        meta = _on_meta("the model", job.model)
        inputs = as_inputs(_meta_example(job))  # the data are read outside the meta context
        try:
            with torch.device("meta"):
                return trace_forward(meta, inputs, names)
        except SpecError:
            raise
        except Exception as exc:
            log.debug("tracing on the cpu", reason=f"{type(exc).__name__}: {exc}")
            model = _build_model(job)
    try:
        with _buffers_kept(model):
            return trace_forward(model, as_inputs(example_microbatch(job)), names)
    except SpecError:
        raise
    except Exception as exc:
        first_line = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise SpecError(
            "model", f"its forward failed on the first microbatch: {first_line}"
        ) from exc


@contextlib.contextmanager
def _buffers_kept(model: nn.Module) -> Iterator[None]:
    """Run a forward that must leave no trace in the model's buffers (BatchNorm statistics)."""
    saved = {n: b.clone() for n, b in model.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(saved[name])


def chunk_plans(
    job: Job, names: Sequence[str], ranges: Sequence[range], model: nn.Module | None = None
) -> list[ChunkPlan]:
    """What each model chunk (``ranges`` of the units ``names``) of an as-written
    ``job.model`` keeps, stands in for and sends; ``model`` is the whole model to
    trace, if the caller has built it."""
    return plan_chunks(_trace(job, names, model), names, ranges)


@dataclass(frozen=True)
class SplitPlan:
    """How a job is split, checked before any stage process starts (`plan_split`)."""

    units: tuple[str, ...]
    sizes: tuple[int, ...]
    costs: tuple[float, ...] | None
    """Estimated training cost per unit, None when the model cannot run on meta."""
    params: tuple[int, ...]

    @property
    def imbalance(self) -> float | None:
        """Largest stage cost over the mean (1.0 is even), by estimated compute."""
        if self.costs is None:
            return None
        return imbalance(self.costs, self.sizes)

    def describe(self) -> str:
        """One line for the launch banner."""
        parts, start = [], 0
        for size in self.sizes:
            first, last = self.units[start], self.units[start + size - 1]
            parts.append(first if size == 1 else f"{first}..{last}")
            start += size
        text = " | ".join(parts)
        if self.imbalance is not None:
            text += f"  (estimated compute imbalance {self.imbalance:.2f})"
        return text


def plan_split(job: Job) -> SplitPlan:
    """Resolve and check the split of ``job``: the partition, its ties, what each unit returns.

    Runs the units once on the meta device (`evtrain.stages.survey`) with a
    microbatch of the data, so that a unit returning something that cannot
    cross a stage boundary, a split point naming no module or a tied name
    that is no parameter is a `SpecError` here. A model that cannot run on
    meta is checked by the stages' own first forward instead.
    """
    # Split points and ties first: their errors do not need the model to run.
    ranges = None if job.balance == "compute" else partition(job)
    if ranges is not None:
        tied_groups(job, ranges)
    units = meta_units(job)
    costs: tuple[float, ...] | None = None
    model = None
    try:
        if job.model is not None:
            if ranges is None or job.num_chunks > 1:
                costs = tuple(_model_costs(job))
        else:
            costs = tuple(float(c) for c in survey(units, example_microbatch(job)).costs)
    except SurveyUnavailable as exc:
        if _as_written(job):
            # Counted on the CPU, whose model the trace below then runs too.
            log.debug("no compute estimate on meta; counting on the cpu", reason=str(exc))
            model = _build_model(job)
            with contextlib.suppress(SurveyUnavailable):  # the trace below says why
                costs = tuple(_model_costs(job, model))
        else:
            log.warning(
                "model cannot run on meta; its outputs are checked by the stages",
                reason=str(exc),
            )
    if ranges is None:
        sizes = _balanced_split(costs, job.num_chunks) if costs is not None else None
        ranges = partition(job, balance=sizes if sizes is not None else "params")
        tied_groups(job, ranges)
    if _as_written(job):
        units_called = unit_names(job)
        chunk_plans(job, units_called, ranges, model)
        _check_sharded_calls(job, units_called, ranges)
        branching = branches_on_units(_trace(job, units_called))
        if branching:
            log.warning(
                f"the model's forward reads values computed by {', '.join(branching[:3])} "
                "(a branch or a Python number): where that changes which units run, a "
                "stage's forward differs from the traced one and stops naming the unit",
                units=branching,
            )
    elif job.model is not None and costs is not None:
        try:
            _check_model_stages(job, ranges)
        except SurveyUnavailable as exc:
            # The whole model ran on meta, its pruned stages do not: the model's
            # forward uses a module another stage holds.
            raise SpecError(
                "model",
                f"{exc}; the whole model runs, so its forward needs a module that this "
                "stage does not hold (keep shared modules and buffers on the root, skip "
                "modules that are None)",
            ) from exc
    params = tuple(sum(p.numel() for p in m.parameters()) for _, m in units)
    names = tuple(unit_names(job)) if job.model is not None else tuple(n for n, _ in units)
    return SplitPlan(names, tuple(len(r) for r in ranges), costs, params)


def _check_sharded_calls(job: Job, names: Sequence[str], ranges: Sequence[range]) -> None:
    """Refuse a sharded stage of several chunks that would hold calls of one module in
    two of them: FSDP shards a module as part of one chunk."""
    if job.shard == "none" or job.data_parallel < 2 or job.num_chunks < 2:
        return
    chunks: dict[tuple[str, int], set[int]] = {}
    for chunk, units in enumerate(ranges):
        stage = chunk_place(job.schedule, job.stages, chunk)[0]
        for i in units:
            if SLOT in names[i]:
                chunks.setdefault((module_of(names[i]), stage), set()).add(chunk)
    for (module, stage), held in sorted(chunks.items()):
        if len(held) > 1:
            raise SpecError(
                "shard",
                f"stage {stage} would hold calls of {module} in {len(held)} model chunks, "
                "and a sharded module belongs to one chunk: use shard='none', fewer "
                "virtual stages, or split_points that keep its calls in one chunk per stage",
            )


def build_layer(job: Job, index: int) -> nn.Module:
    """Build layer ``index`` on the CPU with its own RNG seed; the caller's RNG is untouched.

    The CPU generator is seeded to ``derive_seed(job.seed, "layer", index)``
    (and the default device forced to CPU) around the factory call, so a
    layer's initial weights depend only on the seed and its index.
    """
    assert job.layers is not None
    factory = job.layers[index]
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        # Only the CPU generator: torch.manual_seed would also reseed CUDA
        # generators outside the fork.
        torch.default_generator.manual_seed(derive_seed(job.seed, "layer", index))
        module = factory()
    if not isinstance(module, nn.Module):
        raise SpecError(
            "layers", f"layer {index} factory returned {type(module).__name__}, not an nn.Module"
        )
    return module


class StageModule(nn.ModuleDict):
    """The layers of one stage, keyed by their global index as a string.

    ``state_dict()`` keys therefore equal the unsplit model's (``"3.weight"``);
    as with ``nn.Sequential``, iterating yields the layers and ``module[3]``
    is layer 3.
    ``forward`` gives its arguments to the first layer and chains the others
    by the calling convention (`evtrain.stages.pytree.call`).
    """

    def __init__(self, layers: Mapping[int, nn.Module]) -> None:
        ordered = sorted(layers)
        if not ordered or ordered != list(range(ordered[0], ordered[0] + len(ordered))):
            raise ValueError(f"a stage needs a non-empty contiguous run of layers, got {ordered}")
        super().__init__({str(i): layers[i] for i in ordered})
        # Global indices of the units this stage holds.
        self.layer_range = range(ordered[0], ordered[-1] + 1)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        layers = iter(self.values())
        x = next(layers)(*args, **kwargs)
        for module in layers:
            x = call(module, x)
        return x

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        # Like nn.Sequential: iterating yields the layers, indexing takes the global index.
        return iter(self.values())

    def __getitem__(self, index: int | str) -> nn.Module:
        return super().__getitem__(str(index))

    def extra_repr(self) -> str:
        return f"layers={self.layer_range.start}..{self.layer_range.stop - 1}"


class KeptItems(nn.ModuleDict):
    """What a stage keeps of a pruned ``nn.ModuleList``: the items under their original indices.

    Iterating yields the modules (as iterating the list did), so a model's
    ``for block in self.h`` loop runs the stage's blocks; state_dict keys stay
    ``h.4.…``.
    """

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


class StageChunks(nn.ModuleDict):
    """The model chunks of one `Job.layers` stage under interleaved and zbv: every
    layer it holds, keyed by global index as in `StageModule` (so ``state_dict()``
    keys are the unsplit model's), and ``chunks``, one `StageModule` per chunk over
    the same layer objects, in the stage's chunk order. It has no forward of its
    own: the executor calls the chunks.
    """

    def __init__(self, chunks: Sequence[Mapping[int, nn.Module]]) -> None:
        views = [StageModule(c) for c in chunks]
        super().__init__({str(i): layer for c in chunks for i, layer in sorted(c.items())})
        # A plain attribute, not submodules: each layer is registered once, here.
        vars(self)["chunks"] = views

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


def build_stage_chunks(
    job: Job, unit_ranges: Sequence[range], device: torch.device | str = "cpu"
) -> nn.Module:
    """The stage module holding the chunks ``unit_ranges`` of one stage, on ``device``.

    Its ``chunks`` (a plain attribute) are the modules the executor runs, one per
    chunk in the stage's chunk order, and ``chunk_ranges`` their unit ranges:
    `StageChunks` for `Job.layers`; for `Job.model` the model pruned to all the
    chunks' units, whose chunks are views pruned to one chunk each (see the
    module docstring).
    """
    module: nn.Module
    if job.layers is not None:
        module = StageChunks([{i: build_layer(job, i) for i in r} for r in unit_ranges])
        module.to(device)
    else:
        names = unit_names(job)
        kept = sorted({i for r in unit_ranges for i in r})
        module = _build_model(job)
        _check_outside_params(module, names)
        ranges = partition(job)
        plans = chunk_plans(job, names, ranges, module) if _as_written(job) else None
        if plans is not None:
            held = set(modules_of([names[i] for i in kept]))
            for name in sorted(plans[0].placed - held):
                replace_unit(module, name, absent(module, name))
        else:
            _prune(module, names, kept)
        # Moved before the views are made: a move replaces buffers, which the
        # views share by identity.
        module.to(device)
        views = []
        for r in unit_ranges:
            units = [module.get_submodule(n) for n in modules_of([names[i] for i in r])]
            shared = {id(x): x for x in (*module.parameters(), *module.buffers(), *units)}
            view = copy.deepcopy(module, memo=shared)
            if plans is not None:
                install(view, names, r, plans[ranges.index(r)])
            else:
                _prune(view, names, r)
            vars(view)["layer_range"] = r
            set_stage_aliases(view, {})
            views.append(view)
        vars(module)["chunks"] = views
    aliases, copies = _tie_locally(module, tied_groups(job), {i for r in unit_ranges for i in r})
    vars(module).update(chunk_ranges=list(unit_ranges), layer_range=None)
    set_stage_aliases(module, aliases, copies)
    return module


def _build_model(job: Job) -> nn.Module:
    assert job.model is not None
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.default_generator.manual_seed(derive_seed(job.seed, "model"))
        model = job.model()
    if not isinstance(model, nn.Module):
        raise SpecError("model", f"the model factory returned {type(model).__name__}")
    return model


def _prune(model: nn.Module, names: Sequence[str], keep: Collection[int]) -> None:
    """Drop every unit outside ``keep`` from ``model`` (see the module docstring);
    ``model`` may be pruned already (a chunk's view of a stage's model)."""
    lists: dict[str, nn.ModuleList] = {}
    for i, name in enumerate(names):
        if i in keep:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, nn.ModuleDict):
            if child in parent:
                del parent[child]
        elif isinstance(parent, nn.ModuleList):
            lists[parent_name] = parent
        else:
            setattr(parent, child, None)
    kept_names = [names[i] for i in keep]

    def kept(prefix: str) -> bool:
        return any(n == prefix or n.startswith(prefix + ".") for n in kept_names)

    # Deepest first, so an outer list sees its inner lists already replaced.
    for list_name, old in sorted(lists.items(), key=lambda kv: -kv[0].count(".")):
        items = KeptItems({str(j): m for j, m in enumerate(old) if kept(f"{list_name}.{j}")})
        owner_name, _, attr = list_name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if isinstance(owner, nn.ModuleDict | nn.ModuleList):
            owner._modules[attr] = items
        else:
            setattr(owner, attr, items)


def _tie_locally(
    module: nn.Module, groups: Sequence[TiedGroup], held: Collection[int]
) -> tuple[dict[str, str], set[str]]:
    """Make the names of each group present in ``module`` (holding the units ``held``)
    one Parameter. Returns alias -> canonical, and the canonical names held here as a
    copy of a weight that the stage of the group's first unit saves."""
    present = dict(module.named_parameters(remove_duplicate=False))
    aliases: dict[str, str] = {}
    copies: set[str] = set()
    for group in groups:
        here = [n for n in group.names if n in present]
        if not here:
            continue
        if here[0] == group.names[0] and group.unit not in held:
            copies.add(group.names[0])
        keep = present[here[0]]
        for name in here[1:]:
            if present[name] is not keep:
                owner_name, _, attr = name.rpartition(".")
                setattr(module.get_submodule(owner_name), attr, keep)
        aliases.update({n: group.names[0] for n in here if n != group.names[0]})
    if aliases:
        _register_alias_hooks(module, aliases)
    return aliases, copies


def _register_alias_hooks(module: nn.Module, aliases: Mapping[str, str]) -> None:
    """A tied weight is kept once, under its canonical name.

    ``state_dict()`` drops the aliases; ``load_state_dict`` fills an absent
    alias from its canonical name, so the unsplit tied model loads a
    checkpoint export as is.
    """

    def drop(_module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
        for alias in aliases:
            state.pop(prefix + alias, None)

    def fill(state: dict[str, Any], prefix: str, *_args: Any) -> None:
        for alias, canonical in aliases.items():
            if prefix + alias not in state and prefix + canonical in state:
                state[prefix + alias] = state[prefix + canonical]

    module._register_state_dict_hook(drop)
    module._register_load_state_dict_pre_hook(fill)


def build_stage_module(
    job: Job, unit_range: range, device: torch.device | str = "cpu"
) -> nn.Module:
    """Build only the units in ``unit_range`` and move them to ``device``.

    For `Job.layers` the other factories are not called (see `build_layer`);
    for `Job.model` the whole model is built once on the CPU and pruned.
    The module's ``layer_range`` is ``unit_range``, and its aliases
    (`evtrain.checkpoint.state_tree.stage_aliases`) map each local name of a
    tied weight other than the canonical one to the canonical name (see
    `tied_groups`).
    """
    names = unit_names(job)
    if not len(unit_range) or unit_range.step != 1:
        raise ValueError(f"unit_range must be a non-empty contiguous range, got {unit_range}")
    if unit_range.start < 0 or unit_range.stop > len(names):
        raise ValueError(f"{unit_range} is outside the job's {len(names)} units")
    module: nn.Module
    if job.layers is not None:
        module = StageModule({i: build_layer(job, i) for i in unit_range})
    else:
        module = _build_model(job)
        _check_outside_params(module, names)
        if _as_written(job):
            ranges = partition(job)
            plans = chunk_plans(job, names, ranges, module)
            install(module, names, unit_range, plans[ranges.index(unit_range)])
        else:
            _prune(module, names, unit_range)
    vars(module)["layer_range"] = unit_range  # read back by `stage_units`
    set_stage_aliases(module, *_tie_locally(module, tied_groups(job), unit_range))
    return module.to(device)


def stage_units(module: nn.Module) -> Sequence[int]:
    """The units a module from `build_stage_module` (a range) or `build_stage_chunks`
    (every chunk's units, in order) holds."""
    chunk_ranges = vars(module).get("chunk_ranges")
    if chunk_ranges is not None:
        return [i for r in chunk_ranges for i in r]
    units = vars(module).get("layer_range")
    assert isinstance(units, range), "not a stage module"
    return units


def stage_unit_modules(job: Job, module: nn.Module) -> list[nn.Module]:
    """The unit modules a stage module holds, in order (layers, or a model's kept units)."""
    if isinstance(module, StageModule | StageChunks):
        return list(module)
    names = unit_names(job)
    return [module.get_submodule(n) for n in modules_of([names[i] for i in stage_units(module)])]


def build_full_model(job: Job, device: torch.device | str = "cpu") -> nn.Module:
    """The whole model, with the same weights any partition starts from and its ties tied.

    For `Job.layers` the layers chained as a `StageModule` (keys ``"3.weight"``).
    """
    module: nn.Module
    if job.layers is not None:
        module = StageModule({i: build_layer(job, i) for i in range(len(job.layers))})
    else:
        module = _build_model(job)
    _tie_locally(module, tied_groups(job), range(len(unit_names(job))))
    return module.to(device)


def tied_groups(job: Job, ranges: Sequence[range] | None = None) -> list[TiedGroup]:
    """The job's tied weights: `Job.tied` and, for `Job.model`, shared parameters.

    With ``ranges`` (the partition: one range per model chunk) each group says
    which stages hold it; a stage of several chunks holds the units of all of
    them (`evtrain.stages.schedules.chunk_place`), so zbv's input embedding and
    head, both on the last stage, are tied there without a message. Raises
    `SpecError` (``tied``) for a name that is no parameter, or parameters of
    different shapes.
    """
    if job.layers is not None and not job.tied:
        return []  # separate factories share no parameters
    held: list[set[int]] | None = None
    if ranges is not None:
        held = [set() for _ in range(job.stages)]
        for chunk, units in enumerate(ranges):
            held[chunk_place(job.schedule, job.stages, chunk)[0]].update(units)
    return resolve_ties(_unit_params(job), job.tied, held)
