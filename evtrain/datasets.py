"""Ready-made map-style data sets for `Job.data_loader`.

`TokenFile` streams a nanoGPT-style token file (a flat array of token ids,
as ``numpy.ndarray.tofile`` writes it: ``train.bin``) of any size with a
bounded resident set per process; `write_tokens` writes one from an iterable
of token ids or chunks of them.

Why ``os.pread`` and not ``numpy.memmap`` (nanoGPT's way): every page of a
file mapping that a process touches is counted in its resident set
(``RssFile``) and stays there while the mapping lives, so a process that
maps the whole file and reads random windows from it grows towards the
file's size over an epoch — several GB for a real corpus, in every process
that reads (the first and last stages and each of their DataLoader
workers). nanoGPT recreates its memmap every batch to shed those pages. A
``pread`` instead copies just the window into a small private buffer that
is freed with the sample; the file's pages stay in the kernel's page cache,
shared by every process and not charged to any process's resident set (a
cgroup does count the page cache, but reclaims it before it runs out).
"""

from __future__ import annotations

import numbers
import operator
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["TokenFile", "token_dtype", "write_tokens"]

_TORCH_TO_NUMPY: dict[torch.dtype, type[np.integer[Any]]] = {
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.uint16: np.uint16,
    torch.int32: np.int32,
    torch.uint32: np.uint32,
    torch.int64: np.int64,
}


def token_dtype(dtype: Any) -> np.dtype[Any]:
    """The numpy dtype of a token file's ids: a numpy integer dtype (or its name) or a
    torch integer dtype; ``ValueError`` for anything else."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_TO_NUMPY:
            raise ValueError(f"token ids must have an integer dtype, got {dtype}")
        return np.dtype(_TORCH_TO_NUMPY[dtype])
    try:
        result = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"not a dtype: {dtype!r}") from exc
    if result.kind not in "iu":
        raise ValueError(f"token ids must have an integer dtype, got {result}")
    return result


class TokenFile:
    """Windows of a flat token file as ``{"input_ids", "labels"}`` samples (int64 tensors).

    Sample ``i`` is the window ``tokens[i * seq_len : (i + 1) * seq_len + 1]``
    split into ``input_ids = window[:-1]`` and ``labels = window[1:]`` (each
    ``(seq_len,)``): the windows tile the file, neighbours sharing one token,
    so an epoch (evtrain shuffles the sample order per epoch) predicts every
    token but the first exactly once. A sample depends on its index only —
    unlike nanoGPT's random offsets, which need no epochs but revisit some
    windows and skip others. Trailing tokens that fill no window are unused.

    Use it with ``Job(train_data=functools.partial(TokenFile, path, seq_len),
    data_loader={...}, input_keys="input_ids", target_keys="labels")``.

    The file is opened lazily, by the first read in each process, and read
    with ``os.pread`` (see the module docstring): a stage that only asks for
    ``len()`` never opens it, and each DataLoader worker opens its own
    descriptor (a forked worker does not reuse its parent's; a pickled data
    set carries none). ``len()`` comes from the file's size at construction.
    """

    def __init__(self, path: str | os.PathLike[str], seq_len: int, dtype: Any = np.uint16) -> None:
        self.path = Path(path)
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be an integer >= 1, got {seq_len!r}")
        self.seq_len = seq_len
        self.dtype = token_dtype(dtype)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise FileNotFoundError(f"no token file at {self.path}") from None
        itemsize = self.dtype.itemsize
        if size % itemsize:
            raise ValueError(
                f"{self.path}: {size} bytes is not a whole number of {self.dtype} tokens "
                f"({itemsize} bytes each); is the dtype right?"
            )
        self.num_tokens = size // itemsize
        """Token ids in the file."""
        if self.num_tokens < seq_len + 1:
            raise ValueError(
                f"{self.path}: {self.num_tokens} tokens, fewer than one window of "
                f"seq_len + 1 = {seq_len + 1}"
            )
        self._fd: int | None = None
        self._fd_pid = 0

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        i = operator.index(index)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {index} out of range for {n} samples")
        window = torch.from_numpy(self.read(i * self.seq_len, self.seq_len + 1))
        return {"input_ids": window[:-1], "labels": window[1:]}

    def read(self, start: int, count: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Tokens ``start .. start + count - 1`` as a fresh int64 array."""
        itemsize = self.dtype.itemsize
        want = count * itemsize
        fd = self._descriptor()
        offset = start * itemsize
        parts: list[bytes] = []
        got = 0
        # pread may return less than asked for (a signal); EOF returns b"".
        while got < want:
            chunk = os.pread(fd, want - got, offset + got)
            if not chunk:
                raise OSError(
                    f"{self.path}: ended at byte {offset + got}, expected {offset + want} "
                    "(was the file truncated while training?)"
                )
            parts.append(chunk)
            got += len(chunk)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        return np.frombuffer(data, dtype=self.dtype).astype(np.int64)

    def _descriptor(self) -> int:
        pid = os.getpid()
        if self._fd is None or self._fd_pid != pid:
            if self._fd is not None:
                # A forked worker's copy of its parent's descriptor: closing it
                # here leaves the parent's open.
                os.close(self._fd)
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            self._fd_pid = pid
        return self._fd

    def __getstate__(self) -> dict[str, Any]:
        # A descriptor number means nothing in another process (spawn or
        # forkserver workers): the receiver opens its own.
        state = dict(self.__dict__)
        state["_fd"] = None
        state["_fd_pid"] = 0
        return state

    def __del__(self, _getpid: Any = os.getpid, _close: Any = os.close) -> None:
        # ``os`` may already be torn down when this runs at interpreter exit.
        fd = getattr(self, "_fd", None)
        if fd is not None and getattr(self, "_fd_pid", 0) == _getpid():
            try:
                _close(fd)
            except OSError:
                pass

    def __repr__(self) -> str:
        return (
            f"TokenFile({str(self.path)!r}, seq_len={self.seq_len}, dtype={self.dtype}, "
            f"samples={len(self)})"
        )


