"""The boundary specs of every data shape a run meets, agreed once per distinct shape.

A receive is posted before its data exists, into buffers of a known spec
(`evtrain.stages.p2p`), so every stage must know each microbatch's boundary
specs when a pass begins. Stacked in-memory data has one shape per
microbatch size, agreed before training. Data read through a DataLoader may
take a new shape in any batch — a language model's batches padded to their
own longest sample — so there the pass begins with one small broadcast from
the stage that reads the inputs, over the replica's pipeline: an id per
microbatch, naming a shape in the table every stage keeps. Ids are numbered in order of first
sight, so an id past the end of the table tells every stage that a shape is
new; only then do the stages run a round of agreement (one forward on
zeros per stage and chunk, `evtrain.stages.p2p.exchange_shapes`), for all of
the pass's new shapes at once. A run therefore pays per pass one broadcast
of a few integers, and per distinct shape one agreement.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from evtrain.stages.p2p import posted
from evtrain.stages.pytree import BoundarySpec, TensorSpec, flatten

__all__ = ["Agree", "ChunkSpecs", "ShapeTable", "data_spec"]

ChunkSpecs = tuple[BoundarySpec, BoundarySpec | None]
"""A model chunk's (input, output) spec for one shape; the output is None on the
model's last chunk, which sends nothing."""

Agree = Callable[[Sequence[BoundarySpec] | None], list[list[ChunkSpecs]]]
"""Agree on new shapes (collective over the pipeline): given the model's input specs of
the new shapes on the stage that reads the inputs (None elsewhere), each chunk's specs
of each new shape, in order."""


def data_spec(inputs: Any) -> BoundarySpec:
    """The spec of a microbatch of inputs as read from the data."""
    tree, leaves = flatten(inputs, "train_data")
    return BoundarySpec(tree, tuple(TensorSpec(tuple(t.shape), t.dtype) for t in leaves))


def _key(spec: BoundarySpec) -> tuple[str, tuple[TensorSpec, ...]]:
    return json.dumps(spec.tree), spec.leaves


class ShapeTable:
    """One stage's boundary specs by shape id, and the ids of each pass's microbatches.

    ``first``: this stage reads the model's inputs (it numbers the shapes).
    ``group``/``src``: the replica's pipeline and the global rank in it of the
    stage that reads the inputs, for the per-pass broadcast; None when shapes cannot vary (stacked
    data) or the pipeline is one process, where nothing needs telling.
    """

    def __init__(
        self,
        agree: Agree,
        *,
        first: bool,
        varying: bool,
        group: dist.ProcessGroup | None,
        src: int,
    ) -> None:
        self._agree = agree
        self._first = first
        self._varying = varying
        self._group = group
        self._src = src
        self._chunks: list[list[ChunkSpecs]] = []
        self._ids: dict[tuple[str, tuple[TensorSpec, ...]], int] = {}
        self._by_size: dict[int, int] = {}
        self._told: tuple[dist.Work, torch.Tensor] | None = None

    def setup(self, sizes: Sequence[int], example: Any | None) -> None:
        """Agree before training on each microbatch size of the run, shaped like
        ``example`` (one sample of inputs, where they are read)."""
        specs = None
        if self._first:
            assert example is not None
            one = data_spec(example)
            specs = [
                BoundarySpec(
                    one.tree, tuple(TensorSpec((n, *s.shape[1:]), s.dtype) for s in one.leaves)
                )
                for n in sizes
            ]
        ids = self._add(specs)
        self._by_size = dict(zip(sizes, ids, strict=True))

    def _add(self, specs: Sequence[BoundarySpec] | None) -> list[int]:
        agreed = self._agree(specs)
        if not self._chunks:
            self._chunks = [[] for _ in agreed]
        start = len(self._chunks[0])
        for mine, new in zip(self._chunks, agreed, strict=True):
            mine.extend(new)
        count = len(self._chunks[0]) - start
        if specs is not None:
            for i, spec in enumerate(specs):
                self._ids.setdefault(_key(spec), start + i)
        return list(range(start, start + count))

    def pass_ids(self, sizes: Sequence[int], inputs: Sequence[Any] | None) -> list[int]:
        """The shape id of each of a pass's microbatches (collective over the pipeline
        when shapes vary): ``sizes`` are their sizes, ``inputs`` the microbatches
        themselves where they are read."""
        if not self._varying:
            return [self._by_size[n] for n in sizes]
        known = len(self._chunks[0])
        ids = torch.empty(len(sizes), dtype=torch.int64)
        new: list[BoundarySpec] = []
        if self._first:
            assert inputs is not None
            for m, microbatch in enumerate(inputs):
                spec = data_spec(microbatch)
                key = _key(spec)
                shape_id = self._ids.get(key)
                if shape_id is None:
                    shape_id = self._ids[key] = known + len(new)
                    new.append(spec)
                ids[m] = shape_id
        if self._group is not None and self._first:
            # Not waited on: the stage where every step begins goes on to its
            # first forward while the others take the ids (checked done next pass).
            if self._told is not None:
                self._told[0].wait()
            work = dist.broadcast(ids, src=self._src, group=self._group, async_op=True)
            self._told = (posted(work), ids)
        elif self._group is not None:
            dist.broadcast(ids, src=self._src, group=self._group)
        if int(ids.max()) >= known:
            self._add(new if self._first else None)
        return ids.tolist()

    @property
    def varying(self) -> bool:
        """Whether passes tell and agree their shapes (data read through a DataLoader)."""
        return self._varying

    def specs(self, chunk: int, shape_id: int) -> ChunkSpecs:
        return self._chunks[chunk][shape_id]

    def chunk_specs(self, chunk: int) -> Sequence[ChunkSpecs]:
        """Every agreed shape's specs of ``chunk``."""
        return self._chunks[chunk]
