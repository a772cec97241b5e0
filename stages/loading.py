"""How a stage reads the samples `evtrain.data` chose: from memory, or through a DataLoader.

Only the stages that consume data read it: the first stage the inputs, the
last stage the targets; the others never open the data set (they learn its
size only). Both readers give the same batches for the same indices:

* `MemoryReader` — the simple case: the data set stacked in memory
  (`evtrain.stages.job_data.TensorPair`), rows gathered by index.
* `LoaderReader` — a map-style data set read by a `torch.utils.data.DataLoader`
  (worker processes, a collate function, prefetching) whose batch sampler
  yields exactly `evtrain.data.DataStream`'s batches from a given batch on.
  The data position is therefore the step, as for the stacked case: a
  resumed or restarted run starts the sampler at the batch of its first
  step. Randomness inside ``dataset[i]`` (augmentation) is seeded per
  sample with ``derive_seed(seed, "sample", epoch, i)`` (torch, ``random``
  and numpy), in whichever worker reads it, so it differs per epoch, is the
  same across reruns and resumes, and does not depend on ``num_workers``.
  torchdata's ``StatefulDataLoader`` is not needed for this: it saves the
  iteration state of samplers and workers, which here is a pure function
  of the step.

Samples are ``(input, target)`` pairs, or dicts split by `Job.input_keys` and
`Job.target_keys`; the collate function (default: torch's
``default_collate``) stacks a batch of them.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    default_collate,
    get_worker_info,
)

from evtrain.data import DataStream, derive_seed
from evtrain.errors import SpecError
from evtrain.stages.pytree import map_tensors, take

if TYPE_CHECKING:
    from evtrain.stages.job_data import JobData

__all__ = [
    "LoaderReader",
    "MemoryReader",
    "Reader",
    "ReaderOptions",
    "StreamReader",
    "first_samples",
    "first_streamed",
    "make_reader",
    "split_sample",
]

log = structlog.get_logger()


def split_sample(
    value: Any, input_keys: str | Sequence[str] | None, target_keys: str | Sequence[str] | None
) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a (collated) sample: by keys for dicts, else a pair."""
    if input_keys is None:
        if isinstance(value, Mapping) or not isinstance(value, tuple | list) or len(value) != 2:
            raise SpecError(
                "train_data",
                "samples must be (input, target) pairs, or dicts with input_keys and "
                f"target_keys set; got {type(value).__name__}",
            )
        return value[0], value[1]
    assert target_keys is not None
    if not isinstance(value, Mapping):
        raise SpecError(
            "train_data", f"input_keys is set, so samples must be dicts; got {type(value).__name__}"
        )

    def pick(keys: str | Sequence[str]) -> Any:
        for key in (keys,) if isinstance(keys, str) else keys:
            if key not in value:
                raise SpecError(
                    "train_data",
                    f"the samples have no key {key!r}; they have {', '.join(map(str, value))}",
                )
        return value[keys] if isinstance(keys, str) else {k: value[k] for k in keys}

    return pick(input_keys), pick(target_keys)


