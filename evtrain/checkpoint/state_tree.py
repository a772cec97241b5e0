"""State trees: a stage's state as tensors by key plus JSON, and the RNG states.

Keys are those of the unsplit model: model tensors keep their
`StageModule` state_dict names (``"3.weight"``); optimizer state is keyed by
parameter name (``"optim.3.weight.exp_avg"``); hyperparameters, the LR
scheduler, step, data position and the python/numpy RNG go to ``state.json``;
the torch RNG states are tensors (``"rng.torch"``, ``"rng.cuda"``). A tensor
inside a JSON tree is a ``{"__tensor__": KEY}`` reference; tuples, and dicts
whose keys are not plain strings, are tagged so that they decode to what was
encoded.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from evtrain.checkpoint.storage import CheckpointError

# dcp.save/dcp.load(no_dist=True) always warn that they "assume a single
# process"; that is exactly what a per-stage shard is. The writer and the
# loader, the two callers of DCP, both import this module.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)

_OPTIM_PREFIX = "optim."
_OPTIM_GROUPS_PREFIX = "optim_groups."
_SCHED_PREFIX = "sched."
_TENSOR_TAG = "__tensor__"
_TUPLE_TAG = "__tuple__"
_ITEMS_TAG = "__items__"


# ----------------------------------------------------------- non-tensor state trees


def _encode_tree(value: Any, where: str, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """JSON-ready form of a state value; tensors are moved to ``tensors`` under ``prefix``."""
    if isinstance(value, torch.Tensor):
        key = prefix + where
        tensors[key] = value
        return {_TENSOR_TAG: key}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {
            _TUPLE_TAG: [
                _encode_tree(v, f"{where}.{i}", tensors, prefix) for i, v in enumerate(value)
            ]
        }
    if isinstance(value, list):
        return [_encode_tree(v, f"{where}.{i}", tensors, prefix) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode_tree(v, f"{where}.{k}", tensors, prefix) for k, v in value.items()}
        return {
            _ITEMS_TAG: [
                [
                    _encode_tree(k, f"{where}.key{i}", tensors, prefix),
                    _encode_tree(v, f"{where}.{k}", tensors, prefix),
                ]
                for i, (k, v) in enumerate(value.items())
            ]
        }
    if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalar
        return value.item()
    raise CheckpointError(
        f"cannot checkpoint {where.lstrip('.')!r}: a {type(value).__name__} is not a tensor, "
        "number, string, list, tuple or dict"
    )


def _decode_tree(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode_tree(v, tensors) for v in value]
    if isinstance(value, dict):
        if _TENSOR_TAG in value:
            return tensors[value[_TENSOR_TAG]]
        if _TUPLE_TAG in value:
            return tuple(_decode_tree(v, tensors) for v in value[_TUPLE_TAG])
        if _ITEMS_TAG in value:
            return {
                _decode_tree(k, tensors): _decode_tree(v, tensors) for k, v in value[_ITEMS_TAG]
            }
        return {k: _decode_tree(v, tensors) for k, v in value.items()}
    return value


def _tensor_keys(value: Any) -> list[str]:
    """The tensor keys referenced by an encoded tree."""
    out: list[str] = []
    if isinstance(value, list):
        for v in value:
            out.extend(_tensor_keys(v))
    elif isinstance(value, dict):
        if _TENSOR_TAG in value:
            out.append(value[_TENSOR_TAG])
        else:
            for v in value.values():
                out.extend(_tensor_keys(v))
    return out


# ------------------------------------------------------------------- RNG states


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's torch (and ``device``'s CUDA), python and numpy RNG states as a
    tree of plain values and tensors (what `set_rng_state` restores)."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    version, state, gauss = random.getstate()
    rng["python"] = {"version": version, "state": list(state), "gauss": gauss}
    try:
        import numpy as np
    except ImportError:  # numpy is a dependency, but the RNG is optional state
        return rng
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    rng["numpy"] = {
        "name": name,
        "keys": [int(k) for k in keys],
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return rng


def set_rng_state(rng: Mapping[str, Any], device: torch.device) -> None:
    """Restore what `rng_state` captured (the CUDA state only on a CUDA ``device``)."""
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)
    if "python" in rng:
        py = rng["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    if "numpy" in rng:
        import numpy as np

        st = rng["numpy"]
        np.random.set_state(
            (
                st["name"],
                np.asarray(st["keys"], dtype=np.uint32),
                st["pos"],
                st["has_gauss"],
                st["cached_gaussian"],
            )
        )


def _capture_rng(device: torch.device, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    # Tensors under "rng.torch" / "rng.cuda".
    encoded: dict[str, Any] = _encode_tree(rng_state(device), "", tensors, "rng")
    return encoded


def _restore_rng(
    rng: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], device: torch.device
) -> None:
    set_rng_state(_decode_tree(rng, tensors), device)


# ------------------------------------------------------------------- tied weights

_TIED_ALIASES = "tied_aliases"
_TIED_COPIES = "tied_copies"


def set_stage_aliases(
    module: nn.Module, aliases: Mapping[str, str], copies: Collection[str] = ()
) -> None:
    """Record on a stage module which of its parameter names are aliases of a tied
    weight (alias -> canonical name) and which canonical names it holds as a copy
    that another stage saves: checkpoints store a tied weight once, under its
    canonical name."""
    vars(module)[_TIED_ALIASES] = dict(aliases)
    vars(module)[_TIED_COPIES] = frozenset(copies)


def stage_aliases(module: nn.Module) -> dict[str, str]:
    """A stage module's alias -> canonical names of tied weights (`set_stage_aliases`)."""
    return dict(vars(module).get(_TIED_ALIASES, {}))


