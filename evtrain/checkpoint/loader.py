"""Loading shards: any stage from a committed checkpoint taken at any number of stages.

`load_stage_shard` reads, for each tensor this stage needs,
whichever stage directory of the checkpoint holds it — so a checkpoint taken
with 4 stages loads into 2 or 3. It never unpickles arbitrary objects: DCP's
``.metadata`` *is* a pickle (torch 2.13 reads it with plain ``pickle.load``)
and DCP's non-tensor items are read with ``torch.load(weights_only=False)``,
so (1) no non-tensor value is ever stored in the DCP shard (they live in
JSON), (2) ``.metadata`` is read with `RestrictedUnpickler`, which allows only
DCP's metadata dataclasses, ``torch.Size``, dtypes, layouts and paths, and
(3) every file's size and sha256 are checked against ``SHARD.json`` before
DCP reads it, so a truncated or altered file is reported by name.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from evtrain.checkpoint.state_tree import (
    _decode_tree,
    _param_names,
    _restore_rng,
    _tensor_keys,
    placed_like,
    stage_aliases,
)
from evtrain.checkpoint.storage import (
    SHARD_RECORD_FILE,
    STATE_FILE,
    CheckpointCorrupt,
    CheckpointError,
    ShardRecord,
    committed_shard_record,
    read_manifest,
    resolve_resume,
    verify_shard_files,
)

__all__ = [
    "RestrictedUnpickler",
    "ResumeState",
    "SafeFileSystemReader",
    "agree_on_resume",
    "load_stage_shard",
    "load_weights",
    "read_model_tensors",
]

log = structlog.get_logger("evtrain.checkpoint.loader")


_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
}
_ALLOWED_GLOBALS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
_ALLOWED_GLOBALS[("torch", "Size")] = torch.Size
_ALLOWED_GLOBALS[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
_ALLOWED_GLOBALS[("collections", "OrderedDict")] = __import__("collections").OrderedDict
_ALLOWED_GLOBALS[("pathlib", "PosixPath")] = __import__("pathlib").PosixPath
_ALLOWED_GLOBALS[("pathlib", "WindowsPath")] = __import__("pathlib").PurePosixPath


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` files and nothing else.

    Only the globals DCP's metadata consists of may be loaded: its metadata
    dataclasses and enum, ``torch.Size``, ``torch`` dtypes, the layout
    reconstructor and paths. Anything else (``os.system``,
    ``builtins.eval``...) raises `pickle.UnpicklingError`.
    """

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"forbidden global {module}.{name} in checkpoint metadata")


class SafeFileSystemReader(FileSystemReader):
    """A DCP reader that unpickles metadata with `RestrictedUnpickler` and reads tensors only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = RestrictedUnpickler(f).load()
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{path} is missing from the checkpoint") from None
        except Exception as exc:
            raise CheckpointCorrupt(f"{path} cannot be read safely: {exc}") from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointCorrupt(f"{path} is not DCP metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        # BYTE_IO items are read with torch.load(weights_only=False) by DCP: refuse.
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointCorrupt(
                    f"{self.path}: non-tensor item {item.dest_index.fqn!r} is not allowed"
                )
        return super().read_data(plan, planner)


@dataclass
class ResumeState:
    """What a stage needs besides the restored objects to continue a run."""

    step: int
    """Optimizer steps completed: training continues with this step."""
    data_position: int
    """Global batch index of the next batch to read."""
    checkpoint_id: str
    path: Path
    saved_num_stages: int
    rng_restored_from: int | None
    """The saved stage whose RNG states were restored (None: not restored)."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Shard:
    stage: int
    path: Path
    record: ShardRecord
    state: dict[str, Any]


def _open_shards(ckpt_dir: Path) -> list[_Shard]:
    manifest = read_manifest(ckpt_dir)
    shards = []
    for entry in manifest.stages:
        spath, record = committed_shard_record(ckpt_dir, entry)
        if record.checkpoint_id != manifest.checkpoint_id or record.step != manifest.step:
            raise CheckpointCorrupt(
                f"{spath / SHARD_RECORD_FILE} does not belong to the manifest's checkpoint"
            )
        if record.stage != entry.stage:
            raise CheckpointCorrupt(f"{spath / SHARD_RECORD_FILE} names stage {record.stage}")
        shards.append(_Shard(stage=entry.stage, path=spath, record=record, state={}))
    return shards


