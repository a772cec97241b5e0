"""Running a model's own ``forward``, unchanged, on one pipeline stage.

Every stage runs the model's ``forward`` from the top. A unit that another
stage holds is a *stand-in* there: it computes nothing and returns either the
output its own stage computed, sent along the pipeline because this stage
needs it, or a `StandIn` — zeros of the right shape and dtype that take no
memory. A stage that is not the last ends its forward where the model first
calls a unit of a later stage, and sends on its *boundary value*: the model's
inputs and every unit output of the forward so far, each leaf either a tensor
that a later stage needs or a StandIn, which crosses as its shape alone
(`evtrain.stages.pytree`).

Which leaves a stage needs is found once, from one traced forward of the
whole model (`trace_forward`): every leaf of the model's inputs and of each
unit's output is a *source*; model-level code spreads sources to what it
computes from them; a stage needs the sources of its units' arguments, of
the values its forward reads (``if mask.all():``) and, on the last stage, of
the model's output. So a mask built from the inputs is rebuilt on every
stage from the sent inputs, a U-Net's skip connection travels from the stage
of its encoder block to the stage of its decoder block, and an auxiliary loss
summed over the blocks reaches the last stage. A unit without parameters or
buffers (a dropout, an activation), and one without parameters whose output
depends on no other unit (a rotary embedding), runs on every stage that calls
it, like model-level code.

Inside a call of a unit, what it computes is *internal*: only the stage that
holds the unit has it. Two routes out besides the return value are *carries*,
sent like outputs: what the forward hooks of the unit's modules see (Hugging
Face's ``capture_outputs`` collects router logits, hidden states and
attentions so), which a stage standing in for the unit hands to the same
hooks, and an attribute the call sets on one of its modules, which the stand-in
sets too. Gradients flow back along both. An internal value the forward reads
by any other route (a list the unit appends to) is refused before launch,
naming the unit.

A unit the forward calls several times is split by its calls (``unit@k``,
`unit_slots`): a chunk that holds some of them has the real module, whose
calls held elsewhere return what was sent, as a stand-in's do (`_PerCall`).

A StandIn that still reaches real computation — a forward whose data flow
differs from the traced one — raises instead of computing with zeros: a unit
whose arguments hold one, a value read from one, one written into a real
tensor, or one in the model's output.
"""

from __future__ import annotations

import copy
import functools
import types
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_hooks_with_kwargs
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from evtrain.errors import SpecError
from evtrain.stages.pytree import (
    READS,
    SHAPE_ONLY,
    StandIn,
    StandInUsed,
    flatten,
    leaves_of,
    stand_in,
    unflatten,
    writes_into,
)

__all__ = [
    "INPUTS",
    "ChunkPlan",
    "ForwardTrace",
    "absent",
    "as_inputs",
    "branches_on_units",
    "call_slots",
    "calls_elsewhere",
    "install",
    "is_shadow",
    "module_of",
    "modules_of",
    "plan_chunks",
    "replace_unit",
    "split_boundaries",
    "trace_forward",
    "unit_slots",
]

INPUTS = "in"
"""The boundary value's key for the model's inputs: ``{"a": args, "k": kwargs}``."""

# ------------------------------------------------------------------- the trace


@dataclass(frozen=True)
class _Call:
    unit: str
    key: str
    """``unit#k``: the k-th call of the unit in one forward."""
    sources: frozenset[str]
    """The sources of the call's arguments and of every value it read."""


@dataclass(frozen=True)
class _Read:
    sources: frozenset[str]


@dataclass(frozen=True)
class Carry:
    """A value that leaves a call of a unit other than by its return value.

    Its key is ``unit#k/hook/rel#n`` for what the forward hooks of submodule
    ``rel`` saw at its n-th call (its arguments and output), and
    ``unit#k/attr/rel:name`` for an attribute the call set on submodule
    ``rel`` (``""``: the unit itself). The stage that holds the unit sends it
    like an output; a stage that stands in for the unit runs the hooks on it,
    or sets the attribute, where the call would have.
    """

    key: str
    rel: str
    attr: str | None = None
    """None: a forward hook's view."""

    @property
    def call(self) -> str:
        return self.key.partition("/")[0]


@dataclass(frozen=True)
class ForwardTrace:
    """What one forward of the whole model did, in the order it did it."""

    events: tuple[_Call | _Read, ...]
    """Calls of units (replicated ones left out) and reads of values."""
    output: frozenset[str]
    """The sources of the model's output."""
    replicated: frozenset[str]
    """Units without parameters or buffers, and units without parameters whose output
    depends on no unit: they run on every stage, as model-level code does."""
    carries: Mapping[str, tuple[Carry, ...]] = field(default_factory=dict)
    """By unit call: what left it other than by its return value."""
    kinds: Mapping[str, Any] = field(default_factory=dict)
    """By unit call: the container types of its output that a boundary drops (`kinds`)."""
    repeated: frozenset[str] = frozenset()
    """Units with parameters and no buffers that the forward calls several times:
    each call is a unit of the split (`unit_slots`), the module one tied weight."""
    module_calls: Mapping[str, int] = field(default_factory=dict)
    """How often the forward called each module that holds parameters, by name."""


