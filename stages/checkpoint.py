"""The stage side of checkpoints: save this stage's shard asynchronously, load any shards.

Saving (`ShardWriter`): at a step boundary the actor calls `ShardWriter.save`.
It captures the stage's state at that step and returns within milliseconds:
the small state (module buffers such as BatchNorm statistics, RNG states,
LR scheduler, optimizer hyperparameters, step, data position) is copied or
encoded to JSON right away; parameters and optimizer state, which only
``optimizer.step()`` changes, are copied into reused host staging buffers by
the writer thread while the next forward/backward runs, and a step pre-hook
on the optimizer holds the next ``step()`` until that copy is done (the
*fence*; on CUDA the device-to-host copies into pinned buffers are instead
queued on the current stream inside ``save``, which orders them before the
next step's kernels). The writer thread then saves the shard with
``torch.distributed.checkpoint`` (``no_dist=True``: no collective, each
stage saves on its own, so the stages' gloo/NCCL groups are never touched),
fsyncs it, hashes every file and writes the shard-complete record
``SHARD.json`` last (see `evtrain.checkpoints`). The actor learns of finished
writes by calling `ShardWriter.poll` at step boundaries (the bus publisher is
not thread-safe, so nothing is published from the writer thread) and
publishes ``done.to_event()``.

Keys are those of the unsplit model: model tensors keep their
`StageModule` state_dict names (``"3.weight"``); optimizer state is keyed by
parameter name (``"optim.3.weight.exp_avg"``); hyperparameters, the LR
scheduler, step, data position and the python/numpy RNG go to ``state.json``;
the torch RNG states are tensors (``"rng.torch"``, ``"rng.cuda"``).

Loading (`load_stage_shard`) reads, for each tensor this stage needs,
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
import queue
import random
import shutil
import threading
import time
import warnings
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

from evtrain.checkpoints import (
    MANIFEST_FILE,
    ON_STOP_REASON,
    SHARD_RECORD_FILE,
    STATE_FILE,
    CheckpointCorrupt,
    CheckpointError,
    ShardFile,
    ShardRecord,
    TensorInfo,
    committed_shard_record,
    format_checkpoint_path,
    fsync_dir,
    read_manifest,
    resolve_resume,
    sha256_file,
    stage_dir,
    verify_shard_files,
    write_shard_record,
)
from evtrain.events import CheckpointFailed, CheckpointNow, CheckpointShardSaved, Event

__all__ = [
    "ON_STOP_REASON",
    "CompletedShard",
    "RestrictedUnpickler",
    "ResumeState",
    "ShardWriter",
    "agree_on_resume",
    "is_on_stop_request",
    "load_stage_shard",
    "load_weights",
    "read_model_tensors",
]

log = structlog.get_logger("evtrain.stages.checkpoint")

# dcp.save(no_dist=True) always warns that it "assumes a single process"; that
# is exactly what a per-stage save is.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)


WRITE_DELAY_ENV = "EVTRAIN_CKPT_WRITE_DELAY_S"
"""Fault injection for tests: seconds the writer thread sleeps before writing."""

RECORD_DELAY_ENV = "EVTRAIN_CKPT_RECORD_DELAY_S"
"""Fault injection for tests: seconds between the data files and the shard record
(a kill then leaves a shard with data but no record: never committed)."""

_OPTIM_PREFIX = "optim."
_OPTIM_GROUPS_PREFIX = "optim_groups."
_SCHED_PREFIX = "sched."
_RNG_TORCH = "rng.torch"
_RNG_CUDA = "rng.cuda"
_TENSOR_TAG = "__tensor__"
_TUPLE_TAG = "__tuple__"
_ITEMS_TAG = "__items__"


def is_on_stop_request(cmd: CheckpointNow) -> bool:
    """Whether ``cmd`` arms a checkpoint for when the run stops instead of saving now.

    The checkpoint hook (``on_stop=True``) sends such a command once per run;
    the actor acknowledges it and calls `ShardWriter.arm_on_stop`.
    """
    return cmd.on_stop


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


def _capture_rng(device: torch.device, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    rng: dict[str, Any] = {}
    tensors[_RNG_TORCH] = torch.get_rng_state()
    rng["torch"] = {_TENSOR_TAG: _RNG_TORCH}
    if device.type == "cuda":
        tensors[_RNG_CUDA] = torch.cuda.get_rng_state(device)
        rng["cuda"] = {_TENSOR_TAG: _RNG_CUDA}
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


def _restore_rng(
    rng: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], device: torch.device
) -> None:
    if "torch" in rng:
        torch.set_rng_state(_decode_tree(rng["torch"], tensors))
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(_decode_tree(rng["cuda"], tensors), device)
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


# ------------------------------------------------------------------- the capture


def _param_names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}


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
    """Live tensors (by key) and the JSON state of this stage, without copying tensors."""
    tensors: dict[str, torch.Tensor] = {}
    model_sd = module.state_dict()
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
        names = _param_names(module)
        osd = optimizer.state_dict()
        # optimizer.state_dict() numbers parameters in param_groups order.
        index_to_name: dict[int, str] = {}
        groups = []
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
        for idx, pstate in osd["state"].items():
            fqn = index_to_name[int(idx)]
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


# --------------------------------------------------------------- restricted reads

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
        if getattr(metadata, "storage_meta", None) is None:
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


# ------------------------------------------------------------------------- saving


@dataclass
class CompletedShard:
    """A finished (or failed) shard write, reported by `ShardWriter.poll`."""

    checkpoint_id: str
    step: int
    stage: int
    path: str
    """The checkpoint directory (not the stage directory)."""
    bytes: int = 0
    duration_s: float = 0.0
    blocked_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the shard is durable."""
        return self.error is None

    def to_event(self) -> Event:
        """`CheckpointShardSaved`, or `CheckpointFailed` when the write failed."""
        if self.error is not None:
            return CheckpointFailed(
                checkpoint_id=self.checkpoint_id,
                step=self.step,
                stage=self.stage,
                error=self.error,
            )
        return CheckpointShardSaved(
            checkpoint_id=self.checkpoint_id,
            step=self.step,
            stage=self.stage,
            path=self.path,
            bytes=self.bytes,
            duration_s=self.duration_s,
            blocked_s=self.blocked_s,
        )