def _read_state(shard: _Shard, verified: set[Path], verify: bool) -> dict[str, Any]:
    if not shard.state:
        _verify_once(shard, verified, verify)
        path = shard.path / STATE_FILE
        try:
            shard.state = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{path} is missing from the checkpoint") from None
        except ValueError as exc:
            raise CheckpointCorrupt(f"{path} is not valid JSON: {exc}") from None
    return shard.state


def _verify_once(shard: _Shard, verified: set[Path], verify: bool) -> None:
    if shard.path not in verified:
        verify_shard_files(shard.path, shard.record, hashes=verify)
        verified.add(shard.path)


def _read_tensors(
    shard: _Shard, keys: list[str], verified: set[Path], verify: bool
) -> dict[str, torch.Tensor]:
    if not keys:
        return {}
    _verify_once(shard, verified, verify)
    dest: dict[str, torch.Tensor] = {}
    for key in keys:
        info = shard.record.tensors.get(key)
        if info is None:
            raise CheckpointCorrupt(f"{shard.path}: tensor {key!r} is not in the shard record")
        dtype = getattr(torch, info.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointCorrupt(f"{shard.path}: unknown dtype {info.dtype!r} for {key!r}")
        dest[key] = torch.empty(info.shape, dtype=dtype)
    try:
        dcp.load(dest, storage_reader=SafeFileSystemReader(shard.path), no_dist=True)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointCorrupt(
            f"{shard.path} cannot be read: {type(exc).__name__}: {exc}"
        ) from exc
    return dest


def read_model_tensors(
    ckpt_dir: str | os.PathLike[str], keys: list[str] | None = None, *, verify: bool = True
) -> dict[str, torch.Tensor]:
    """Model tensors of a committed checkpoint (all, or ``keys``), on CPU, by unsplit name."""
    ckpt = Path(ckpt_dir)
    shards = _open_shards(ckpt)
    owner = {k: s for s in shards for k in s.record.model_keys}
    wanted = list(owner) if keys is None else keys
    missing = [k for k in wanted if k not in owner]
    if missing:
        raise CheckpointError(
            f"checkpoint {ckpt} has no model tensor(s) {', '.join(missing[:5])}"
            + (" ..." if len(missing) > 5 else "")
        )
    verified: set[Path] = set()
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        mine = [k for k in wanted if owner[k] is shard]
        out.update(_read_tensors(shard, mine, verified, verify))
    return {k: out[k] for k in wanted}


# Each branch is one kind of state a shard may hold, restored in its protocol's order.
def load_stage_shard(  # noqa: C901
    ckpt_dir: str | os.PathLike[str],
    stage: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    *,
    restore_rng: bool = True,
    verify: bool = True,
) -> ResumeState:
    """Restore one stage from a committed checkpoint taken at any number of stages.

    Loads ``module``'s tensors (by their unsplit names), the optimizer state
    of its parameters and the hyperparameters of their groups, the LR
    scheduler and (``restore_rng``) the torch/CUDA/python/numpy RNG states
    of saved stage ``stage`` (when the stage count changed and there is no
    such stage, the RNG of the shard that held this stage's first layer is
    used). Files are verified against their sha256 first (``verify``).
    Raises `NotCommitted`, `CheckpointCorrupt` (naming the file) or
    `CheckpointError`.
    """
    ckpt = Path(ckpt_dir)
    shards = _open_shards(ckpt)
    steps = {s.record.step for s in shards}
    if len(steps) != 1:
        raise CheckpointCorrupt(f"the shards of {ckpt} were saved at different steps")
    step = steps.pop()
    verified: set[Path] = set()
    device = next((p.device for p in module.parameters()), torch.device("cpu"))

    # A tied weight held here only under an alias loads from its canonical name.
    sources = {k: k for k in module.state_dict()}
    local = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    for alias, canonical in stage_aliases(module).items():
        if canonical not in local:
            sources[alias] = canonical
    model_keys = list(dict.fromkeys(sources.values()))
    owner = {k: s for s in shards for k in s.record.model_keys}
    missing = [k for k in model_keys if k not in owner]
    if missing:
        raise CheckpointError(
            f"checkpoint {ckpt} has no tensor(s) {', '.join(missing[:5])} needed by stage {stage}"
        )
    # The shard of this stage's first unit: a key only one shard holds (a root
    # buffer kept on every stage is in all of them).
    holders: dict[str, int] = {}
    for shard in shards:
        for key in shard.record.model_keys:
            holders[key] = holders.get(key, 0) + 1
    own = [k for k in model_keys if holders.get(k) == 1]
    first_layer_owner = (
        owner[own[0]] if own else (owner[model_keys[0]] if model_keys else shards[0])
    )
    same_stage = next((s for s in shards if s.stage == stage), None)
    # Scheduler, RNG and data position: from the same stage index when it exists.
    home = same_stage or first_layer_owner
    home_state = _read_state(home, verified, verify)

    wanted: dict[int, list[str]] = {s.stage: [] for s in shards}
    for key in model_keys:
        wanted[owner[key].stage].append(key)

    fqns = list(dict.fromkeys(_param_names(module).values()))
    optim_owner: dict[str, _Shard] = {}
    if optimizer is not None:
        # The shard that saved a parameter's state; one that only lists it in a group
        # (a tied weight another stage saves), for a parameter without state.
        states = [_read_state(shard, verified, verify).get("optimizer", {}) for shard in shards]
        for shard, st in zip(shards, states, strict=True):
            for fqn in st.get("state", {}):
                optim_owner.setdefault(fqn, shard)
        for shard, st in zip(shards, states, strict=True):
            for group in st.get("param_groups", []):
                for fqn in group["params"]:
                    optim_owner.setdefault(fqn, shard)
        missing = [f for f in fqns if f not in optim_owner]
        if missing:
            raise CheckpointError(
                f"checkpoint {ckpt} has no optimizer state for {', '.join(missing[:5])}"
            )
        for fqn in fqns:
            shard = optim_owner[fqn]
            pstate = shard.state.get("optimizer", {}).get("state", {}).get(fqn, {})
            wanted[shard.stage].extend(_tensor_keys(pstate))
        for shard in {id(s): s for s in optim_owner.values()}.values():
            for group in shard.state["optimizer"]["param_groups"]:
                wanted[shard.stage].extend(_tensor_keys(group["hyper"]))
    if scheduler is not None and "scheduler" in home_state:
        wanted[home.stage].extend(_tensor_keys(home_state["scheduler"]))
    rng = home_state.get("rng", {}) if restore_rng else {}
    wanted[home.stage].extend(_tensor_keys(rng))
    wanted[home.stage].extend(_tensor_keys(home_state.get("extra", {})))

    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for shard in shards:
        keys = list(dict.fromkeys(wanted[shard.stage]))
        tensors[str(shard.stage)] = _read_tensors(shard, keys, verified, verify)

    _load_module(module, {k: tensors[str(owner[src].stage)][src] for k, src in sources.items()})

    if optimizer is not None:
        _load_optimizer(optimizer, module, optim_owner, tensors)
    if scheduler is not None:
        if "scheduler" not in home_state:
            raise CheckpointError(f"checkpoint {ckpt} holds no LR scheduler state")
        scheduler.load_state_dict(_decode_tree(home_state["scheduler"], tensors[str(home.stage)]))
    rng_from = None
    if restore_rng and rng:
        _restore_rng(rng, tensors[str(home.stage)], device)
        rng_from = home.stage
        if same_stage is None:
            log.warning(
                "stage count changed: RNG restored from another stage's shard",
                stage=stage,
                from_stage=home.stage,
            )
    extra = _decode_tree(home_state.get("extra", {}), tensors[str(home.stage)])
    log.info("checkpoint loaded", path=str(ckpt), stage=stage, step=step)
    return ResumeState(
        step=step,
        data_position=int(home_state.get("data_position", step)),
        checkpoint_id=shards[0].record.checkpoint_id,
        path=ckpt,
        saved_num_stages=len(shards),
        rng_restored_from=rng_from,
        extra=extra if isinstance(extra, dict) else {},
    )


def _load_optimizer(
    optimizer: torch.optim.Optimizer,
    module: nn.Module,
    optim_owner: Mapping[str, _Shard],
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
) -> None:
    names = _param_names(module)
    state: dict[int, Any] = {}
    groups = []
    index = 0
    for group in optimizer.param_groups:
        ids = []
        hyper: dict[str, Any] | None = None
        source: tuple[int, int] | None = None
        source_raw: Any = None
        for p in group["params"]:
            fqn = names[id(p)]
            shard = optim_owner[fqn]
            saved = shard.state["optimizer"]
            where = next(
                (gi for gi, g in enumerate(saved["param_groups"]) if fqn in g["params"]), None
            )
            if where is None:
                raise CheckpointError(f"parameter {fqn!r} is in no saved optimizer group")
            raw = saved["param_groups"][where]["hyper"]
            if hyper is None:
                hyper = _decode_tree(raw, tensors[str(shard.stage)])
                source, source_raw = (shard.stage, where), raw
            elif (shard.stage, where) != source and raw != source_raw and not _tensor_keys(raw):
                raise CheckpointError(
                    f"parameter {fqn!r} had other optimizer hyperparameters than the rest of "
                    "its group; the optimizer's parameter groups changed"
                )
            pstate = saved["state"].get(fqn)
            if pstate is not None:
                decoded = _decode_tree(pstate, tensors[str(shard.stage)])
                state[index] = {
                    k: placed_like(v, p)
                    if isinstance(v, torch.Tensor) and v.shape == p.shape
                    else v
                    for k, v in decoded.items()
                }
            ids.append(index)
            index += 1
        groups.append({**(hyper or {}), "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def load_weights(path: str | os.PathLike[str], module: nn.Module) -> None:
    """Load model weights only (``--load-weights``): a committed checkpoint or a safetensors file.

    ``module`` is a stage module (or the full model); only its keys are read.
    Training then starts at step 0 with a fresh optimizer.
    """
    p = Path(path).expanduser()
    keys = list(module.state_dict())
    if p.is_file() and p.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(p), framework="pt") as f:
            available = set(f.keys())
            missing = [k for k in keys if k not in available]
            if missing:
                raise CheckpointError(f"{p} has no tensor(s) {', '.join(missing[:5])}")
            _load_module(module, {k: f.get_tensor(k) for k in keys})
        return
    ckpt = resolve_resume(p)
    _load_module(module, read_model_tensors(ckpt, keys))


def _load_module(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """``module.load_state_dict(state, strict=True)``, each whole tensor placed as the
    module holds it (its shard, for a sharded stage)."""
    live = module.state_dict()
    placed = {k: placed_like(v, live[k]) if k in live else v for k, v in state.items()}
    module.load_state_dict(placed, strict=True)


def agree_on_resume(
    resume: str | os.PathLike[str] | None, *, group: Any | None = None
) -> Path | None:
    """All ranks of ``group`` agree on one committed checkpoint to resume from.

    Rank 0 resolves ``resume`` (`evtrain.checkpoint.storage.resolve_resume`: a run
    directory means its latest committed checkpoint) and broadcasts the
    result, so stages never load different checkpoints even if a commit lands
    while they start. Every rank raises the same `CheckpointError` when rank 0
    cannot resolve it. ``resume=None`` returns None without communicating.
    Collective: every rank must call it.
    """
    import torch.distributed as dist

    if resume is None:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return resolve_resume(resume)
    payload = b""
    if dist.get_rank(group) == 0:
        try:
            payload = b"ok:" + os.fsencode(resolve_resume(resume))
        except CheckpointError as exc:
            payload = b"error:" + str(exc).encode()
    backend_device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    size = torch.tensor([len(payload)], dtype=torch.int64, device=backend_device)
    dist.broadcast(size, src=0, group=group)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=backend_device)
    if payload:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, src=0, group=group)
    text = bytes(buf.cpu().tolist())
    if text.startswith(b"error:"):
        raise CheckpointError(text[len(b"error:") :].decode())
    return Path(os.fsdecode(text[len(b"ok:") :]))