SLOT = "@"
"""``unit@k``: the k-th call of a unit the forward calls several times, as a unit
of the split."""


def module_of(unit: str) -> str:
    """The module name of a unit of the split (``unit@k`` is a call of ``unit``)."""
    return unit.partition(SLOT)[0]


def modules_of(units: Sequence[str]) -> list[str]:
    """The modules of ``units``, each once, in order."""
    return list(dict.fromkeys(module_of(u) for u in units))


def _call_of(source: str) -> str | None:
    """The unit call (``unit#k``) whose output or carry a source is, None for an input."""
    if source.startswith(INPUTS + "/"):
        return None
    return source.partition("/")[0]


def _source_unit(source: str) -> str | None:
    """The unit whose output (or carry) a source is, None for an input."""
    call = _call_of(source)
    return None if call is None else call.partition("#")[0]


_INTERNAL = "/~"
"""The source suffix of a value computed inside a unit's call: only the stage
that holds the unit has it."""


def tensors_only(value: Any) -> Any:
    """``value`` with every leaf that is not a tensor (or a container of them) None."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple):
        return tuple(tensors_only(v) for v in value)
    if isinstance(value, list):
        return [tensors_only(v) for v in value]
    if isinstance(value, dict):
        return {k: tensors_only(v) for k, v in value.items() if isinstance(k, str)}
    return None


def kinds(value: Any) -> Any:
    """The container types of ``value`` that a boundary value drops (named tuples, a
    `ModelOutput` or other dict types), as ``(type, children)``; None where there are none."""
    if isinstance(value, tuple | list):
        items: Any = [kinds(v) for v in value]
    elif isinstance(value, dict):
        items = {k: kinds(v) for k, v in value.items()}
    else:
        return None
    plain = type(value) in (tuple, list, dict)
    if plain and all(c is None for c in (items.values() if isinstance(items, dict) else items)):
        return None
    return (type(value), items)


def retyped(value: Any, kind: Any) -> Any:
    """``value`` (as a boundary gives it) with the container types ``kind`` (`kinds`) restored."""
    if kind is None or value is None:
        return value
    cls, items = kind
    if isinstance(items, dict):
        fields = {k: retyped(value.get(k), c) for k, c in items.items()}
        return fields if cls is dict else cls(**fields)
    parts = [retyped(v, c) for v, c in zip(value, items, strict=True)]
    if cls is list:
        return parts
    if cls is tuple:
        return tuple(parts)
    return cls(*parts) if hasattr(cls, "_fields") else cls(parts)


@dataclass
class _Open:
    """A call of a unit with parameters, under way."""

    key: str
    internal: frozenset[str]
    seen: set[str] = field(default_factory=set)
    """The sources of every value the call read."""
    subcalls: Counter[str] = field(default_factory=Counter)
    attrs: dict[tuple[str, str], int] = field(default_factory=dict)
    """The ids of its modules' attributes when it began."""


class _Sources(TorchFunctionMode):
    """Spreads sources from the tensors an op reads to the tensors it returns.

    Inside a call of a unit with parameters, what an op returns is internal to
    the call (``unit#k/~``), except what depends on no tensor with a source
    or on no parameter or buffer (a constant). An internal value read outside
    its call is an *escape*: it left by a route no other stage can follow.
    """

    def __init__(self, state: set[int]) -> None:
        super().__init__()
        self.of: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.events: list[_Call | _Read] = []
        self.open: list[_Open | None] = []
        """Unit calls under way; None while a forward hook runs at model level."""
        self.state = state
        """The ids of the model's parameters and buffers."""
        self.escape: str | None = None
        self.carried: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Values a forward hook saw inside a unit's call: their carry sources."""

    @property
    def inside(self) -> _Open | None:
        return self.open[-1] if self.open else None

    def _of(self, t: torch.Tensor) -> frozenset[str] | None:
        s = self.of.get(t)
        if (
            s is not None
            and t in self.carried
            and any(x.endswith(_INTERNAL) for x in s)
            and not self._own(s)
        ):
            # An internal value that a forward hook saw: it leaves by the hook.
            return self.carried[t]
        return s

    def _own(self, sources: frozenset[str]) -> bool:
        inside = self.inside
        return inside is not None and inside.key + _INTERNAL in sources

    def sources(self, value: Any, check: bool = True) -> frozenset[str]:
        found: set[str] = set()
        for t in leaves_of(value):
            s = self._of(t)
            if s is not None:
                if check:
                    self._check(t, s)
                found |= s
        return frozenset(found)

    def _check(self, t: torch.Tensor, sources: frozenset[str]) -> None:
        if self.escape is not None:
            return
        inside = self.inside
        for s in sources:
            if s.endswith(_INTERNAL) and (inside is None or s != inside.key + _INTERNAL):
                unit, _, k = s.removesuffix(_INTERNAL).partition("#")
                self.escape = (
                    f"unit {unit} (call {k}) computes a {tuple(t.shape)} tensor that the "
                    "forward reads outside the unit, not through the unit's return value, "
                    "a forward hook of one of its modules or an attribute one of them "
                    "sets: another stage could not have it; return it from the unit's "
                    "forward or record it with a forward hook"
                )
                return

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        inside = self.inside
        out = func(*args, **kwargs)
        # A value, or a tensor computed from one; not a shape, a dtype or a device.
        computes = func in READS or (
            func not in SHAPE_ONLY and next(leaves_of(out), None) is not None
        )
        if inside is None:
            sources = self.sources((args, kwargs), check=computes)
            if sources and func in READS:
                self.events.append(_Read(sources))
            if sources and func not in SHAPE_ONLY:
                self._tag(func, args, kwargs, out, sources)
            return out
        internal = False
        for t in leaves_of((args, kwargs)):
            s = self._of(t)
            if s is not None:
                if computes:
                    self._check(t, s)
                inside.seen |= s
                internal = True
            elif id(t) in self.state:
                internal = True
        if internal and func not in SHAPE_ONLY:
            self._tag(func, args, kwargs, out, inside.internal, replace=True)
        return out

    def _tag(
        self,
        func: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        out: Any,
        sources: frozenset[str],
        replace: bool = False,
    ) -> None:
        target = writes_into(func, args, kwargs)
        if replace and target is None:
            # ``x.to(x.dtype)``, ``x.contiguous()``: an argument returned as it is
            # keeps its sources.
            given = {id(t) for t in leaves_of((args, kwargs))}
            for t in leaves_of(out):
                if id(t) not in given:
                    self.of[t] = sources
            return
        for t in leaves_of(out if target is None else (out, target)):
            self.of[t] = sources if replace else self.of.get(t, frozenset()) | sources


