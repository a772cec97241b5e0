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
summed over the blocks reaches the last stage. A unit without parameters
whose output depends on no other unit (a rotary embedding) runs on every
stage, like model-level code.

A StandIn that still reaches real computation — a forward whose data flow
differs from the traced one — raises instead of computing with zeros: a unit
whose arguments hold one, a value read from one, one written into a real
tensor, or one in the model's output.
"""

from __future__ import annotations

import copy
import types
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
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
    "install",
    "is_shadow",
    "plan_chunks",
    "replace_unit",
    "trace_forward",
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
    """The sources of the call's arguments."""


@dataclass(frozen=True)
class _Read:
    sources: frozenset[str]


@dataclass(frozen=True)
class ForwardTrace:
    """What one forward of the whole model did, in the order it did it."""

    events: tuple[_Call | _Read, ...]
    """Calls of units (replicated ones left out) and reads of values."""
    output: frozenset[str]
    """The sources of the model's output."""
    replicated: frozenset[str]
    """Units without parameters whose output depends on no unit: they run on every stage."""


def _source_unit(source: str) -> str | None:
    """The unit whose output a source is, None for an input."""
    if source.startswith(INPUTS + "/"):
        return None
    return source.partition("#")[0]


class _Sources(TorchFunctionMode):
    """Spreads sources from the tensors an op reads to the tensors it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.of: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.events: list[_Call | _Read] = []
        self.quiet = 0
        """Inside a unit with parameters: its output gets fresh sources anyway."""

    def sources(self, value: Any) -> frozenset[str]:
        found: set[str] = set()
        for t in leaves_of(value):
            found |= self.of.get(t, frozenset())
        return frozenset(found)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.quiet:
            return func(*args, **kwargs)
        sources = self.sources((args, kwargs))
        if sources and func in READS:
            self.events.append(_Read(sources))
        out = func(*args, **kwargs)
        if sources and func not in SHAPE_ONLY:
            target = writes_into(func, args, kwargs)
            for t in leaves_of(out if target is None else (out, target)):
                self.of[t] = self.of.get(t, frozenset()) | sources
        return out


def as_inputs(value: Any) -> dict[str, Any]:
    """A model's inputs as the executor passes them (`evtrain.stages.pytree.call`)."""
    if isinstance(value, tuple | list):
        return {"a": list(value), "k": {}}
    if isinstance(value, dict):
        return {"a": [], "k": dict(value)}
    return {"a": [value], "k": {}}


def trace_forward(model: nn.Module, inputs: Any, units: Sequence[str]) -> ForwardTrace:
    """Run ``model`` once on ``inputs`` (``{"a": args, "k": kwargs}``) and trace its data flow.

    Runs where ``model`` and ``inputs`` are (the meta device costs nothing; a
    forward that reads values needs real ones), without gradients, with the
    RNG untouched.
    """
    mode = _Sources()
    params = {u: any(True for _ in model.get_submodule(u).parameters()) for u in units}
    counts: Counter[str] = Counter()
    replicated: set[str] = set()
    placed: set[str] = set()
    open_calls: list[int] = []  # indices in mode.events of the calls under way
    handles = []

    def before(name: str, _m: nn.Module, args: Any, kwargs: Any) -> None:
        if name in replicated:
            return
        key = f"{name}#{counts[name]}"
        counts[name] += 1
        open_calls.append(len(mode.events))
        mode.events.append(_Call(name, key, mode.sources((args, kwargs))))
        if params[name]:
            mode.quiet += 1

    def after(name: str, _m: nn.Module, _args: Any, _kwargs: Any, out: Any) -> None:
        if name in replicated:
            return
        index = open_calls.pop()
        call = mode.events[index]
        assert isinstance(call, _Call)
        if params[name]:
            mode.quiet -= 1
        elif name not in placed and not any(_source_unit(s) for s in mode.sources(out)):
            # Computed from the inputs and constants alone: model-level code,
            # which every stage runs.
            replicated.add(name)
            del mode.events[index]
            counts[name] -= 1
            return
        placed.add(name)
        _tree, leaves = flatten(out, f"unit {name}")
        for i, t in enumerate(leaves):
            mode.of[t] = frozenset({f"{call.key}/{i}"})

    for name in units:
        module = model.get_submodule(name)
        handles.append(
            module.register_forward_pre_hook(
                lambda m, a, k, name=name: before(name, m, a, k), with_kwargs=True
            )
        )
        handles.append(
            module.register_forward_hook(
                lambda m, a, k, o, name=name: after(name, m, a, k, o), with_kwargs=True
            )
        )
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
        for h in handles:
            h.remove()
    return ForwardTrace(tuple(mode.events), output, frozenset(replicated))


# -------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ChunkPlan:
    """What one model chunk's forward keeps, stands in for and sends."""

    chunk: int
    num_chunks: int
    chunk_of: Mapping[str, int]
    """The model chunk of every unit that is placed (not replicated)."""
    send: frozenset[str]
    """The sources (``in/i``, ``unit#k/i``) sent as tensors; every other leaf
    crosses as a StandIn."""

    @property
    def first(self) -> bool:
        return self.chunk == 0

    @property
    def last(self) -> bool:
        return self.chunk == self.num_chunks - 1