def stage_copies(module: nn.Module) -> frozenset[str]:
    """Canonical names of tied weights that a stage module holds and another stage saves."""
    copies: frozenset[str] = vars(module).get(_TIED_COPIES, frozenset())
    return copies


# ------------------------------------------------------------------- the capture


def _param_names(module: nn.Module) -> dict[int, str]:
    """Checkpoint name of each parameter: a tied weight has its canonical name."""
    aliases = stage_aliases(module)
    return {
        id(p): aliases.get(name, name)
        for name, p in module.named_parameters(remove_duplicate=False)
    }


def _held_elsewhere(module: nn.Module) -> set[str]:
    """Canonical names of tied weights this stage holds only under an alias.

    Another stage saves their tensors and optimizer state, which equal ours.
    """
    local = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return {c for c in stage_aliases(module).values() if c not in local} | stage_copies(module)


def _capture(
    *,
    stage: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    step: int,
    data_position: int,
    device: torch.device,
    extra: Mapping[str, Any] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str]]:
    """Live tensors (by key) and the JSON state of this stage, without copying tensors
    (a sharded stage's are DTensors: each process holds its shards)."""
    tensors: dict[str, torch.Tensor] = {}
    copies = stage_copies(module)
    model_sd = {k: v for k, v in module.state_dict().items() if k not in copies}
    for key, value in model_sd.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"model state {key!r} is a {type(value).__name__}, not a tensor")
        if key.startswith((_OPTIM_PREFIX, _OPTIM_GROUPS_PREFIX, _SCHED_PREFIX, "rng.", "extra.")):
            raise CheckpointError(f"model state key {key!r} clashes with checkpoint prefixes")
        tensors[key] = value.detach()
    model_keys = list(model_sd)
    state: dict[str, Any] = {
        "format": "evtrain-stage-state",
        "version": 1,
        "stage": stage,
        "step": step,
        "data_position": data_position,
    }
    if optimizer is not None:
        # Not torch's get/set_optimizer_state_dict(flatten_optimizer_state_dict=True):
        # on an optimizer without state they run optimizer.step() to create some (a
        # checkpoint before the first step would change the live Adam state, and SGD
        # without momentum would step on every save), flattening rejects state values
        # other than tensors and numbers, and loading gives a parameter that has no
        # saved state an empty dict per state entry, which its next step cannot use.
        names = _param_names(module)
        osd = optimizer.state_dict()
        # optimizer.state_dict() numbers parameters in param_groups order.
        index_to_name: dict[int, str] = {}
        groups: list[dict[str, Any]] = []
        index = 0
        for group, packed in zip(optimizer.param_groups, osd["param_groups"], strict=True):
            fqns = []
            for p in group["params"]:
                name = names.get(id(p))
                if name is None:
                    raise CheckpointError(
                        "the optimizer holds a parameter that is not in the stage module"
                    )
                index_to_name[index] = name
                fqns.append(name)
                index += 1
            hyper = {k: v for k, v in packed.items() if k != "params"}
            groups.append(
                {
                    "params": fqns,
                    "hyper": _encode_tree(hyper, str(len(groups)), tensors, _OPTIM_GROUPS_PREFIX),
                }
            )
        per_param = {}
        elsewhere = _held_elsewhere(module)
        for idx, pstate in osd["state"].items():
            fqn = index_to_name[int(idx)]
            if fqn in elsewhere:
                continue
            per_param[fqn] = {
                k: _encode_tree(v, f"{fqn}.{k}", tensors, _OPTIM_PREFIX) for k, v in pstate.items()
            }
        for k in list(tensors):
            if k.startswith((_OPTIM_PREFIX, _OPTIM_GROUPS_PREFIX)):
                tensors[k] = tensors[k].detach()
        state["optimizer"] = {"param_groups": groups, "state": per_param}
    if scheduler is not None:
        state["scheduler"] = _encode_tree(scheduler.state_dict(), "", tensors, _SCHED_PREFIX)
    state["rng"] = _capture_rng(device, tensors)
    if extra:
        state["extra"] = _encode_tree(dict(extra), "extra", tensors, "extra.")
    return tensors, state, model_keys


def placed_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a checkpoint, placed as ``like`` is: its local shard for a
    sharded ``like`` (each replica cuts its own, without communication)."""
    if isinstance(like, DTensor) and not isinstance(value, DTensor):
        value = value.to(like.to_local().device)
        return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
    return value