@dataclass
class _Job:
    checkpoint_id: str
    ckpt_dir: Path
    step: int
    reason: str
    tensors: dict[str, torch.Tensor]
    state_json: bytes
    model_keys: list[str]
    layers: list[int]
    created: float
    started: float
    blocked_s: float
    ready: Any = None  # a torch.cuda.Event when copies were queued on a stream
    deferred: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(staging buffer, live tensor) pairs the writer thread copies before writing."""
    copied: threading.Event = field(default_factory=threading.Event)
    fence_s: float = 0.0
    """Training time the optimizer-step fence waited for the deferred copies."""


@dataclass
class _Armed:
    checkpoint_id: str
    path: str
    reason: str


class ShardWriter:
    """Saves one stage's shards; one write in flight at a time, in a background thread.

    Args:
        stage: this stage's index.
        num_stages: stages of the run (recorded, checked at commit).
        device: the stage's device; on CUDA the staging buffers are pinned and
            the device-to-host copies are asynchronous on the current stream.
        asynchronous: False writes in the caller's thread from the live
            tensors (no staging copy); `save` then returns when the shard is
            durable. Used as the baseline in ``bench/checkpoint_stall.py``.
        thread_count: DCP writer threads (files per shard).
        write_delay_s: sleep before each write (fault injection for tests;
            default ``$EVTRAIN_CKPT_WRITE_DELAY_S``).
        record_delay_s: sleep after the data files, before ``SHARD.json``
            (fault injection; default ``$EVTRAIN_CKPT_RECORD_DELAY_S``).
        overlap_copy: on CPU, copy the parameters and optimizer state into the
            staging buffers in the writer thread, overlapped with the next
            forward/backward, instead of inside `save`. Only ``optimizer.step()``
            mutates those, so `save` installs a step pre-hook on the optimizer
            that waits for the copy (the *fence*; its wait counts as blocked
            time). Buffers (e.g. BatchNorm statistics, which forward updates),
            the RNG and the scheduler are always copied inside `save`. Call
            `fence` before any other in-place change of parameters.
    """

    def __init__(
        self,
        stage: int,
        num_stages: int,
        *,
        device: torch.device | str = "cpu",
        asynchronous: bool = True,
        thread_count: int = 1,
        write_delay_s: float | None = None,
        record_delay_s: float | None = None,
        overlap_copy: bool = True,
    ) -> None:
        self.stage = stage
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.asynchronous = asynchronous
        self.thread_count = thread_count
        if write_delay_s is None:
            write_delay_s = float(os.environ.get(WRITE_DELAY_ENV, "0") or 0)
        self.write_delay_s = write_delay_s
        if record_delay_s is None:
            record_delay_s = float(os.environ.get(RECORD_DELAY_ENV, "0") or 0)
        self.record_delay_s = record_delay_s
        self._staging: dict[str, torch.Tensor] = {}
        self._done: queue.SimpleQueue[CompletedShard] = queue.SimpleQueue()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._armed: _Armed | None = None
        self._thread: threading.Thread | None = None
        self.overlap_copy = overlap_copy
        self._copy_delay_s = 0.0
        self._copying: _Job | None = None
        self._fenced: dict[int, Any] = {}
        self.last_timings: dict[str, float] = {}
        """Breakdown of the last `save`'s blocking part: ``wait_s`` (a previous write
        in flight), ``capture_s`` (state dicts, JSON), ``copy_s`` (into staging)."""
        self._closed = False

    # -- the actor's API ------------------------------------------------------

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        checkpoint_id: str,
        step: int,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        data_position: int | None = None,
        reason: str = "",
        extra: Mapping[str, Any] | None = None,
    ) -> float:
        """Capture this stage's state now and write it to ``path/stage-{k}`` (in the background).

        Call at a step boundary (after the optimizer and scheduler steps).
        ``path`` may hold a ``{step}`` placeholder (``.../step-{step:08d}``),
        filled with ``step`` = optimizer steps completed (the next step to run);
        ``data_position`` is the global batch index the next step reads
        (default ``step``; ``DataStream.batch_index(step)`` with grad_accum).
        Returns the seconds spent here (capture, plus waiting for a previous
        write still in flight); the reported ``CompletedShard.blocked_s`` adds
        the wait at the next ``optimizer.step()`` fence (see ``overlap_copy``).
        Raises `CheckpointError` for a target that is already committed or
        unusable; write errors come later as a failed `CompletedShard` from
        `poll`.
        """
        if self._closed:
            raise CheckpointError("the shard writer is closed")
        t0 = time.perf_counter()
        created = time.time()
        ckpt_dir = format_checkpoint_path(path, step)
        if (ckpt_dir / MANIFEST_FILE).exists():
            raise CheckpointError(f"checkpoint {ckpt_dir} is already committed; not overwriting")
        # One write in flight: its staging buffers are reused by this capture.
        self._idle.wait()
        t_waited = time.perf_counter()
        layers = _layer_range(module)
        tensors, state, model_keys = _capture(
            stage=self.stage,
            module=module,
            optimizer=optimizer,
            scheduler=scheduler,
            step=step,
            data_position=step if data_position is None else data_position,
            device=self.device,
            extra=extra,
        )
        state["checkpoint_id"] = checkpoint_id
        state_json = json.dumps(state, allow_nan=True).encode()
        t_captured = time.perf_counter()
        ready = None
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self.asynchronous:
            defer: set[str] = set()
            if self.overlap_copy and optimizer is not None and self.device.type == "cpu":
                defer = {name for name, _ in module.named_parameters()}
                defer.update(k for k in tensors if k.startswith(_OPTIM_PREFIX))
            tensors, ready, deferred = self._stage(tensors, defer)
        self.last_timings = {
            "wait_s": t_waited - t0,
            "capture_s": t_captured - t_waited,
            "copy_s": time.perf_counter() - t_captured,
        }
        job = _Job(
            checkpoint_id=checkpoint_id,
            ckpt_dir=ckpt_dir,
            step=step,
            reason=reason,
            tensors=tensors,
            state_json=state_json,
            model_keys=model_keys,
            layers=layers,
            created=created,
            started=t0,
            blocked_s=0.0,
            ready=ready,
            deferred=deferred,
        )
        if not deferred:
            job.copied.set()
        elif optimizer is not None:
            self._copying = job
            self._install_fence(optimizer)
        if not self.asynchronous:
            self._write(job)
            job.blocked_s = time.perf_counter() - t0
            return job.blocked_s
        job.blocked_s = time.perf_counter() - t0
        self._idle.clear()
        self._ensure_thread()
        self._jobs.put(job)
        return job.blocked_s

    def prepare(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Allocate (and touch) the staging buffers ahead of the first `save`.

        Optional. Fresh host memory costs page faults on first write (about
        0.4 s for 300 MB here), which would otherwise land in the first
        checkpoint's blocked time. Call after the first optimizer step, when
        the optimizer state exists.
        """
        if not self.asynchronous:
            return
        tensors, _, _ = _capture(
            stage=self.stage,
            module=module,
            optimizer=optimizer,
            scheduler=None,
            step=0,
            data_position=0,
            device=self.device,
            extra=None,
        )
        for key, value in tensors.items():
            self._buffer(key, value).zero_()

    def poll(self) -> list[CompletedShard]:
        """Writes that finished since the last call (durable or failed); never blocks."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def busy(self) -> bool:
        """Whether a write is in flight."""
        return not self._idle.is_set()

    def wait(self, timeout: float | None = None) -> list[CompletedShard]:
        """Block until the write in flight (if any) finished; then `poll`.

        Call before publishing ``RunEnded`` so the last shards are reported.
        """
        self._idle.wait(timeout)
        return self.poll()

    def arm_on_stop(self, cmd: CheckpointNow) -> None:
        """Remember an on-stop request (see `is_on_stop_request`); `save_on_stop` uses it."""
        self._armed = _Armed(checkpoint_id=cmd.checkpoint_id, path=cmd.path, reason=cmd.reason)

    @property
    def armed(self) -> bool:
        """Whether a checkpoint is armed for the end of the run."""
        return self._armed is not None

    def save_on_stop(
        self,
        *,
        step: int,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        data_position: int | None = None,
    ) -> bool:
        """Save the armed on-stop checkpoint, if any; returns whether one was started.

        Call once when the run ends without failure (StopRun applied, SIGTERM,
        last step done), then `wait` and publish what it returns.
        """
        armed, self._armed = self._armed, None
        if armed is None:
            return False
        self.save(
            armed.path,
            checkpoint_id=armed.checkpoint_id,
            step=step,
            module=module,
            optimizer=optimizer,
            scheduler=scheduler,
            data_position=data_position,
            reason=armed.reason,
        )
        return True

    def close(self, timeout: float | None = None) -> None:
        """Finish the write in flight and stop the thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
        self.fence()
        for handle in self._fenced.values():
            handle.remove()
        self._fenced.clear()

    # -- internals ---------------------------------------------------------------

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._staging.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(
                like.shape,
                dtype=like.dtype,
                device="cpu",
                pin_memory=self.device.type == "cuda" and torch.cuda.is_available(),
            )
            self._staging[key] = buf
        return buf

    def _stage(
        self, tensors: Mapping[str, torch.Tensor], defer: set[str]
    ) -> tuple[dict[str, torch.Tensor], Any, list[tuple[torch.Tensor, torch.Tensor]]]:
        staged = {}
        deferred = []
        on_cuda = False
        for key, value in tensors.items():
            buf = self._buffer(key, value)
            if key in defer:
                deferred.append((buf, value))
            elif value.device.type == "cuda":
                # Queued on the current stream: the next step's kernels, on the
                # same stream, run only after these copies read the values.
                buf.copy_(value, non_blocking=True)
                on_cuda = True
            else:
                buf.copy_(value)
            staged[key] = buf
        for key in list(self._staging):
            if key not in tensors:
                del self._staging[key]
        ready = None
        if on_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        return staged, ready, deferred

    def _install_fence(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) not in self._fenced:
            self._fenced[id(optimizer)] = optimizer.register_step_pre_hook(lambda *_: self.fence())

    def fence(self) -> None:
        """Wait until the state captured by the last `save` is copied (see ``overlap_copy``).

        Runs automatically before ``optimizer.step()``; call it yourself before
        changing parameters or optimizer state in place any other way.
        """
        job = self._copying
        if job is None:
            return
        if not job.copied.is_set():
            t0 = time.perf_counter()
            job.copied.wait()
            job.fence_s += time.perf_counter() - t0
        self._copying = None

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"evtrain-ckpt-stage{self.stage}", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._write(job)
            finally:
                self._idle.set()

    def _write(self, job: _Job) -> None:
        spath = stage_dir(job.ckpt_dir, self.stage)
        try:
            try:
                if job.deferred and self._copy_delay_s > 0:
                    time.sleep(self._copy_delay_s)  # tests: make the fence observable
                for buf, live in job.deferred:
                    buf.copy_(live)
            finally:
                job.deferred = []
                job.copied.set()  # never leave the training thread waiting at the fence
            if job.ready is not None:
                job.ready.synchronize()  # the device-to-host copies have landed
            if self.write_delay_s > 0:
                time.sleep(self.write_delay_s)
            nbytes = self._write_files(job, spath)
        except Exception as exc:
            log.error("checkpoint shard write failed", path=str(spath), error=repr(exc))
            self._done.put(
                CompletedShard(
                    checkpoint_id=job.checkpoint_id,
                    step=job.step,
                    stage=self.stage,
                    path=str(job.ckpt_dir),
                    blocked_s=job.blocked_s + job.fence_s,
                    error=f"{type(exc).__name__}: {exc}",
                )
            )
            return
        duration = time.perf_counter() - job.started
        if not self.asynchronous:
            job.blocked_s = duration
        self._done.put(
            CompletedShard(
                checkpoint_id=job.checkpoint_id,
                step=job.step,
                stage=self.stage,
                path=str(job.ckpt_dir),
                bytes=nbytes,
                duration_s=duration,
                blocked_s=job.blocked_s + job.fence_s,
            )
        )
        log.info(
            "checkpoint shard saved",
            path=str(spath),
            step=job.step,
            bytes=nbytes,
            duration_s=round(duration, 3),
            blocked_s=round(job.blocked_s + job.fence_s, 4),
        )

    def _write_files(self, job: _Job, spath: Path) -> int:
        if (job.ckpt_dir / MANIFEST_FILE).exists():
            raise CheckpointError(f"checkpoint {job.ckpt_dir} is already committed")
        if spath.exists():
            # A leftover (crashed write, or another checkpoint id at this step):
            # never committed, so it is ours to replace.
            shutil.rmtree(spath)
        spath.mkdir(parents=True)
        writer = dcp.FileSystemWriter(spath, sync_files=True, thread_count=self.thread_count)
        dcp.save(job.tensors, storage_writer=writer, no_dist=True)
        state_path = spath / STATE_FILE
        with open(state_path, "wb") as f:
            f.write(job.state_json)
            f.flush()
            os.fsync(f.fileno())
        if self.record_delay_s > 0:
            time.sleep(self.record_delay_s)
        files = {}
        for child in sorted(spath.iterdir()):
            if child.is_file() and child.name != SHARD_RECORD_FILE:
                files[child.name] = ShardFile(size=child.stat().st_size, sha256=sha256_file(child))
        fsync_dir(spath)
        record = ShardRecord(
            checkpoint_id=job.checkpoint_id,
            step=job.step,
            stage=self.stage,
            num_stages=self.num_stages,
            layers=job.layers,
            reason=job.reason,
            created=job.created,
            bytes=sum(f.size for f in files.values()),
            duration_s=time.perf_counter() - job.started,
            # A synchronous save blocks training for its whole duration.
            blocked_s=(
                job.blocked_s + job.fence_s
                if self.asynchronous
                else time.perf_counter() - job.started
            ),
            files=files,
            tensors={
                k: TensorInfo(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))
                for k, t in job.tensors.items()
            },
            model_keys=job.model_keys,
        )
        write_shard_record(spath, record)
        fsync_dir(job.ckpt_dir)
        return record.bytes


