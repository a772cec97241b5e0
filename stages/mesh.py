"""Where a process sits in the run: pipeline stage x data-parallel replica.

A run is P stages x D replicas on a 2-D `torch.distributed.device_mesh.DeviceMesh`
with dimensions ``("pp", "dp")``. Global rank ``r`` is stage ``r // D``,
replica ``r % D`` — the pipeline dimension outermost, as Megatron-LM and
torchtitan order it — so the D replicas of a stage hold consecutive ranks and,
with whole stages per node, reduce their gradients inside one machine while
activations cross machines.

The groups one process uses:

* ``pipeline`` — its replica's P stages, for activations (the mesh's ``pp``
  group). ``pipeline_grads`` — the same ranks again, for gradients: a group of
  its own has its own connections, so a gradient never queues behind an
  activation.
* ``chunks`` — with V virtual stages (interleaved), one more (activation,
  gradient) pair of groups over the same ranks for each model chunk v >= 1 of
  a stage: what flows *into* chunk v travels on pair v (pair 0 is
  ``pipeline``, ``pipeline_grads``), so every group carries one chunk's
  messages in microbatch order — as NCCL, which ignores tags, needs.
* ``replicas`` — its stage's D replicas (the mesh's ``dp`` group), over which
  DDP's reducer averages the gradients.
* ``control`` — every process, always gloo (the per-step control exchange,
  `evtrain.stages.control`).
* ``shapes`` — its replica's P stages again, always gloo, when the data's
  shapes may vary: the first stage tells the others each pass's shapes
  (`evtrain.stages.shapes`).
* ``checkpoint`` — its stage's D replicas, always gloo, when the stages are
  sharded: the checkpoint writer's thread saves on it while training runs.

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
    """One process's coordinates on the (pp, dp) mesh."""

    stage: int
    replica: int
    num_stages: int
    replicas: int

    @classmethod
    def of_rank(cls, rank: int, num_stages: int, replicas: int) -> Place:
        """The place of global rank ``rank`` (stage ``rank // D``, replica ``rank % D``)."""
        stage, replica = divmod(rank, replicas)
        return cls(stage, replica, num_stages, replicas)

    @property
    def rank(self) -> int:
        return self.rank_of(self.stage)

    @property
    def world_size(self) -> int:
        return self.num_stages * self.replicas

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        """Global rank of ``stage`` in ``replica`` (default: this process's replica)."""
        return stage * self.replicas + (self.replica if replica is None else replica)

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
    checkpoint: dist.ProcessGroup | None = None
    """Sharded: its stage's D replicas again, always gloo, for the checkpoint writer's
    thread alone (`evtrain.checkpoint.writer.ShardWriter`)."""


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
    mesh = init_device_mesh(
        device.type, (place.num_stages, place.replicas), mesh_dim_names=("pp", "dp")
    )
    pipeline = mesh.get_group("pp") if place.num_stages > 1 else None
    replicas = mesh.get_group("dp") if place.replicas > 1 else None
    pipelines = [
        [place.rank_of(s, r) for s in range(place.num_stages)] for r in range(place.replicas)
    ]
    stages = [[place.rank_of(s, r) for r in range(place.replicas)] for s in range(place.num_stages)]
    pipeline_grads = None
    if place.num_stages > 1:
        pipeline_grads = _own_group(pipelines, place, backend, timeout)
    chunks: list[tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]] = [
        (pipeline, pipeline_grads)
    ]
    for _chunk in range(1, virtual_stages):
        pair: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None)
        for replica in range(place.replicas):
            ranks = [place.rank_of(s, replica) for s in range(place.num_stages)]
            act = dist.new_group(ranks, backend=backend, timeout=timeout)
            grad = dist.new_group(ranks, backend=backend, timeout=timeout)
            if replica == place.replica:
                pair = (act, grad)
        chunks.append(pair)
    control = dist.new_group(backend="gloo", timeout=timeout)
    shapes = None
    if varying_shapes and place.num_stages > 1:
        shapes = _own_group(pipelines, place, "gloo", timeout)
    checkpoint = None
    if sharded and place.replicas > 1:
        checkpoint = _own_group(stages, place, "gloo", timeout)
    return StageGroups(
        pipeline,
        pipeline_grads,
        replicas,
        control,
        chunks,
        shapes,
        mesh["dp"] if place.replicas > 1 else None,
        checkpoint,
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