def as_inputs(value: Any) -> dict[str, Any]:
    """A model's inputs as the executor passes them (`evtrain.stages.pytree.call`)."""
    if isinstance(value, tuple | list):
        return {"a": list(value), "k": {}}
    if isinstance(value, dict):
        return {"a": [], "k": dict(value)}
    return {"a": [value], "k": {}}


def _foreign_hooks(module: nn.Module, ours: set[int]) -> bool:
    return bool(_global_forward_hooks) or any(h not in ours for h in module._forward_hooks)


def _attribute_ids(unit: nn.Module) -> dict[tuple[str, str], int]:
    return {
        (rel, attr): id(v) for rel, sub in unit.named_modules() for attr, v in vars(sub).items()
    }


class _Tracer:
    """The hooks of one traced forward: unit calls, their carries and escapes."""

    def __init__(self, model: nn.Module, units: Sequence[str]) -> None:
        self.mode = _Sources({id(t) for t in (*model.parameters(), *model.buffers())})
        self.params = {u: any(True for _ in model.get_submodule(u).parameters()) for u in units}
        self.stateless = {
            u: not self.params[u] and not any(True for _ in model.get_submodule(u).buffers())
            for u in units
        }
        self.counts: Counter[str] = Counter()
        self.replicated: set[str] = set()
        self.placed: set[str] = set()
        self.calls: list[int] = []  # indices in mode.events of the calls under way
        self.carries: dict[str, list[Carry]] = {}
        self.kinds: dict[str, Any] = {}
        self.ours: set[int] = set()
        self.windows: dict[int, list[Any]] = {}
        self.handles: list[Any] = []
        self.buffers = {u: any(True for _ in model.get_submodule(u).buffers()) for u in units}
        self.module_calls: Counter[int] = Counter()
        self.module_names: dict[int, list[str]] = {}
        for fqn, module in model.named_modules(remove_duplicate=False):
            if next(module.parameters(), None) is None:
                continue
            if id(module) not in self.module_names:
                self._hook(module.register_forward_pre_hook(self.count))
            self.module_names.setdefault(id(module), []).append(fqn)
        for name in units:
            unit = model.get_submodule(name)
            # Ours run after a model's own pre-hooks and before its own hooks:
            # those compute at model level, as on a stage that stands in for the unit.
            self._hook(
                unit.register_forward_pre_hook(
                    functools.partial(self.before, name), with_kwargs=True
                )
            )
            self._hook(
                unit.register_forward_hook(
                    functools.partial(self.after, name), with_kwargs=True, prepend=True
                )
            )
            if not self.params[name]:
                continue
            for rel, sub in unit.named_modules():
                if rel:
                    self._hook(
                        sub.register_forward_pre_hook(
                            functools.partial(self.sub_before, rel), with_kwargs=True
                        )
                    )
                    self._hook(
                        sub.register_forward_hook(
                            functools.partial(self.sub_after, rel),
                            with_kwargs=True,
                            prepend=True,
                        )
                    )

    def _hook(self, handle: Any) -> None:
        self.handles.append(handle)
        self.ours.add(handle.id)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def count(self, module: nn.Module, _args: Any) -> None:
        self.module_calls[id(module)] += 1

    @property
    def repeated(self) -> frozenset[str]:
        return frozenset(
            u for u, n in self.counts.items() if n > 1 and self.params[u] and not self.buffers[u]
        )

    def calls_by_name(self) -> dict[str, int]:
        return {
            fqn: self.module_calls[i] for i, names in self.module_names.items() for fqn in names
        }

    def before(self, name: str, unit: nn.Module, args: Any, kwargs: Any) -> None:
        if name in self.replicated:
            return
        mode = self.mode
        key = f"{name}#{self.counts[name]}"
        self.counts[name] += 1
        self.calls.append(len(mode.events))
        mode.events.append(_Call(name, key, mode.sources((args, kwargs))))
        if self.params[name]:
            mode.open.append(_Open(key, frozenset({key + _INTERNAL}), attrs=_attribute_ids(unit)))

    def after(self, name: str, unit: nn.Module, _args: Any, _kwargs: Any, out: Any) -> None:
        if name in self.replicated:
            return
        mode = self.mode
        index = self.calls.pop()
        call = mode.events[index]
        assert isinstance(call, _Call)
        opened: _Open | None = None
        if self.params[name]:
            opened = mode.open.pop()
            assert opened is not None and opened.key == call.key
            seen = {s for s in opened.seen if not s.startswith(call.key + "/")}
            mode.events[index] = _Call(name, call.key, call.sources | seen)
        elif name not in self.placed and (
            self.stateless[name] or not any(_source_unit(s) for s in mode.sources(out))
        ):
            # A function (dropout, an activation) or computed from the inputs and
            # constants alone: model-level code, which every stage runs.
            self.replicated.add(name)
            del mode.events[index]
            self.counts[name] -= 1
            return
        self.placed.add(name)
        if (kind := kinds(out)) is not None:
            self.kinds[call.key] = kind
        _tree, leaves = flatten(out, f"unit {name}")
        for i, t in enumerate(leaves):
            mode.of[t] = frozenset({f"{call.key}/{i}"})
        if opened is not None:
            self._attributes(call.key, unit, opened.attrs)

    def _attributes(self, key: str, unit: nn.Module, before: Mapping[tuple[str, str], int]) -> None:
        for rel, sub in unit.named_modules():
            for attr, value in vars(sub).items():
                if before.get((rel, attr)) == id(value) or next(leaves_of(value), None) is None:
                    continue
                carry = Carry(f"{key}/attr/{rel}:{attr}", rel, attr)
                self.carries.setdefault(key, []).append(carry)
                _tree, leaves = flatten(tensors_only(value), carry.key, wire=False)
                for i, t in enumerate(leaves):
                    kept = {s for s in self.mode.of.get(t, ()) if not s.endswith(_INTERNAL)}
                    self.mode.of[t] = frozenset({*kept, f"{carry.key}/{i}"})

    def sub_before(self, rel: str, sub: nn.Module, _args: Any, _kwargs: Any) -> None:
        inside = self.mode.inside
        window: list[Any] = [False, None]  # [whether the hooks run now, the closing hook]
        if inside is not None and _foreign_hooks(sub, self.ours):
            handle = sub.register_forward_hook(
                functools.partial(self.sub_close, id(sub)), with_kwargs=True, always_call=True
            )
            self.ours.add(handle.id)
            window[1] = handle
        self.windows.setdefault(id(sub), []).append(window)

    def sub_after(self, rel: str, sub: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        window = self.windows[id(sub)][-1]
        if window[1] is None:
            self.windows[id(sub)].pop()
            return
        mode = self.mode
        inside = mode.inside
        assert inside is not None
        n = inside.subcalls[rel]
        inside.subcalls[rel] += 1
        carry = Carry(f"{inside.key}/hook/{rel}#{n}", rel)
        self.carries.setdefault(inside.key, []).append(carry)
        _tree, leaves = flatten(tensors_only((args, kwargs, out)), carry.key, wire=False)
        for i, t in enumerate(leaves):
            mode.carried[t] = mode.carried.get(t, frozenset()) | {f"{carry.key}/{i}"}
        # The model's own hooks run now, at model level, on what they are given.
        window[0] = True
        mode.open.append(None)

    def sub_close(self, sub_id: int, *_args: Any) -> None:
        opened, handle = self.windows[sub_id].pop()
        handle.remove()
        self.ours.discard(handle.id)
        if opened:
            self.mode.open.pop()


def trace_forward(model: nn.Module, inputs: Any, units: Sequence[str]) -> ForwardTrace:
    """Run ``model`` once on ``inputs`` (``{"a": args, "k": kwargs}``) and trace its data flow.

    Runs where ``model`` and ``inputs`` are (the meta device costs nothing; a
    forward that reads values needs real ones), without gradients, with the
    RNG untouched. Raises `SpecError` for a value that escapes a unit.
    """
    tracer = _Tracer(model, units)
    mode = tracer.mode
    _tree, leaves = flatten(inputs, "the model's inputs")
    for i, t in enumerate(leaves):
        mode.of[t] = mode.of.get(t, frozenset()) | {f"{INPUTS}/{i}"}
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), mode:
            out = model(*inputs["a"], **inputs["k"])
        output = mode.sources(out)
        if getattr(out, "past_key_values", None) is not None:
            # A key/value cache is state that would have to cross stages every step.
            raise SpecError(
                "model",
                "its forward returns a key/value cache (past_key_values); a pipeline "
                "trains without one: build the model with use_cache=False",
            )
    finally:
        tracer.remove()
    if mode.escape is not None:
        raise SpecError("model", mode.escape)
    return ForwardTrace(
        tuple(mode.events),
        output,
        frozenset(tracer.replicated),
        {k: tuple(v) for k, v in tracer.carries.items()},
        tracer.kinds,
        tracer.repeated,
        tracer.calls_by_name(),
    )