def _layer_range(module: nn.Module) -> list[int]:
    layer_range = getattr(module, "layer_range", None)
    if isinstance(layer_range, range):
        return [layer_range.start, layer_range.stop]
    indices = sorted(
        int(k.split(".", 1)[0]) for k in module.state_dict() if k.split(".", 1)[0].isdigit()
    )
    if not indices:
        return [0, 0]
    return [indices[0], indices[-1] + 1]


# ------------------------------------------------------------------------- loading


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


def load_stage_shard(
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

    model_keys = list(module.state_dict())
    owner = {k: s for s in shards for k in s.record.model_keys}
    missing = [k for k in model_keys if k not in owner]
    if missing:
        raise CheckpointError(
            f"checkpoint {ckpt} has no tensor(s) {', '.join(missing[:5])} needed by stage {stage}"
        )
    first_layer_owner = owner[model_keys[0]] if model_keys else shards[0]
    same_stage = next((s for s in shards if s.stage == stage), None)
    # Scheduler, RNG and data position: from the same stage index when it exists.
    home = same_stage or first_layer_owner
    home_state = _read_state(home, verified, verify)

    wanted: dict[int, list[str]] = {s.stage: [] for s in shards}
    for key in model_keys:
        wanted[owner[key].stage].append(key)

    fqns = [name for name, _ in module.named_parameters(remove_duplicate=False)]
    optim_owner: dict[str, _Shard] = {}
    if optimizer is not None:
        for shard in shards:
            st = _read_state(shard, verified, verify)
            for fqn in st.get("optimizer", {}).get("state", {}):
                optim_owner.setdefault(fqn, shard)
            for group in st.get("optimizer", {}).get("param_groups", []):
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

    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for shard in shards:
        keys = list(dict.fromkeys(wanted[shard.stage]))
        tensors[str(shard.stage)] = _read_tensors(shard, keys, verified, verify)

    module.load_state_dict({k: tensors[str(owner[k].stage)][k] for k in model_keys}, strict=True)

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
                state[index] = _decode_tree(pstate, tensors[str(shard.stage)])
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
            module.load_state_dict({k: f.get_tensor(k) for k in keys}, strict=True)
        return
    ckpt = resolve_resume(p)
    module.load_state_dict(read_model_tensors(ckpt, keys), strict=True)


def agree_on_resume(
    resume: str | os.PathLike[str] | None, *, group: Any | None = None
) -> Path | None:
    """All ranks of ``group`` agree on one committed checkpoint to resume from.

    Rank 0 resolves ``resume`` (`evtrain.checkpoints.resolve_resume`: a run
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
