"""Saving one stage's shard asynchronously (`ShardWriter`).

At a step boundary the actor calls `ShardWriter.save`.
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
``SHARD.json`` last (see `evtrain.checkpoint.storage`). The actor learns of finished
writes by calling `ShardWriter.poll` at step boundaries (the bus publisher is
not thread-safe, so nothing is published from the writer thread) and
publishes ``done.to_event()``.

Only tensors go to the DCP shard (keys: `evtrain.checkpoint.state_tree`);
every non-tensor value goes to ``state.json``, because DCP would pickle it.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from evtrain.checkpoint.state_tree import _OPTIM_PREFIX, _capture
from evtrain.checkpoint.storage import (
    MANIFEST_FILE,
    SHARD_RECORD_FILE,
    STATE_FILE,
    CheckpointError,
    ShardFile,
    ShardRecord,
    TensorInfo,
    format_checkpoint_path,
    fsync_dir,
    sha256_file,
    stage_dir,
    write_shard_record,
)
from evtrain.events import CheckpointFailed, CheckpointShardSaved, Event

__all__ = [
    "RECORD_DELAY_ENV",
    "WRITE_DELAY_ENV",
    "CompletedShard",
    "ShardWriter",
]

log = structlog.get_logger("evtrain.checkpoint.writer")


WRITE_DELAY_ENV = "EVTRAIN_CKPT_WRITE_DELAY_S"
"""Fault injection for tests: seconds the writer thread sleeps before writing."""

RECORD_DELAY_ENV = "EVTRAIN_CKPT_RECORD_DELAY_S"
"""Fault injection for tests: seconds between the data files and the shard record
(a kill then leaves a shard with data but no record: never committed)."""


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
    metric: float | None
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
    shards: dict[str, _Shards] = field(default_factory=dict)
    """Keys whose staged tensor is this process's shard of a sharded one."""
    copied: threading.Event = field(default_factory=threading.Event)
    fence_s: float = 0.0
    """Training time the optimizer-step fence waited for the deferred copies."""


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
        group: the processes that each hold a part of the stage (a sharded
            stage's replicas, `evtrain.job.Job.shard`; a replica's tensor ranks,
            `evtrain.job.Job.tensor_parallel`), a gloo group for the writes alone:
            each writes its own shards of every sharded tensor into the stage's
            directory (one DCP save over the group, from every member's writer
            thread, every member calling `save` at the same boundary) and group
            rank 0 everything else and the shard record, so no process gathers
            the stage.
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
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.stage = stage
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = group
        self._lead = group is None or dist.get_rank(group) == 0
        """This writer writes the record (and reports the shard)."""
        self._meshes: dict[DeviceMesh, DeviceMesh] = {}
        """What the staged shards are rewrapped on, by the mesh they live on."""
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
        metric: float | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> float:
        """Capture this stage's state now and write it to ``path/stage-{k}`` (in the background).

        Call at a step boundary (after the optimizer and scheduler steps).
        ``path`` may hold a ``{step}`` placeholder (``.../step-{step:08d}``),
        filled with ``step`` = optimizer steps completed (the next step to run);
        ``data_position`` is the global batch index the next step reads
        (default ``step``; ``DataStream.batch_index(step)`` with grad_accum);
        ``reason`` and ``metric`` (the evaluated value of a best checkpoint)
        go into the shard record.
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
        if not self._lead:
            # Replica 0 writes what is whole; the others their shards only.
            tensors = {k: v for k, v in tensors.items() if isinstance(v, DTensor)}
        shards = {k: _Shards.of(v) for k, v in tensors.items() if isinstance(v, DTensor)}
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
            # The local shards are staged; the writer thread rewraps them.
            tensors, ready, deferred = self._stage(_local(tensors), defer)
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
            metric=metric,
            tensors=tensors,
            state_json=state_json,
            model_keys=model_keys,
            layers=layers,
            created=created,
            started=t0,
            blocked_s=0.0,
            ready=ready,
            deferred=deferred,
            shards=shards,
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
        for key, value in _local(tensors).items():
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
            if not self._lead:
                return
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
        if not self._lead:
            return
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
        log.debug(
            "checkpoint shard saved",
            path=str(spath),
            step=job.step,
            bytes=nbytes,
            duration_s=round(duration, 3),
            blocked_s=round(job.blocked_s + job.fence_s, 4),
        )

    def _write_files(self, job: _Job, spath: Path) -> int:
        writer = dcp.FileSystemWriter(spath, sync_files=True, thread_count=self.thread_count)
        if self.group is None:
            self._prepare_dir(job, spath)
            dcp.save(job.tensors, storage_writer=writer, no_dist=True)
        else:
            self._prepare_dir_together(job, spath, self.group)
            if job.shards and self.asynchronous:
                job.tensors = {
                    k: v if k not in job.shards else job.shards[k].wrap(v, self._host_mesh)
                    for k, v in job.tensors.items()
                }
            dcp.save(job.tensors, storage_writer=writer, process_group=self.group)
            if not self._lead:
                return 0
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
            metric=job.metric,
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

    def _host_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """A mesh of host memory laid out as ``mesh`` (its ranks and dimension names):
        DCP reads the shards' offsets from it and communicates on ``group``."""
        host = self._meshes.get(mesh)
        if host is None:
            host = DeviceMesh(
                "cpu", mesh.mesh, mesh_dim_names=mesh.mesh_dim_names, _init_backend=False
            )
            self._meshes[mesh] = host
        return host

    def _prepare_dir_together(self, job: _Job, spath: Path, group: dist.ProcessGroup) -> None:
        """Group rank 0 empties and creates the stage directory; the broadcast
        that follows is the barrier no replica writes into it before, and carries
        rank 0's error, raised on every replica."""
        error = None
        if self._lead:
            try:
                self._prepare_dir(job, spath)
            except (CheckpointError, OSError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        said = [error]
        dist.broadcast_object_list(said, group=group, group_src=0)
        if said[0] is not None:
            raise CheckpointError(said[0])

    @staticmethod
    def _prepare_dir(job: _Job, spath: Path) -> None:
        if (job.ckpt_dir / MANIFEST_FILE).exists():
            raise CheckpointError(f"checkpoint {job.ckpt_dir} is already committed")
        if spath.exists():
            # A leftover (crashed write, or another checkpoint id at this step):
            # never committed, so it is ours to replace.
            shutil.rmtree(spath)
        spath.mkdir(parents=True)


@dataclass(frozen=True)
class _Shards:
    """How a sharded tensor is laid out over the processes of a stage."""

    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    mesh: DeviceMesh
    """The mesh the live tensor is sharded on."""

    @classmethod
    def of(cls, tensor: DTensor) -> _Shards:
        return cls(tensor.placements, tensor.shape, tensor.stride(), tensor.device_mesh)

    def wrap(self, local: torch.Tensor, host_mesh: Callable[[DeviceMesh], DeviceMesh]) -> DTensor:
        """``local``, this process's staged shard, as a part of the whole for DCP."""
        return DTensor.from_local(
            local,
            host_mesh(self.mesh),
            self.placements,
            shape=self.shape,
            stride=self.stride,
            run_check=False,
        )


def _local(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor, or its local shard when it is sharded."""
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in tensors.items()}


def _layer_range(module: nn.Module) -> list[int]:
    """``[start, stop]`` of the layers ``module`` holds; ``[start, stop, start, stop,
    ...]``, one pair per chunk, for a stage of several model chunks."""
    chunk_ranges = getattr(module, "chunk_ranges", None)
    if isinstance(chunk_ranges, list):
        return [bound for r in chunk_ranges for bound in (r.start, r.stop)]
    layer_range = getattr(module, "layer_range", None)
    if isinstance(layer_range, range):
        return [layer_range.start, layer_range.stop]
    indices = sorted(
        int(k.split(".", 1)[0]) for k in module.state_dict() if k.split(".", 1)[0].isdigit()
    )
    if not indices:
        return [0, 0]
    return [indices[0], indices[-1] + 1]