def write_tokens(
    path: str | os.PathLike[str],
    tokens: Iterable[int] | Iterable[Any],
    dtype: Any = np.uint16,
) -> int:
    """Write token ids to ``path`` as a flat `TokenFile` of ``dtype``; return how many.

    ``tokens`` yields token ids, or 1-D chunks of them (lists, numpy arrays,
    CPU tensors), so a file larger than memory is written from a generator
    of chunks. Every id must fit ``dtype`` (``ValueError`` otherwise). The
    file is written under a temporary name and renamed when complete, so an
    interrupted write never leaves a short file at ``path``.
    """
    np_dtype = token_dtype(dtype)
    info = np.iinfo(np_dtype)
    target = Path(path)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    count = 0
    pending: list[int] = []

    def put(fh: Any, values: Any) -> None:
        nonlocal count
        array = np.asarray(values)
        if array.ndim != 1:
            raise ValueError(f"token chunks must be 1-D, got shape {array.shape}")
        if array.size == 0:
            return
        if array.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got {array.dtype}")
        low, high = int(array.min()), int(array.max())
        if low < info.min or high > info.max:
            raise ValueError(
                f"token id {low if low < info.min else high} does not fit {np_dtype} "
                f"({info.min}..{info.max})"
            )
        array.astype(np_dtype, copy=False).tofile(fh)
        count += array.size

    try:
        with partial.open("wb") as fh:
            for item in tokens:
                if isinstance(item, numbers.Integral):
                    pending.append(int(item))
                    if len(pending) >= 1 << 16:
                        put(fh, pending)
                        pending.clear()
                    continue
                if pending:
                    put(fh, pending)
                    pending.clear()
                put(fh, item.numpy() if isinstance(item, torch.Tensor) else item)
            if pending:
                put(fh, pending)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return count