# -------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ChunkPlan:
    """What one model chunk's forward keeps, stands in for and sends."""

    chunk: int
    num_chunks: int
    chunk_of: Mapping[str, int]
    """The model chunk of every traced call (``unit#k``) of a placed unit."""
    placed: frozenset[str]
    """The units (modules) some chunk holds: every unit not replicated."""
    send: frozenset[str]
    """The sources (``in/i``, ``unit#k/i``, ``<carry>/i``) sent as tensors;
    every other leaf crosses as a StandIn."""
    carries: Mapping[str, tuple[Carry, ...]] = field(default_factory=dict)
    """By unit call: the carries some chunk needs."""
    kinds: Mapping[str, Any] = field(default_factory=dict)
    """By unit call: its output's container types (`kinds`)."""

    @property
    def first(self) -> bool:
        return self.chunk == 0

    @property
    def last(self) -> bool:
        return self.chunk == self.num_chunks - 1

    def chunk_of_call(self, key: str) -> int:
        chunk = self.chunk_of.get(key)
        if chunk is None:
            raise StandInUsed(
                f"the forward calls {key.partition('#')[0]} more often than its traced "
                "forward did: the model's units run in an order that depends on the data"
            )
        return chunk

    def shared_calls(self, unit: str) -> bool:
        """Whether another chunk holds some calls of ``unit`` (a module called at several
        points, with a stage boundary between its calls)."""
        calls = [c for k, c in self.chunk_of.items() if k.partition("#")[0] == unit]
        return len(set(calls)) > 1