def _worker_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The DataLoader options, with workers forked unless the job says otherwise.

    A stage process is started by spawn or forkserver, so that is also its
    DataLoader's default: each worker would be a fresh interpreter importing
    torch again (~250 MB each), and one that cannot unpickle a data set class
    defined in the spec file, which is not an importable module. A forked
    worker inherits both.
    """
    out = dict(options)
    if out.get("num_workers", 0) and "multiprocessing_context" not in out:
        import multiprocessing

        if "fork" in multiprocessing.get_all_start_methods():
            out["multiprocessing_context"] = "fork"
    return out


@dataclass(frozen=True)
class ReaderOptions:
    """What every reader of a stage shares.

    ``inputs``/``targets`` say which half of the samples it keeps (the first
    stage the inputs, the last the targets), moved to ``device``.
    ``replica`` of ``replicas`` (data parallelism) takes its contiguous share
    of every training batch: samples ``[r*B/D, (r+1)*B/D)`` of the batch's
    ``B``. The shares are a pure function of the batch, like the batch itself,
    so a resume at another D reads the same global batches. The rest is for
    the DataLoader readers: the job's ``seed``, its `Job.data_loader`
    options and its `Job.input_keys`/`Job.target_keys`.
    """

    inputs: bool
    targets: bool
    device: torch.device
    replica: int = 0
    replicas: int = 1
    seed: int = 0
    loader: Mapping[str, Any] = field(default_factory=dict)
    input_keys: str | Sequence[str] | None = None
    target_keys: str | Sequence[str] | None = None

    def split(self, sample: Any) -> tuple[Any, Any]:
        """``(inputs, targets)`` of a collated sample (`split_sample`)."""
        return split_sample(sample, self.input_keys, self.target_keys)


class Reader:
    """What one stage reads (`ReaderOptions`)."""

    def __init__(self, options: ReaderOptions) -> None:
        self.options = options
        self.inputs = options.inputs
        self.targets = options.targets
        self.device = options.device
        self.replica = options.replica
        self.replicas = options.replicas

    def _share(self, batch_size: int) -> slice:
        """The rows of a training batch of ``batch_size`` that this replica reads."""
        n = batch_size // self.replicas
        return slice(self.replica * n, (self.replica + 1) * n)

    def batch(self, batch_index: int) -> tuple[Any, Any]:
        """The training batch ``batch_index`` as (inputs, targets)."""
        raise NotImplementedError

    def rows(self, rows: range) -> tuple[Any, Any]:
        """Evaluation samples ``rows`` (read in order, each once) as (inputs, targets)."""
        raise NotImplementedError

    def _keep(self, inputs: Any, targets: Any) -> tuple[Any, Any]:
        def move(value: Any) -> Any:
            return map_tensors(lambda t: t.to(self.device, non_blocking=True), value)

        return (
            move(inputs) if self.inputs else None,
            move(targets) if self.targets else None,
        )


class MemoryReader(Reader):
    """Rows of stacked tensors (`evtrain.stages.job_data.TensorPair`)."""

    def __init__(
        self, pair: Any, options: ReaderOptions, *, stream: DataStream | None = None
    ) -> None:
        super().__init__(options)
        self.pair = pair
        self.stream = stream

    def batch(self, batch_index: int) -> tuple[Any, Any]:
        assert self.stream is not None
        indices = self.stream.batch(batch_index)
        indices = indices[self._share(len(indices))]
        cpu = torch.device("cpu")
        return self._keep(
            take(self.pair.inputs, indices, cpu) if self.inputs else None,
            take(self.pair.targets, indices, cpu) if self.targets else None,
        )

    def rows(self, rows: range) -> tuple[Any, Any]:
        def cut(value: Any) -> Any:
            return map_tensors(lambda t: t[rows.start : rows.stop], value)

        return self._keep(
            cut(self.pair.inputs) if self.inputs else None,
            cut(self.pair.targets) if self.targets else None,
        )


class _SeededSamples(Dataset[Any]):
    """``dataset[i]`` with every RNG seeded for (epoch, i); keys are ``(epoch, i)``."""

    def __init__(self, dataset: Any, seed: int, kind: str) -> None:
        self.dataset = dataset
        self.seed = seed
        self.kind = kind

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        seed = derive_seed(self.seed, self.kind, epoch, index)
        # Forked: with num_workers=0 this runs in the stage itself, whose own
        # streams (dropout) must not move.
        state = random.getstate()
        np_state = _numpy_state()
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                random.seed(seed)
                _numpy_seed(seed)
                return self.dataset[index]
        finally:
            random.setstate(state)
            _numpy_restore(np_state)

    def __len__(self) -> int:
        return len(self.dataset)


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random.get_state()


def _numpy_seed(seed: int) -> None:
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % (1 << 32))


def _numpy_restore(state: Any) -> None:
    if state is not None:
        import numpy

        numpy.random.set_state(state)


class _Batches(Sampler[list[tuple[int, int]]]):
    def __init__(self, batches: Iterator[list[tuple[int, int]]]) -> None:
        self._batches = batches

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        return self._batches


class LoaderReader(Reader):
    """A map-style data set read through a DataLoader (see the module docstring).

    Training batches are read in order from the first one asked for; asking
    for another than the next restarts the loader there (a rollback).
    """

    def __init__(
        self,
        dataset: Any,
        options: ReaderOptions,
        *,
        stream: DataStream | None = None,
        eval_plan: Sequence[Sequence[range]] = (),
    ) -> None:
        super().__init__(options)
        self.dataset = dataset
        self.loader_options = _worker_options(options.loader)
        self.stream = stream
        self.eval_plan = [r for batch in eval_plan for r in batch]
        self._train: Iterator[Any] | None = None
        self._next_batch = -1
        self._eval: Iterator[Any] | None = None
        self._next_rows = 0

    def _loader(self, kind: str, batches: Iterator[list[tuple[int, int]]]) -> Iterator[Any]:
        loader = DataLoader(
            _SeededSamples(self.dataset, self.options.seed, kind),
            batch_sampler=_Batches(batches),
            **self.loader_options,
        )
        return iter(loader)

    def _train_batches(self, first: int) -> Iterator[list[tuple[int, int]]]:
        assert self.stream is not None
        b = first
        while True:
            epoch = b // self.stream.batches_per_epoch
            indices = self.stream.batch(b)
            yield [(epoch, int(i)) for i in indices[self._share(len(indices))]]
            b += 1

    def batch(self, batch_index: int) -> tuple[Any, Any]:
        if self._train is None or batch_index != self._next_batch:
            self._train = self._loader("sample", self._train_batches(batch_index))
        self._next_batch = batch_index + 1
        return self._keep(*self.options.split(next(self._train)))

    def rows(self, rows: range) -> tuple[Any, Any]:
        if self._eval is None or rows == self.eval_plan[0]:  # a new pass
            self._eval = self._loader(
                "eval-sample", iter([[(0, i) for i in r] for r in self.eval_plan])
            )
            self._next_rows = 0
        want = self.eval_plan[self._next_rows]
        if want != rows:
            raise RuntimeError(f"evaluation rows {rows} read out of order (expected {want})")
        self._next_rows += 1
        return self._keep(*self.options.split(next(self._eval)))

    def close(self) -> None:
        """Stop the workers (they also stop with the process)."""
        self._train = self._eval = None


class _OwnRng:
    """Runs ``next()`` of an iterator under a random state of its own.

    Without workers an iterable data set's code runs in the stage itself: its
    draws must neither move the stage's streams (dropout) nor depend on them.
    """

    def __init__(self, iterator: Iterator[Any], seed: int) -> None:
        self._iterator = iterator
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self._state = torch.get_rng_state()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._state)
            try:
                return next(self._iterator)
            finally:
                self._state = torch.get_rng_state()


class _ReplicaShare(IterableDataset[Any]):
    """Replica ``replica`` of ``replicas``' share of an iterable data set's stream (in
    each DataLoader worker, of that worker's stream): its samples ``replica``,
    ``replica + replicas``, ...

    A data set with ``shard(index, count)`` is asked for it (it then reads
    only its share): ``index = worker + workers * replica`` of ``count =
    workers * replicas``, which are the same samples when ``shard`` returns
    samples ``index, index + count, ...`` of one stream, itself split over
    the workers. Any other is read whole and every other sample skipped.
    """

    def __init__(self, dataset: Any, replica: int, replicas: int) -> None:
        self.dataset = dataset
        self.replica = replica
        self.replicas = replicas

    def __iter__(self) -> Iterator[Any]:
        shard = getattr(self.dataset, "shard", None)
        if callable(shard):
            info = get_worker_info()
            workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
            return iter(shard(worker + workers * self.replica, workers * self.replicas))
        return itertools.islice(iter(self.dataset), self.replica, None, self.replicas)


class StreamReader(Reader):
    """An iterable data set read through a DataLoader, in its own order.

    Batch b is the b-th full batch of the stream; when the data set is
    exhausted the next pass starts. Every pass is seeded — the DataLoader's
    ``generator`` (which seeds each worker's torch, ``random`` and numpy)
    and, without workers, the random state the data set's code runs under —
    so both reading stages, and every rerun, see the same batches. The
    position in the stream is the step: a resumed run replays the stream
    from its start to its first batch (it reads those batches again, and
    logs it), since an iterable data set has no index to jump to. A data
    set that shards itself over workers (``torch.utils.data.get_worker_info``)
    yields the same order at a fixed ``num_workers``.

    With replicas each reads its share of the stream (`_ReplicaShare`), in
    batches of ``batch_size / D``: replica r's batch b holds the samples of
    the stream's batch b that are r modulo D, so the replicas' batches make
    up the one-replica batch exactly.
    """

    def __init__(self, dataset: Any, options: ReaderOptions, *, batch_size: int) -> None:
        super().__init__(options)
        self.dataset = (
            dataset
            if options.replicas == 1
            else _ReplicaShare(dataset, options.replica, options.replicas)
        )
        self.seed = options.seed
        self.batch_size = batch_size // options.replicas
        self.loader_options = _worker_options(options.loader)
        self._batches: Iterator[Any] | None = None
        self._next = -1

    def _stream(self) -> Iterator[Any]:
        for number in itertools.count():
            generator = torch.Generator().manual_seed(derive_seed(self.seed, "pass", number))
            loader = DataLoader(
                self.dataset,
                batch_size=self.batch_size,
                drop_last=True,
                generator=generator,
                **self.loader_options,
            )
            empty = True
            for batch in _OwnRng(iter(loader), derive_seed(self.seed, "pass-main", number)):
                empty = False
                yield batch
            if empty:
                raise SpecError(
                    "train_data",
                    f"the iterable data set yields less than {self.batch_size * self.replicas} "
                    "samples",
                )

    def batch(self, batch_index: int) -> tuple[Any, Any]:
        if self._batches is None or batch_index != self._next:
            self._batches = self._stream()
            if batch_index:
                log.info("replaying the data stream to the resume point", batches=batch_index)
            for _ in range(batch_index):
                next(self._batches)
        self._next = batch_index + 1
        return self._keep(*self.options.split(next(self._batches)))

    def rows(self, rows: range) -> tuple[Any, Any]:
        raise TypeError("an iterable data set is not evaluated")


def first_streamed(
    dataset: IterableDataset[Any],
    n: int,
    seed: int,
    collate_fn: Callable[[list[Any]], Any] | None,
    input_keys: str | Sequence[str] | None,
    target_keys: str | Sequence[str] | None,
) -> tuple[Any, Any]:
    """The first ``n`` samples of an iterable data set collated, as (inputs, targets).

    Read without workers, under a random state of their own (`_OwnRng`).
    """
    samples = list(itertools.islice(_OwnRng(iter(dataset), seed), n))
    return split_sample((collate_fn or default_collate)(samples), input_keys, target_keys)


def first_samples(
    dataset: Any,
    n: int,
    seed: int,
    collate_fn: Callable[[list[Any]], Any] | None,
    input_keys: str | Sequence[str] | None,
    target_keys: str | Sequence[str] | None,
) -> tuple[Any, Any]:
    """The first ``n`` samples collated, as (inputs, targets): shapes for the specs.

    Read seeded, like every other read, so the caller's random streams stay put.
    """
    collate = collate_fn or default_collate
    seeded = _SeededSamples(dataset, seed, "example")
    batch = [seeded[(0, i)] for i in range(min(n, len(dataset)))]
    return split_sample(collate(batch), input_keys, target_keys)


def make_reader(
    data: JobData,
    kind: str,
    first: bool,
    last: bool,
    device: torch.device,
    *,
    stream: DataStream | None = None,
    eval_plan: Sequence[Sequence[range]] = (),
    eval_set: str | None = None,
    replica: int = 0,
) -> Reader | None:
    """The reader of ``kind`` (``"train"`` or ``"eval"``) for a stage, None when it reads nothing.

    ``eval_set`` names the eval set (`evtrain.job.Job.eval_sets`; None: the only
    one). Only a first or last stage reads: the data set is not opened elsewhere.
    A training reader reads ``replica``'s share of every batch (`Reader`); an
    evaluation reader the batches of ``eval_plan`` (the replica's share of the set).
    """
    if not (first or last):
        return None
    job = data.job
    train = kind == "train"
    options = ReaderOptions(
        inputs=first,
        targets=last,
        device=device,
        replica=replica if train else 0,
        replicas=job.data_parallel if train else 1,
        seed=job.seed,
        loader=job.data_loader or {},
        input_keys=job.input_keys,
        target_keys=job.target_keys,
    )
    if job.data_loader is None:
        pair = data.train_tensors() if train else data.eval_tensors(eval_set)
        return MemoryReader(pair, options, stream=stream)
    dataset = data.train_dataset() if train else data.eval_dataset(eval_set)
    if isinstance(dataset, IterableDataset):
        return StreamReader(dataset, options, batch_size=job.batch_size)
    return LoaderReader(dataset, options, stream=stream, eval_plan=eval_plan)
