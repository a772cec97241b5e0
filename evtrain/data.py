"""Deterministic data streams: which samples every step and microbatch reads.

Training data is two stacked tensors (inputs, targets) — what a pipeline
needs: stage 0 reads only inputs, the last stage only targets. Each stage
process computes the *same* sample indices on its own from
(seed, step), so no indices travel between stages, and the stream has no
state beyond the step number: resuming at step k replays exactly the batches
an uninterrupted run would have read from step k on.

Vocabulary (see also `evtrain.job.Job`):

* batch — ``batch_size`` samples; split into ``num_microbatches`` equal
  microbatches that flow through the pipeline.
* step — one optimizer step. With ``grad_accum = a`` step k consumes the
  global batches ``k*a .. k*a + a - 1`` (`DataStream.batch_index`).
* epoch — one pass over the shuffled training set; batch b belongs to epoch
  ``b // batches_per_epoch``. Each epoch has its own permutation from a
  `torch.Generator` seeded with ``derive_seed(seed, "data", epoch)``. A step
  may straddle an epoch boundary when ``a`` does not divide
  ``batches_per_epoch``; that is well defined because batches, not steps,
  are what belongs to an epoch.

Evaluation reads the eval set in order, every sample exactly once
(`eval_microbatches`).
"""

from __future__ import annotations

import hashlib
import math

import torch

__all__ = [
    "DataStream",
    "derive_seed",
    "eval_microbatches",
    "microbatches",
]


def derive_seed(seed: int, *keys: object) -> int:
    """A 63-bit seed derived from ``seed`` and ``keys``, stable across runs and machines.

    Used to give each layer (``derive_seed(seed, "layer", index)``) and each
    data epoch (``derive_seed(seed, "data", epoch)``) an independent random
    stream. Python's ``hash()`` is salted per process, so a real hash is used.
    """
    text = ":".join(str(part) for part in (seed, *keys))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class DataStream:
    """Sample indices for every (step, accumulation micro-step) of a training run.

    Stateless by step: ``indices(step, i)`` is a pure function of the
    constructor arguments, ``step`` and ``i``; the "data position" to save in
    a checkpoint is just the step number.

    Args:
        num_samples: size of the training set.
        batch_size: samples per batch (before microbatch splitting).
        seed: the job seed; epochs are shuffled with ``derive_seed(seed, "data", epoch)``.
        grad_accum: batches per optimizer step.
        drop_last: drop the incomplete batch at the end of each epoch (the
            default; a pipeline needs equal microbatches). With ``False`` the
            last batch of an epoch holds the remainder.
        shuffle: permute each epoch; ``False`` reads samples in order.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        seed: int,
        *,
        grad_accum: int = 1,
        drop_last: bool = True,
        shuffle: bool = True,
    ) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
        if drop_last and batch_size > num_samples:
            raise ValueError(
                f"batch_size {batch_size} is larger than the data set ({num_samples} samples)"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.grad_accum = grad_accum
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.batches_per_epoch = (
            num_samples // batch_size if drop_last else math.ceil(num_samples / batch_size)
        )
        # The permutation of the current and the previous epoch: each step asks
        # for its epoch's permutation, and recomputing randperm per step would
        # cost O(num_samples) every time.
        self._perms: dict[int, torch.Tensor] = {}

    def __repr__(self) -> str:
        return (
            f"DataStream(num_samples={self.num_samples}, batch_size={self.batch_size}, "
            f"seed={self.seed}, grad_accum={self.grad_accum}, drop_last={self.drop_last}, "
            f"shuffle={self.shuffle})"
        )

    def batch_index(self, step: int, accum_index: int = 0) -> int:
        """Global batch number read by accumulation micro-step ``accum_index`` of ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not 0 <= accum_index < self.grad_accum:
            raise ValueError(f"accum_index must be in 0..{self.grad_accum - 1}, got {accum_index}")
        return step * self.grad_accum + accum_index

    def epoch_of(self, step: int) -> int:
        """Epoch (from 0) of the first batch of ``step``."""
        return self.batch_index(step) // self.batches_per_epoch

    def steps_for_epochs(self, epochs: int) -> int:
        """Whole optimizer steps that fit in ``epochs`` passes (a partial last step is dropped)."""
        return epochs * self.batches_per_epoch // self.grad_accum

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order (int64 indices) in which ``epoch`` visits the samples."""
        perm = self._perms.get(epoch)
        if perm is None:
            if self.shuffle:
                gen = torch.Generator(device="cpu")
                gen.manual_seed(derive_seed(self.seed, "data", epoch))
                perm = torch.randperm(self.num_samples, generator=gen)
            else:
                perm = torch.arange(self.num_samples)
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    @classmethod
    def unbounded(cls, batch_size: int, seed: int, *, grad_accum: int = 1) -> DataStream:
        """The stream of an iterable data set: one endless epoch of batches in its own
        order; batches have numbers but no sample indices (`batch` raises)."""
        stream = cls(1, 1, seed, grad_accum=grad_accum, drop_last=False, shuffle=False)
        stream.batch_size = batch_size
        stream.batches_per_epoch = 1 << 62
        stream.indexed = False
        return stream

    indexed: bool = True
    """False for an iterable data set's stream (`unbounded`)."""

    def batch(self, batch_index: int) -> torch.Tensor:
        """Sample indices (int64, 1-D) of global batch ``batch_index``."""
        if not self.indexed:
            raise TypeError("an iterable data set's batches have no sample indices")
        if batch_index < 0:
            raise ValueError(f"batch_index must be >= 0, got {batch_index}")
        epoch, pos = divmod(batch_index, self.batches_per_epoch)
        start = pos * self.batch_size
        # A copy: callers may modify it, the cached permutation must stay intact.
        return self.permutation(epoch)[start : start + self.batch_size].clone()

    def indices(self, step: int, accum_index: int = 0) -> torch.Tensor:
        """Sample indices of ``step``'s batch number ``accum_index`` (0 without accumulation)."""
        return self.batch(self.batch_index(step, accum_index))