def call_slots(names: Sequence[str]) -> Callable[[str], int]:
    """The index in ``names`` (units of the split) of the unit that makes call
    ``unit#k``: ``unit@k`` for a unit split by its calls, else ``unit`` (-1: none)."""
    index = {n: i for i, n in enumerate(names)}

    def slot(key: str) -> int:
        return index.get(_slot_name(key), index.get(key.partition("#")[0], -1))

    return slot


def plan_chunks(
    trace: ForwardTrace, names: Sequence[str], ranges: Sequence[range]
) -> list[ChunkPlan]:
    """One `ChunkPlan` per model chunk (``ranges``: each chunk's indices in ``names``,
    the units of the split, `unit_slots`).

    Raises `SpecError` when the model's forward calls its units in an order
    the chunks cannot follow.
    """
    slot = call_slots(names)
    chunk_at = {i: c for c, r in enumerate(ranges) for i in r}
    calls = [e for e in trace.events if isinstance(e, _Call)]
    chunk_of = {e.key: chunk_at[slot(e.key)] for e in calls}
    n = len(ranges)
    needed: list[set[str]] = [set() for _ in range(n)]
    reached = 0  # the furthest chunk whose unit the forward has called
    for event in trace.events:
        if isinstance(event, _Read):
            # Every chunk whose forward gets this far reads the value.
            for c in range(reached, n):
                needed[c] |= event.sources
            continue
        c = chunk_of[event.key]
        if c < reached:
            later = next(e for e in calls if chunk_of[e.key] == reached)
            raise SpecError(
                "split_points",
                f"the model's forward calls {names[slot(event.key)]} after "
                f"{names[slot(later.key)]}, which a later stage holds; split the model "
                "where its forward moves on for good",
            )
        reached = c
        needed[c] |= event.sources
    needed[n - 1] |= trace.output
    for c, sources in enumerate(needed):
        for s in sorted(sources):
            key = _call_of(s)
            if key is not None and chunk_of[key] > c:
                raise SpecError(
                    "split_points",
                    f"unit {names[slot(key)]} is placed after a unit that takes its output; "
                    "split the model in the order its forward calls the units",
                )
    wanted = {s.rpartition("/")[0] for s in set().union(*needed)}
    carries = {
        call: kept
        for call, cs in trace.carries.items()
        if (kept := tuple(c for c in cs if c.key in wanted))
    }
    placed = frozenset(module_of(u) for u in names) - trace.replicated
    plans = []
    for c in range(n):
        downstream: set[str] = set().union(*needed[c + 1 :])
        send = {s for s in downstream if (k := _call_of(s)) is None or chunk_of[k] <= c}
        plans.append(ChunkPlan(c, n, chunk_of, placed, frozenset(send), carries, trace.kinds))
    return plans