def plan_chunks(
    trace: ForwardTrace, names: Sequence[str], ranges: Sequence[range]
) -> list[ChunkPlan]:
    """One `ChunkPlan` per model chunk (``ranges``: each chunk's unit indices).

    Raises `SpecError` when the model's forward calls its units in an order
    the chunks cannot follow.
    """
    chunk_of = {
        names[i]: c for c, r in enumerate(ranges) for i in r if names[i] not in trace.replicated
    }
    n = len(ranges)
    needed: list[set[str]] = [set() for _ in range(n)]
    reached = 0  # the furthest chunk whose unit the forward has called
    for event in trace.events:
        if isinstance(event, _Read):
            # Every chunk whose forward gets this far reads the value.
            for c in range(reached, n):
                needed[c] |= event.sources
            continue
        c = chunk_of[event.unit]
        if c < reached:
            later = next(
                e.unit for e in trace.events if isinstance(e, _Call) and chunk_of[e.unit] == reached
            )
            raise SpecError(
                "split_points",
                f"the model's forward calls {event.unit} after {later}, which a later "
                "stage holds; split the model where its forward moves on for good",
            )
        reached = c
        needed[c] |= event.sources
    needed[n - 1] |= trace.output
    for c, sources in enumerate(needed):
        for s in sorted(sources):
            unit = _source_unit(s)
            if unit is not None and chunk_of[unit] > c:
                raise SpecError(
                    "split_points",
                    f"unit {unit} is placed after a unit that takes its output; split the "
                    "model in the order its forward calls the units",
                )
    plans = []
    for c in range(n):
        downstream: set[str] = set().union(*needed[c + 1 :])
        send = {s for s in downstream if (u := _source_unit(s)) is None or chunk_of[u] <= c}
        plans.append(ChunkPlan(c, n, chunk_of, frozenset(send)))
    return plans


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

    def key(self, unit: str) -> str:
        k = self.counts[unit]
        self.counts[unit] += 1
        return f"{unit}#{k}"


class _Chunk:
    """The shared state of one chunk's stand-ins and held units."""

    def __init__(self, plan: ChunkPlan) -> None:
        self.plan = plan
        self.run: _Run | None = None

    def stand_in_for(self, unit: str) -> Any:
        run = self.run
        if run is None:
            raise StandInUsed(f"{unit} is held by another stage and ran outside the forward")
        if self.plan.chunk_of[unit] > self.plan.chunk:
            raise _StageEnd
        key = run.key(unit)
        if key not in run.feed:
            raise StandInUsed(
                f"the forward calls {unit} ({key}), which the stage that holds it did not "
                "call: the model's units run in an order that depends on the data"
            )
        value = run.feed[key]
        run.outputs[key] = value
        return value

    def standing_in(self, unit: str) -> Callable[..., Any]:
        """The ``forward`` of the shadow of ``unit``."""

        def forward(*_args: Any, **_kwargs: Any) -> Any:
            return self.stand_in_for(unit)

        return forward

    def check_args(self, unit: str, args: Any) -> None:
        if self.run is not None and any(isinstance(t, StandIn) for t in leaves_of(args)):
            raise StandInUsed(
                f"{unit} receives a value that another stage computes and that was not "
                "sent: the model's data flow differs from its traced forward"
            )

    def record(self, unit: str, out: Any) -> None:
        if self.run is not None:
            self.run.outputs[self.run.key(unit)] = out

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


_ABSENT = "_evtrain_absent"
"""A shadow module's attribute: the names of its parameters and buffers, now stand-ins."""


def is_shadow(module: nn.Module) -> bool:
    """Whether ``module`` is (inside) the shadow of a unit another stage holds."""
    return _ABSENT in vars(module)


def shadow(unit: nn.Module, name: str, forward: Callable[..., Any]) -> nn.Module:
    """What a stage has in place of unit ``name``, which another stage holds.

    A copy of the unit's module tree, of the same classes, that holds no
    parameters or buffers: each is a `StandIn` of its shape, dtype and device,
    a plain attribute that ``parameters()``, ``state_dict()`` and the
    optimizer do not see, and ``.to()`` moves. So the model's own code reads
    what it reads of an absent unit (``self.embeddings.patch_embeddings``,
    a weight's dtype, its config), hooks a model installs by module class
    install on it, and reading a value of its weights raises, naming them.
    The copy's ``forward`` is ``forward``.
    """
    memo: dict[int, Any] = {}
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


def absent(unit: nn.Module, name: str) -> nn.Module:
    """A unit that no model chunk of this stage holds, in a stage module of several
    chunks: each chunk's view of it stands in for the unit (`install`)."""
    return shadow(unit, name, _absent_forward)


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
    kept = {names[i] for i in held}
    for name in names:
        if name not in plan.chunk_of or name in kept:
            continue
        replace_unit(
            model,
            name,
            shadow(model.get_submodule(name), name, chunk.standing_in(name)),
        )
    for name in kept:
        if name not in plan.chunk_of:
            continue
        unit = model.get_submodule(name)
        unit.register_forward_pre_hook(
            lambda _m, args, kwargs, name=name: chunk.check_args(name, (args, kwargs)),
            with_kwargs=True,
        )
        unit.register_forward_hook(lambda _m, _a, out, name=name: chunk.record(name, out))
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
