"""Where a process sits in the run: pipeline stage x data-parallel replica x tensor rank.

A run is P stages x D replicas x T tensor-parallel ranks on a
`torch.distributed.device_mesh.DeviceMesh` with dimensions ``("pp", "dp",
"tp")`` (``("pp", "dp")`` when T is 1). Global rank ``r`` is stage ``r //
(D T)``, replica ``r // T % D``, tensor rank ``r % T`` — the pipeline dimension
outermost and the tensor dimension innermost, as Megatron-LM and torchtitan
order them — so the T ranks of a replica's stage, which talk at every layer,
hold consecutive ranks (one machine's devices), the D replicas of a stage
come next and reduce their gradients inside a machine where they can, while
activations cross machines. Tensor rank t of a stage talks to tensor rank t
of its neighbours: each of the T pipelines of a replica carries its own
activations (`evtrain.stages.tensor_parallel`).

The groups one process uses:

* ``pipeline`` — its replica's P stages (of its tensor rank), for activations (the mesh's ``pp``
  group). ``pipeline_grads`` — the same ranks again, for gradients: a group of
  its own has its own connections, so a gradient never queues behind an
  activation.
* ``chunks`` — with V virtual stages (interleaved), one more (activation,
  gradient) pair of groups over the same ranks for each model chunk v >= 1 of
  a stage: what flows *into* chunk v travels on pair v (pair 0 is
  ``pipeline``, ``pipeline_grads``), so every group carries one chunk's
  messages in microbatch order — as NCCL, which ignores tags, needs.
* ``replicas`` — its stage's D replicas (of its tensor rank: the mesh's ``dp``
  group), over which DDP's reducer averages the gradients.
* ``tensor`` — its replica's stage's T ranks (the mesh's ``tp`` dimension), over
  which the plan shards the layers.
* ``control`` — every process, always gloo (the per-step control exchange,
  `evtrain.stages.control`).
* ``shapes`` — its replica's P stages again, always gloo, when the data's
  shapes may vary: the first stage tells the others each pass's shapes
  (`evtrain.stages.shapes`).
* ``checkpoint`` — the processes that each hold a part of its stage, always
  gloo: its D x T processes when the stages are sharded, else replica 0's T
  tensor ranks; the checkpoint writer's thread saves on it while training runs.

`dist.new_group` is collective over all ranks: every process creates every
group, in the same order, and keeps its own.

Across machines gloo binds the interface its host name resolves to, often a
loopback address other machines cannot reach; `pin_socket_interface` names
the interface of the route to the store's host (``MASTER_ADDR``) instead,
unless ``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME``) says otherwise.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from evtrain.schedule_names import Schedule
from evtrain.stages.schedules import chunk_place, model_chunk
from evtrain.stages.worker import rank_at, rank_coordinates

__all__ = ["ChunkRoutes", "Place", "StageGroups", "build_groups", "pin_socket_interface"]

SOCKET_INTERFACE_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def pin_socket_interface(routes: Path = Path("/proc/net/route")) -> str | None:
    """Set the socket interface of gloo and NCCL, where not set, to that of the route to
    ``MASTER_ADDR`` when it is another machine's (or this one's) network address; the
    interface, or None (a loopback or unknown store host, no such route: left alone)."""
    host = os.environ.get("MASTER_ADDR")
    if not host:
        return None
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if address.is_loopback:
        return None
    interface = route_interface(address, routes)
    if interface is not None:
        for name in SOCKET_INTERFACE_ENVS:
            os.environ.setdefault(name, interface)
    return interface


def route_interface(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, routes: Path
) -> str | None:
    """The interface of the most specific IPv4 route to ``address`` in ``routes`` (the
    kernel's table, ``/proc/net/route``: hex fields in host byte order)."""
    if not isinstance(address, ipaddress.IPv4Address):
        return None
    try:
        lines = routes.read_text().splitlines()[1:]
    except OSError:
        return None
    target = int.from_bytes(address.packed, "little")
    best: tuple[int, str] | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 8:
            continue
        try:
            destination, mask = int(fields[1], 16), int(fields[7], 16)
        except ValueError:
            continue
        prefix = mask.bit_count()
        if target & mask == destination & mask and (best is None or prefix > best[0]):
            best = (prefix, fields[0])
    return None if best is None else best[1]


@dataclass(frozen=True)
class Place:
    """One process's coordinates on the (pp, dp, tp) mesh."""

    stage: int
    replica: int
    num_stages: int
    replicas: int
    tp: int = 0
    """Its tensor-parallel rank within its replica's stage."""
    tp_size: int = 1

    @classmethod
    def of_rank(cls, rank: int, num_stages: int, replicas: int, tp_size: int = 1) -> Place:
        """The place of global rank ``rank`` (module docstring)."""
        stage, replica, tp = rank_coordinates(rank, replicas=replicas, tp_size=tp_size)
        return cls(stage, replica, num_stages, replicas, tp, tp_size)

    @property
    def rank(self) -> int:
        return self.rank_of(self.stage)

    @property
    def world_size(self) -> int:
        return self.num_stages * self.replicas * self.tp_size

    @property
    def ranks_per_stage(self) -> int:
        return self.replicas * self.tp_size

    def rank_of(self, stage: int, replica: int | None = None, tp: int | None = None) -> int:
        """Global rank of ``stage`` in ``replica`` at tensor rank ``tp`` (defaults: this
        process's)."""
        return rank_at(
            stage,
            self.replica if replica is None else replica,
            self.tp if tp is None else tp,
            replicas=self.replicas,
            tp_size=self.tp_size,
        )

    def stage_of(self, rank: int) -> int:
        """The stage of global rank ``rank``."""
        return rank // self.ranks_per_stage

    @property
    def prev(self) -> int | None:
        """Global rank of the previous stage of this replica (None on the first stage)."""
        return self.rank_of(self.stage - 1) if self.stage > 0 else None

    @property
    def next(self) -> int | None:
        """Global rank of the next stage of this replica (None on the last stage)."""
        return self.rank_of(self.stage + 1) if self.stage < self.num_stages - 1 else None


Peer = tuple[int, int]
"""(global rank, local chunk) of a neighbouring model chunk."""


@dataclass(frozen=True)
class ChunkRoutes:
    """Where each of a process's model chunks takes its input from and sends its output
    to: the neighbouring model chunks' `Peer`, None at the model's ends. A peer on
    this process's own rank is a hand-off in memory (zbv's turn on stage 0)."""

    rank: int
    first: tuple[bool, ...]
    """Per local chunk: it reads the model's inputs."""
    last: tuple[bool, ...]
    """Per local chunk: it computes the loss."""
    prev: tuple[Peer | None, ...]
    next: tuple[Peer | None, ...]

    @classmethod
    def of(cls, schedule: Schedule, place: Place, virtual_stages: int) -> ChunkRoutes:
        P, V = place.num_stages, virtual_stages
        ids = [model_chunk(schedule, place.stage, P, v) for v in range(V)]

        def peer(chunk: int) -> Peer | None:
            if not 0 <= chunk < P * V:
                return None
            stage, local = chunk_place(schedule, P, chunk)
            return place.rank_of(stage), local

        return cls(
            rank=place.rank,
            first=tuple(c == 0 for c in ids),
            last=tuple(c == P * V - 1 for c in ids),
            prev=tuple(peer(c - 1) for c in ids),
            next=tuple(peer(c + 1) for c in ids),
        )

    def local(self, peer: Peer | None) -> bool:
        """Whether ``peer`` is a chunk of this process (a hand-off in memory)."""
        return peer is not None and peer[0] == self.rank


@dataclass
class StageGroups:
    """The process groups of one process (see the module docstring); None with one process."""

    pipeline: dist.ProcessGroup | None
    pipeline_grads: dist.ProcessGroup | None
    replicas: dist.ProcessGroup | None
    control: dist.ProcessGroup | None
    chunks: list[tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]]
    """(activations, gradients) into each model chunk v, pair 0 included."""
    shapes: dist.ProcessGroup | None = None
    replica_mesh: DeviceMesh | None = None
    """The ``dp`` dimension of the mesh (the ``replicas`` group), which FSDP shards over."""
    tensor_mesh: DeviceMesh | None = None
    """The ``tp`` dimension of the mesh, which the tensor-parallel plan shards over."""
    checkpoint: dist.ProcessGroup | None = None
    """The processes that write one stage's shards together (sharded: the stage's D x T
    processes; else, T > 1: replica 0's T tensor ranks), always gloo, for the checkpoint
    writer's thread alone (`evtrain.checkpoint.writer.ShardWriter`)."""