def unit_slots(trace: ForwardTrace, names: Sequence[str]) -> list[str]:
    """The units of the split: ``names`` (modules, in registration order) in the order
    the forward first calls them, a unit it calls several times (`ForwardTrace.repeated`)
    as one unit per call, ``unit@k``, each where the forward makes that call. A unit it
    never calls (or runs on every stage) stays after the unit before it."""
    position: dict[str, int] = {}
    for i, e in enumerate(e for e in trace.events if isinstance(e, _Call)):
        position.setdefault(e.unit if e.unit not in trace.repeated else _slot_name(e.key), i)
    keys, last = [], -1
    for r, name in enumerate(names):
        if name in trace.repeated:
            calls = sorted((p, u) for u, p in position.items() if module_of(u) == name)
            for p, u in calls:
                keys.append(((p, False, r), u))
            last = calls[0][0]
            continue
        last = position.get(name, last)
        keys.append(((last, name not in position, r), name))
    return [name for _, name in sorted(keys)]


def _slot_name(key: str) -> str:
    unit, _, k = key.partition("#")
    return f"{unit}{SLOT}{k}"


def branches_on_units(trace: ForwardTrace) -> list[str]:
    """The units whose outputs model-level code reads as values (a branch, a number):
    where the forward's path depends on them, the trace shows one path only."""
    return sorted(
        {
            u
            for e in trace.events
            if isinstance(e, _Read)
            for s in e.sources
            if (u := _source_unit(s)) is not None
        }
    )


def split_boundaries(trace: ForwardTrace, names: Sequence[str]) -> frozenset[int]:
    """The indices ``b`` of ``names`` (units of the split) before which a stage may
    begin: the forward calls no unit before ``b`` once it has called one from ``b`` on."""
    slot = call_slots(names)
    calls = [slot(e.key) for e in trace.events if isinstance(e, _Call)]
    allowed = set()
    for b in range(1, len(names)):
        moved_on = False
        for u in calls:
            if u >= b:
                moved_on = True
            elif moved_on:
                break
        else:
            allowed.add(b)
    return frozenset(allowed)


# ------------------------------------------------------------- a chunk's forward


class _StageEnd(BaseException):
    """Raised where a non-last chunk's forward reaches a later chunk's unit; a
    BaseException, so that a model's own ``except Exception`` lets it through."""


@dataclass
class _Run:
    """The state of one forward of a chunk."""

    feed: Mapping[str, Any]
    outputs: dict[str, Any] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    current: str | None = None
    """The call of a held unit under way."""
    subcalls: Counter[str] = field(default_factory=Counter)
    """Its submodules' calls so far."""

    def key(self, unit: str) -> str:
        k = self.counts[unit]
        self.counts[unit] += 1
        return f"{unit}#{k}"


class _Chunk:
    """The shared state of one chunk's stand-ins and held units."""

    def __init__(self, plan: ChunkPlan) -> None:
        self.plan = plan
        self.run: _Run | None = None

    def stand_in_for(self, unit: str, shadow: nn.Module) -> Any:
        run = self.run
        if run is None:
            raise StandInUsed(f"{unit} is held by another stage and ran outside the forward")
        key = run.key(unit)
        if self.plan.chunk_of_call(key) > self.plan.chunk:
            raise _StageEnd
        return self._stand_in(run, key, shadow)

    def _stand_in(self, run: _Run, key: str, module: nn.Module) -> Any:
        """What call ``key`` of a unit another chunk computed returns here (``module``:
        the unit, or its shadow), its carries handed to ``module``'s hooks or set on it."""
        value = retyped(self._fed(run, key), self.plan.kinds.get(key))
        run.outputs[key] = value
        for carry in self.plan.carries.get(key, ()):
            carried = run.outputs[carry.key] = self._fed(run, carry.key)
            sub = module.get_submodule(carry.rel)
            if carry.attr is not None:
                vars(sub)[carry.attr] = carried
            else:
                _run_forward_hooks(sub, *carried)
        return value

    @staticmethod
    def _fed(run: _Run, key: str) -> Any:
        if key not in run.feed:
            unit = key.partition("#")[0]
            raise StandInUsed(
                f"the forward calls {unit} ({key.partition('/')[0]}), which the stage that "
                "holds it did not call: the model's units run in an order that depends on "
                "the data"
            )
        return run.feed[key]

    def standing_in(self, unit: str, shadow: nn.Module) -> Callable[..., Any]:
        """The ``forward`` of ``shadow``, which stands in for ``unit``."""

        def forward(*_args: Any, **_kwargs: Any) -> Any:
            return self.stand_in_for(unit, shadow)

        return forward

    def begin(self, unit: str, module: nn.Module, args: Any) -> None:
        """A call of a held unit begins: this chunk computes it, or, for a unit called
        at several points (`_PerCall`), another chunk did or will."""
        run = self.run
        if run is None:
            return
        key = run.key(unit)
        chunk = self.plan.chunk_of_call(key)
        if chunk != self.plan.chunk:
            per_call = vars(module).get(_PER_CALL)
            if per_call is None:
                raise StandInUsed(
                    f"the forward calls {unit} ({key}), which the stage that holds it did "
                    "not call: the model's units run in an order that depends on the data"
                )
            if chunk > self.plan.chunk:
                raise _StageEnd
            per_call.given = self._stand_in(run, key, module)
            return
        if any(isinstance(t, StandIn) for t in leaves_of(args)):
            raise StandInUsed(
                f"{unit} receives a value that another stage computes and that was not "
                "sent: the model's data flow differs from its traced forward"
            )
        run.current = key
        run.subcalls.clear()

    def hooked(self, rel: str, args: Any, kwargs: Any, out: Any) -> None:
        """A submodule of the held unit under way ran: keep what its hooks saw, if carried."""
        run = self.run
        if run is None or run.current is None:
            return
        n = run.subcalls[rel]
        run.subcalls[rel] += 1
        key = f"{run.current}/hook/{rel}#{n}"
        if key in self.carried:
            run.outputs[key] = tensors_only((args, kwargs, out))

    def record(self, unit: nn.Module, out: Any) -> None:
        run = self.run
        if run is None or run.current is None:
            return
        run.outputs[run.current] = out
        for carry in self.plan.carries.get(run.current, ()):
            if carry.attr is not None:
                value = getattr(unit.get_submodule(carry.rel), carry.attr, None)
                run.outputs[carry.key] = tensors_only(value)
        run.current = None

    @functools.cached_property
    def carried(self) -> frozenset[str]:
        return frozenset(c.key for cs in self.plan.carries.values() for c in cs)

    def boundary(self, inputs: Any) -> dict[str, Any]:
        """What this chunk sends: the inputs and unit outputs, leaves not sent as StandIns."""
        run = self.run
        assert run is not None
        value = {INPUTS: self._mark(INPUTS, inputs)}
        for key, out in run.outputs.items():
            value[key] = self._mark(key, out)
        return value

    def _mark(self, key: str, value: Any) -> Any:
        tree, leaves = flatten(value, key, wire=False)
        marked, changed = [], False
        for i, t in enumerate(leaves):
            sent = f"{key}/{i}" in self.plan.send
            if sent and isinstance(t, StandIn):
                raise StandInUsed(f"{key} is needed by a later stage but never reached this one")
            if not sent and not isinstance(t, StandIn):
                t, changed = stand_in(t.shape, t.dtype, t.device), True
            marked.append(t)
        return unflatten(tree, marked) if changed else value