def microbatches(
    tensor: torch.Tensor, indices: torch.Tensor, num_microbatches: int
) -> list[torch.Tensor]:
    """Gather ``tensor[indices]`` and split it along dim 0 into equal microbatches.

    The pieces are contiguous (ready for point-to-point sends) and microbatch
    i holds the samples ``indices[i*mb:(i+1)*mb]``. Raises `ValueError` when
    ``len(indices)`` is not a multiple of ``num_microbatches``.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if len(indices) % num_microbatches:
        raise ValueError(
            f"a batch of {len(indices)} samples does not split into "
            f"{num_microbatches} equal microbatches"
        )
    batch = tensor.index_select(0, indices.to(device=tensor.device))
    # Splitting a contiguous tensor along dim 0 gives contiguous views.
    return list(batch.split(len(indices) // num_microbatches))


def eval_microbatches(
    num_samples: int, batch_size: int, num_microbatches: int
) -> list[list[range]]:
    """Plan one pass over an eval set: batches of microbatch sample ranges, in order.

    Every sample is read exactly once; nothing is dropped or padded. Each
    batch of ``batch_size`` samples is split into ``num_microbatches`` equal
    microbatches of ``mb = batch_size // num_microbatches`` samples. The
    remainder forms a last batch with ``ceil(r / mb)`` microbatches (so
    possibly fewer than ``num_microbatches``), of which only the very last
    may hold fewer than ``mb`` samples. A forward-only schedule handles any
    microbatch count; the executor knows each microbatch's batch dimension
    from this plan (its other dimensions are the data's: `evtrain.stages.shapes`).

    Slice a tensor with ``tensor[r.start:r.stop]``. Raises `ValueError` when
    ``batch_size`` is not a multiple of ``num_microbatches``.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if num_microbatches < 1 or batch_size < num_microbatches or batch_size % num_microbatches:
        raise ValueError(
            f"eval batch size {batch_size} does not split into "
            f"{num_microbatches} equal microbatches"
        )
    mb = batch_size // num_microbatches
    plan: list[list[range]] = []
    for start in range(0, num_samples, batch_size):
        stop = min(start + batch_size, num_samples)
        plan.append([range(s, min(s + mb, stop)) for s in range(start, stop, mb)])
    return plan