def build_groups(
    place: Place,
    device: torch.device,
    backend: str,
    timeout: datetime.timedelta,
    virtual_stages: int = 1,
    varying_shapes: bool = False,
    sharded: bool = False,
) -> StageGroups:
    """Create the mesh and every group (collective: all processes call it, in step)."""
    if place.world_size == 1:
        return StageGroups(None, None, None, None, [(None, None)])
    P, D, T = place.num_stages, place.replicas, place.tp_size
    if T > 1:
        mesh = init_device_mesh(device.type, (P, D, T), mesh_dim_names=("pp", "dp", "tp"))
    else:
        mesh = init_device_mesh(device.type, (P, D), mesh_dim_names=("pp", "dp"))
    pipeline = mesh.get_group("pp") if P > 1 else None
    replicas = mesh.get_group("dp") if D > 1 else None
    lanes = [(r, t) for r in range(D) for t in range(T)]
    """The (replica, tensor rank) of each of the run's pipelines."""
    pipelines = [[place.rank_of(s, r, t) for s in range(P)] for r, t in lanes]
    pipeline_grads = None
    if place.num_stages > 1:
        pipeline_grads = _own_group(pipelines, place, backend, timeout)
    chunks: list[tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]] = [
        (pipeline, pipeline_grads)
    ]
    for _chunk in range(1, virtual_stages):
        pair: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None)
        for ranks in pipelines:
            act = dist.new_group(ranks, backend=backend, timeout=timeout)
            grad = dist.new_group(ranks, backend=backend, timeout=timeout)
            if place.rank in ranks:
                pair = (act, grad)
        chunks.append(pair)
    control = dist.new_group(backend="gloo", timeout=timeout)
    shapes = None
    if varying_shapes and place.num_stages > 1:
        shapes = _own_group(pipelines, place, "gloo", timeout)
    checkpoint = None
    if sharded and D > 1:
        stages = [[place.rank_of(s, r, t) for r in range(D) for t in range(T)] for s in range(P)]
        checkpoint = _own_group(stages, place, "gloo", timeout)
    elif T > 1:
        # Replica 0 writes a stage whose replicas are equal.
        writers = [[place.rank_of(s, 0, t) for t in range(T)] for s in range(P)]
        checkpoint = _own_group(writers, place, "gloo", timeout)
    return StageGroups(
        pipeline,
        pipeline_grads,
        replicas,
        control,
        chunks,
        shapes,
        replica_mesh=mesh["dp"] if D > 1 else None,
        checkpoint=checkpoint,
        tensor_mesh=mesh["tp"] if T > 1 else None,
    )


def _own_group(
    rank_sets: list[list[int]], place: Place, backend: str, timeout: datetime.timedelta
) -> dist.ProcessGroup | None:
    """A group over each of ``rank_sets``, in order (collective: every process creates
    every one); the one this process is in."""
    own = None
    for ranks in rank_sets:
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if place.rank in ranks:
            own = group
    return own