_PER_CALL = "_evtrain_per_call"
"""The attribute of a unit held here for some of its calls: its `_PerCall`."""

_UNSET: Any = object()


class _PerCall:
    """The ``forward`` of a unit that this stage holds for some of its calls only (a
    module the forward calls at several points, with a stage boundary between them).

    The unit is real, so the calls this stage holds compute; for a call another
    stage holds, `_Chunk.begin` (a forward pre-hook, outside any activation
    checkpoint) gives what that stage sent, which the call returns. A call with
    nothing given computes: the recompute of an activation checkpoint is always
    one of this stage's calls.
    """

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward
        self.given: Any = _UNSET

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        given, self.given = self.given, _UNSET
        if given is _UNSET:
            return self.forward(*args, **kwargs)
        return given


def calls_elsewhere(module: nn.Module) -> bool:
    """Whether another stage or chunk holds some calls of the unit ``module``."""
    return _PER_CALL in vars(module)


_ABSENT = "_evtrain_absent"
"""A shadow module's attribute: the names of its parameters and buffers, now stand-ins."""


def is_shadow(module: nn.Module) -> bool:
    """Whether ``module`` is (inside) the shadow of a unit another stage holds."""
    return _ABSENT in vars(module)


def shadow(model: nn.Module, name: str, forward: Callable[..., Any]) -> nn.Module:
    """What a stage has in place of ``model``'s unit ``name``, which another stage holds.

    A copy of the unit's module tree, of the same classes, that holds no
    parameters or buffers: each is a `StandIn` of its shape, dtype and device,
    a plain attribute that ``parameters()``, ``state_dict()`` and the
    optimizer do not see, and ``.to()`` moves. So the model's own code reads
    what it reads of an absent unit (``self.embeddings.patch_embeddings``,
    a weight's dtype, its config), hooks a model installs by module class
    install on it, and reading a value of its weights raises, naming them.
    The copy's ``forward`` is ``forward``. What the unit refers to outside
    itself (the model, through a bound-method hook; a list of the model's) is
    not copied.
    """
    unit = model.get_submodule(name)
    inside = {id(m) for m in unit.modules()}
    memo: dict[int, Any] = {
        id(x): x
        for m in model.modules()
        if id(m) not in inside
        for x in (m, *(v for k, v in vars(m).items() if not k.startswith("_")))
    }
    for fqn, module in unit.named_modules(remove_duplicate=False):
        for attr in (*module._parameters, *module._buffers):
            t = getattr(module, attr)
            if t is not None and id(t) not in memo:
                full = f"{name}.{fqn}.{attr}" if fqn else f"{name}.{attr}"
                memo[id(t)] = stand_in(t.shape, t.dtype, t.device, of=full)
    copied = copy.deepcopy(unit, memo)
    for module in copied.modules():
        absent = [*vars(module).get(_ABSENT, ()), *module._parameters, *module._buffers]
        vars(module).update(module._parameters)
        vars(module).update(module._buffers)
        module._parameters.clear()
        module._buffers.clear()
        module._non_persistent_buffers_set.clear()
        vars(module)[_ABSENT] = tuple(absent)
        vars(module)["_apply"] = types.MethodType(_apply_to_shadow, module)
    vars(copied)["forward"] = forward
    return copied


