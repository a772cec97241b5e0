"""Tied weights: one parameter held by several stages (an embedding and an LM head,
a module the forward calls on several stages).

DeepSpeed's ``TiedLayerSpec`` semantics: every stage that holds a name of a
tied group holds its own copy of the weight, and the copies stay equal
because they start equal and take equal steps:

* initialization: the stage holding the canonical (first) name broadcasts
  its value to the others of the group once, before training (`TiedWeights.sync`);
* gradients: summed over the group's stages (an all-reduce on a process
  group of just those stages) before clipping and the optimizer step, so
  every copy gets the gradient the unsplit tied model would
  (`TiedWeights.reduce_grads`);
* the global gradient norm counts the weight once, on the stage that holds
  the canonical name (`TiedWeights.norm_excluded`);
* checkpoints and exports keep it once, under the canonical name, written by
  the stage of its first unit (the stage module's aliases and copies,
  `evtrain.checkpoint.state_tree.set_stage_aliases`); another stage restores
  its copy from that tensor and optimizer state, which equal its own.

Names inside one stage are made one `nn.Parameter` (`evtrain.stages.partition`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from evtrain.errors import SpecError, UsageError
from evtrain.stages.mesh import Place
from evtrain.stages.sharded import local_tensor

__all__ = ["TiedGroup", "TiedWeights", "resolve_ties"]


@dataclass(frozen=True)
class TiedGroup:
    """Names of one tied weight (canonical first) and the stages holding them."""

    names: tuple[str, ...]
    stages: tuple[int, ...] = ()
    """Sorted stages holding a name, when the partition is known."""
    owner: int = 0
    """The stage holding the canonical name (its first unit's, for a module the
    forward calls on several stages)."""
    unit: int = 0
    """The first unit holding the canonical name: its stage saves the weight."""


def resolve_ties(
    unit_params: Sequence[Sequence[tuple[str, nn.Parameter]]],
    explicit: Sequence[Sequence[str]],
    ranges: Sequence[Collection[int]] | None,
) -> list[TiedGroup]:
    """Tied groups from shared parameters and ``explicit`` name groups.

    ``unit_params`` lists each unit's parameters under their unsplit names
    (a shared parameter under each of its names); ``ranges[s]`` holds the units
    of stage s. Shared parameters form a
    group in parameter order; an explicit group naming one of them is merged
    into it, its first name canonical.
    """
    units_of: dict[str, list[int]] = {}
    param_of: dict[str, nn.Parameter] = {}
    by_id: dict[int, list[str]] = {}
    for unit, params in enumerate(unit_params):
        for name, param in params:
            held = units_of.setdefault(name, [])
            if unit not in held:
                held.append(unit)
            param_of[name] = param
            by_id.setdefault(id(param), [])
            if name not in by_id[id(param)]:
                by_id[id(param)].append(name)
    # A parameter under several names, or of a unit the forward calls several times
    # (one unit per call), whose calls may fall on several stages.
    groups: list[list[str]] = [
        names for names in by_id.values() if len(names) > 1 or len(units_of[names[0]]) > 1
    ]
    for names in explicit:
        for name in names:
            if name not in param_of:
                close = [n for n in param_of if n.endswith(name.rsplit(".", 1)[-1])][:4]
                raise SpecError(
                    "tied",
                    f"{name!r} is not a parameter of the model"
                    + (f" (parameters like it: {', '.join(close)})" if close else ""),
                )
        shapes = {tuple(param_of[n].shape) for n in names}
        if len(shapes) > 1:
            raise SpecError(
                "tied", f"{list(names)} have different shapes {sorted(shapes)}; they cannot be one"
            )
        merged = list(names)
        for group in [g for g in groups if set(g) & set(names)]:
            groups.remove(group)
            merged += [n for n in group if n not in merged]
        groups.append(merged)
    stage_of = {u: s for s, r in enumerate(ranges or ()) for u in r}
    result = []
    for names in groups:
        first = units_of[names[0]][0]
        if ranges is None:
            result.append(TiedGroup(tuple(names), unit=first))
            continue
        stages = {stage_of[u] for n in names for u in units_of[n]}
        result.append(TiedGroup(tuple(names), tuple(sorted(stages)), stage_of[first], first))
    return result


class TiedWeights:
    """One stage's side of every tied group that spans several stages.

    Construct it on every stage, in the same order (`dist.new_group` is
    collective over all ranks), after the stage module was built.
    """

    def __init__(
        self, groups: Sequence[TiedGroup], place: Place, module: nn.Module, backend: str
    ) -> None:
        present = dict(module.named_parameters(remove_duplicate=False))
        self._rank = place.rank
        self._stage = place.stage
        self._local: list[tuple[str, dist.ProcessGroup, int]] = []
        """(name of the parameter here, group of its stages in this replica, global rank
        of the owner)."""
        # One process group per set of ranks: a module's weights are many groups.
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in groups:
            if len(group.stages) < 2:
                continue
            # A group per pipeline (replica and tensor rank): each keeps its own
            # copies equal (tensor-parallel copies are split alike on every stage).
            for replica in range(place.replicas):
                for tp in range(place.tp_size):
                    ranks = tuple(place.rank_of(s, replica, tp) for s in group.stages)
                    if ranks not in made:
                        new = dist.new_group(ranks=list(ranks), backend=backend)
                        assert new is not None
                        made[ranks] = new
                pg = made[tuple(place.rank_of(s, replica) for s in group.stages)]
                if replica != place.replica or place.stage not in group.stages:
                    continue
                name = next(n for n in group.names if n in present)
                assert pg is not None
                self._local.append((name, pg, place.rank_of(group.owner)))
        self.rebind(module)

    def rebind(self, module: nn.Module) -> None:
        """Find the parameters in ``module`` again, after sharding replaced them: a
        sharded stage's replica r holds shard r of every copy (same shape, same
        split), so the copies' shards stay equal as the copies do."""
        present = dict(module.named_parameters(remove_duplicate=False))
        self._params = [present[name] for name, _pg, _owner in self._local]
        self.norm_excluded: set[int] = {
            id(p)
            for p, (_name, _pg, owner) in zip(self._params, self._local, strict=True)
            if owner != self._rank
        }
        """ids of local parameters whose norm another stage counts."""

    def __bool__(self) -> bool:
        return bool(self._local)

    def sync(self) -> None:
        """Give every copy the canonical holder's value (collective on each group); a
        copy split otherwise than the holder's (tensor parallelism) is a `UsageError`."""
        with torch.no_grad():
            for param, (name, pg, owner) in zip(self._params, self._local, strict=True):
                _check_split_alike(name, param, self._stage, pg)
                dist.broadcast(local_tensor(param.data), src=owner, group=pg)

    def reduce_grads(self) -> None:
        """Sum each tied weight's gradient over its stages (collective on each group)."""
        for param, (_name, pg, _owner) in zip(self._params, self._local, strict=True):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(local_tensor(param.grad), op=dist.ReduceOp.SUM, group=pg)


def _check_split_alike(
    name: str, param: torch.Tensor, stage: int, group: dist.ProcessGroup
) -> None:
    """Every copy of a tied weight split over the tensor ranks alike: the copies' slices
    are then the same elements, stepped alike."""
    split = str(param.placements) if isinstance(param, DTensor) else "whole"
    splits: list[tuple[int, str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(splits, (stage, name, split), group=group)
    if len({s[2] for s in splits if s is not None}) > 1:
        said = ", ".join(f"{n!r} on stage {st} {sp}" for st, n, sp in filter(None, splits))
        raise UsageError(
            f"a tied weight is split otherwise on each stage over the tensor ranks ({said}): "
            "give its modules styles that split it alike (an embedding_rowwise embedding "
            "with a colwise head)"
        )