def _apply_to_shadow(self: nn.Module, fn: Callable[..., Any], recurse: bool = True) -> nn.Module:
    """``Module._apply`` for a shadow: a move or cast of its stand-ins, as ``fn``
    would move or cast the tensors they stand in for."""
    if recurse:
        for child in self.children():
            child._apply(fn)
    for attr in vars(self)[_ABSENT]:
        t = vars(self)[attr]
        if isinstance(t, StandIn):
            moved = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            vars(self)[attr] = stand_in(t.shape, moved.dtype, moved.device, of=t._of)
    return self


def _absent_forward(*_args: Any, **_kwargs: Any) -> Any:
    raise StandInUsed("a stage of several model chunks runs each chunk, not itself")


def _run_forward_hooks(module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
    """Run ``module``'s forward hooks as its call would have, on what they saw there."""
    for hook_id, hook in (*_global_forward_hooks.items(), *module._forward_hooks.items()):
        if (
            hook_id in module._forward_hooks_with_kwargs
            or hook_id in _global_forward_hooks_with_kwargs
        ):
            hook(module, args, kwargs, out)
        else:
            hook(module, args, out)


def absent(model: nn.Module, name: str) -> nn.Module:
    """``model``'s unit ``name`` where no model chunk of this stage holds it, in a stage
    module of several chunks: each chunk's view of it stands in for the unit (`install`)."""
    return shadow(model, name, _absent_forward)


def replace_unit(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where unit ``name`` is, in a container or as an attribute."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent._modules[child] = new


def install(model: nn.Module, names: Sequence[str], held: Sequence[int], plan: ChunkPlan) -> None:
    """Make ``model`` run as model chunk ``plan.chunk``, holding the units ``held``.

    Every placed unit outside ``held`` becomes a stand-in (its parameters
    are freed); the model's forward, called as the executor calls a chunk,
    takes the model's inputs on the first chunk and a boundary value on the
    others, and returns the boundary value it sends, or on the last chunk the
    model's output.
    """
    chunk = _Chunk(plan)
    kept = set(modules_of([names[i] for i in held]))
    for name in modules_of(names):
        if name not in plan.placed or name in kept:
            continue
        copied = shadow(model, name, _absent_forward)
        vars(copied)["forward"] = chunk.standing_in(name, copied)
        replace_unit(model, name, copied)
    hooked = {(c.call.partition("#")[0], c.rel) for cs in plan.carries.values() for c in cs}
    for name in sorted(kept & plan.placed):
        unit = model.get_submodule(name)
        if plan.shared_calls(name) and _PER_CALL not in vars(unit):
            # Installed once: the chunks of one stage share their units.
            per_call = _PerCall(unit.forward)
            vars(unit)[_PER_CALL] = per_call
            vars(unit)["forward"] = per_call
        unit.register_forward_pre_hook(
            lambda m, args, kwargs, name=name: chunk.begin(name, m, (args, kwargs)),
            with_kwargs=True,
        )
        # Before the model's own hooks, which a stage standing in for the unit
        # runs on what this one records.
        unit.register_forward_hook(lambda m, _a, out: chunk.record(m, out), prepend=True)
        for unit_name, rel in hooked:
            if unit_name == name and rel:
                unit.get_submodule(rel).register_forward_hook(
                    lambda _m, a, k, out, rel=rel: chunk.hooked(rel, a, k, out),
                    with_kwargs=True,
                    prepend=True,
                )
    vars(model)["_evtrain_chunk"] = chunk
    vars(model)["forward"] = types.MethodType(_chunk_forward, model)


def _chunk_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    chunk: _Chunk = vars(self)["_evtrain_chunk"]
    plan = chunk.plan
    feed: dict[str, Any] = {}
    inputs: dict[str, Any]
    if plan.first:
        inputs = {"a": list(args), "k": dict(kwargs)}
    else:
        feed = dict(kwargs)
        inputs = feed.pop(INPUTS)
    chunk.run = _Run(feed)
    try:
        try:
            out = type(self).forward(self, *inputs["a"], **inputs["k"])
        except _StageEnd:
            return chunk.boundary(inputs)
        if not plan.last:
            # The forward ended before any later chunk's unit: send what it made.
            return chunk.boundary(inputs)
    finally:
        chunk.run = None
    if any(isinstance(t, StandIn) for t in leaves_of(out)):
        raise StandInUsed(
            "the model's output holds a value that another stage computes and that was "
            "not sent: the model's data flow differs from its traced forward"
        )
    return out
