"""A job's data, materialised where a stage needs it: stacked tensors, data sets, sizes,
the batch order and the first batch.

`evtrain.job.Job` describes the data (sources, keys, batch size); `JobData`
loads it, once per job and process (`job_data`), and only in the processes
that read it: the launcher never opens the training set, a middle stage
learns only its size.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils.data import IterableDataset

from evtrain.data import DataStream
from evtrain.errors import SpecError
from evtrain.job import Job
from evtrain.stages.loading import first_samples, first_streamed
from evtrain.stages.pytree import map_tensors

__all__ = ["JobData", "TensorPair", "job_data"]


class TensorPair(NamedTuple):
    """A data set as stacked inputs and targets: tensors, or pytrees of tensors
    (dicts by key, with `evtrain.job.Job.input_keys`), every leaf with the same first dimension."""

    inputs: Any
    targets: Any

    @property
    def num_samples(self) -> int:
        """Number of samples."""
        return int(_leaves(self.inputs)[0].shape[0])


def _leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _leaves(v)]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _leaves(v)]
    return []


def _select(field: str, columns: Mapping[str, torch.Tensor], keys: str | Sequence[str]) -> Any:
    """``columns[keys]`` for one key, ``{k: columns[k]}`` for a tuple of keys."""
    for key in (keys,) if isinstance(keys, str) else keys:
        if key not in columns:
            raise SpecError(
                field, f"the samples have no key {key!r}; they have {', '.join(sorted(columns))}"
            )
    if isinstance(keys, str):
        return columns[keys]
    return {k: columns[k] for k in keys}


def _stack(field: str, items: list[Any], what: str) -> torch.Tensor:
    try:
        return torch.stack([torch.as_tensor(x) for x in items])
    except Exception as exc:
        raise SpecError(
            field, f"stacking {what} failed (equal shapes needed): {type(exc).__name__}: {exc}"
        ) from exc


def _to_tensor_pair(
    field: str,
    value: Any,
    input_keys: str | Sequence[str] | None,
    target_keys: str | Sequence[str] | None,
) -> TensorPair:
    """Normalize a data source into stacked ``(inputs, targets)``."""
    if callable(value) and not isinstance(value, tuple | list):
        try:
            value = value()
        except Exception as exc:
            raise SpecError(field, f"loading the data failed: {type(exc).__name__}: {exc}") from exc
    if input_keys is not None:
        assert target_keys is not None  # validate() requires both
        keys = [*((input_keys,) if isinstance(input_keys, str) else input_keys)]
        keys += [k for k in ((target_keys,) if isinstance(target_keys, str) else target_keys)]
        if isinstance(value, Mapping):
            columns = {k: v for k, v in value.items() if k in keys}
            bad = [k for k, v in columns.items() if not isinstance(v, torch.Tensor)]
            if bad:
                raise SpecError(field, f"key {bad[0]!r} is not a tensor of stacked samples")
        elif hasattr(value, "__len__") and hasattr(value, "__getitem__"):
            n = len(value)
            if n == 0:
                raise SpecError(field, "the data set is empty")
            samples = [value[i] for i in range(n)]
            if not all(isinstance(x, Mapping) for x in samples):
                raise SpecError(
                    field, "input_keys is set, so every sample must be a dict of tensors"
                )
            columns = {
                k: _stack(field, [x[k] for x in samples], f"key {k!r}")
                for k in keys
                if all(k in x for x in samples)
            }
        else:
            raise SpecError(
                field,
                "with input_keys, expected a dict of stacked tensors, a map-style data set of "
                f"dicts, or a callable returning one; got {type(value).__name__}",
            )
        inputs = _select(field, columns, input_keys)
        targets = _select(field, columns, target_keys)
    elif isinstance(value, Mapping):
        raise SpecError(
            field,
            "the samples are dicts: set input_keys and target_keys to say which keys feed the "
            f"model and which the loss (keys: {', '.join(map(str, value))})",
        )
    elif (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(isinstance(t, torch.Tensor) for t in value)
    ):
        inputs, targets = value
    elif isinstance(getattr(value, "tensors", None), tuple) and len(value.tensors) == 2:
        # torch.utils.data.TensorDataset: already stacked.
        inputs, targets = value.tensors
    elif hasattr(value, "__len__") and hasattr(value, "__getitem__"):
        n = len(value)
        if n == 0:
            raise SpecError(field, "the data set is empty")
        pairs = [value[i] for i in range(n)]
        if isinstance(pairs[0], Mapping):
            raise SpecError(
                field,
                "the samples are dicts: set input_keys and target_keys to say which keys feed "
                f"the model and which the loss (keys: {', '.join(map(str, pairs[0]))})",
            )
        inputs = _stack(field, [p[0] for p in pairs], "the inputs of (input, target) pairs")
        targets = _stack(field, [p[1] for p in pairs], "the targets of (input, target) pairs")
    else:
        raise SpecError(
            field,
            "expected (inputs, targets) tensors, a map-style data set of (input, target) "
            f"pairs, or a callable returning one; got {type(value).__name__}",
        )
    leaves = _leaves(inputs) + _leaves(targets)
    if any(t.dim() == 0 for t in leaves):
        raise SpecError(field, "inputs and targets need a first (sample) dimension")
    sizes = {int(t.shape[0]) for t in leaves}
    if len(sizes) > 1:
        raise SpecError(
            field, f"inputs and targets hold different numbers of samples {sorted(sizes)}"
        )
    if sizes == {0}:
        raise SpecError(field, "the data set is empty")

    # Stages slice microbatches out of these and send them point to point.
    def contiguous(v: Any) -> Any:
        if isinstance(v, Mapping):
            return {k: contiguous(x) for k, x in v.items()}
        return v.contiguous()

    return TensorPair(contiguous(inputs), contiguous(targets))


def _takes_total_steps(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return "total_steps" in params


class JobData:
    """The data of one job in this process; each part is loaded on first use, then kept."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self._cache: dict[str, Any] = {}

    def train_tensors(self) -> TensorPair:
        """The training set as stacked ``(inputs, targets)``."""
        job = self.job
        if "train" not in self._cache:
            self._cache["train"] = _to_tensor_pair(
                "train_data", job.train_data, job.input_keys, job.target_keys
            )
        return self._cache["train"]

    def eval_tensors(self, name: str | None = None) -> TensorPair | None:
        """The eval set ``name`` (None: the only one) as stacked ``(inputs, targets)``,
        or None without `Job.eval_data`."""
        job = self.job
        if job.eval_data is None:
            return None
        name, source = job.eval_source(name)
        key = f"eval:{name}"
        if key not in self._cache:
            try:
                self._cache[key] = _to_tensor_pair(
                    "eval_data", source, job.input_keys, job.target_keys
                )
            except SpecError as exc:
                if not name:
                    raise
                raise SpecError("eval_data", f"set {name!r}: {exc.message}") from exc
        return self._cache[key]

    def _dataset(self, field: str, name: str = "") -> Any:
        key = f"{field}:{name}:dataset"
        if key not in self._cache:
            value = getattr(self.job, field)
            where = ""
            if name:
                value, where = value[name], f"set {name!r}: "
            # A factory (a class, a partial), not a data set instance.
            if isinstance(value, type) or (callable(value) and not hasattr(value, "__getitem__")):
                try:
                    value = value()
                except Exception as exc:
                    raise SpecError(
                        field, f"{where}loading the data failed: {type(exc).__name__}: {exc}"
                    ) from exc
            iterable = isinstance(value, IterableDataset)
            if iterable and field != "train_data":
                raise SpecError(
                    field, f"{where}evaluation reads every sample once: give a map-style data set"
                )
            if not iterable and not (hasattr(value, "__len__") and hasattr(value, "__getitem__")):
                raise SpecError(
                    field,
                    f"{where}with data_loader, expected a map-style (len() and [i]) or an "
                    f"iterable data set, or a callable returning one; got {type(value).__name__}",
                )
            if not iterable and len(value) == 0:
                raise SpecError(field, f"{where}the data set is empty")
            self._cache[key] = value
        return self._cache[key]

    def train_dataset(self) -> Any:
        """With `Job.data_loader`: the training data set (built, not read)."""
        return self._dataset("train_data")

    def eval_dataset(self, name: str | None = None) -> Any:
        """With `Job.data_loader`: the eval set ``name`` (None: the only one), or None
        without `Job.eval_data`."""
        if self.job.eval_data is None:
            return None
        return self._dataset("eval_data", self.job.eval_source(name)[0])

    def streams_train_data(self) -> bool:
        """Whether the training data is an iterable data set (read in its own order)."""
        return self.job.data_loader is not None and isinstance(
            self.train_dataset(), IterableDataset
        )

    def num_train_samples(self) -> int:
        """Size of the training set (a data set's ``len``, or the stacked tensors')."""
        if self.job.data_loader is not None:
            return len(self.train_dataset())
        return self.train_tensors().num_samples

    def num_eval_samples(self, name: str | None = None) -> int:
        """Size of the eval set ``name`` (None: the only one; 0 without `Job.eval_data`)."""
        if self.job.eval_data is None:
            return 0
        if self.job.data_loader is not None:
            return len(self.eval_dataset(name))
        evaluation = self.eval_tensors(name)
        assert evaluation is not None
        return evaluation.num_samples

    def example_batch(self, n: int) -> tuple[Any, Any]:
        """The first ``n`` training samples as stacked (inputs, targets): shapes and dtypes."""
        job = self.job
        if job.data_loader is not None:
            first = first_streamed if self.streams_train_data() else first_samples
            return first(
                self.train_dataset(),
                n,
                job.seed,
                job.data_loader.get("collate_fn"),
                job.input_keys,
                job.target_keys,
            )
        train = self.train_tensors()
        return (
            map_tensors(lambda t: t[:n], train.inputs),
            map_tensors(lambda t: t[:n], train.targets),
        )

    def train_stream(self) -> DataStream:
        """The deterministic batch order for training (shuffled per epoch, last batch dropped).

        Raises `SpecError` (``batch_size``) when a batch is larger than the data set.
        """
        job = self.job
        if self.streams_train_data():
            return DataStream.unbounded(job.batch_size, job.seed, grad_accum=job.grad_accum)
        n = self.num_train_samples()
        if job.batch_size > n:
            raise SpecError(
                "batch_size", f"{job.batch_size} is larger than the training set ({n} samples)"
            )
        return DataStream(n, job.batch_size, job.seed, grad_accum=job.grad_accum)

    def total_steps(self) -> int:
        """Optimizer steps the run takes: `Job.max_steps`, capped by `Job.epochs` when set.

        Raises `SpecError` (``epochs``) when the epochs hold less than one whole step.
        """
        job = self.job
        if job.epochs is None:
            assert job.max_steps is not None  # Job.validate guarantees one of them
            return job.max_steps
        if self.streams_train_data():
            raise SpecError(
                "epochs", "an iterable data set has no length to count epochs in: set max_steps"
            )
        steps = self.train_stream().steps_for_epochs(job.epochs)
        if steps < 1:
            raise SpecError(
                "epochs",
                f"{job.epochs} epoch(s) hold less than one step of {job.samples_per_step} samples",
            )
        return steps if job.max_steps is None else min(steps, job.max_steps)

    def build_scheduler(
        self, optimizer: torch.optim.Optimizer
    ) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The LR scheduler of `Job.lr_scheduler`, given ``total_steps`` when it takes them."""
        factory: Any = self.job.lr_scheduler
        if factory is None:
            return None
        if _takes_total_steps(factory):
            return factory(optimizer, total_steps=self.total_steps())
        return factory(optimizer)


_DATA: weakref.WeakKeyDictionary[Job, JobData] = weakref.WeakKeyDictionary()


def job_data(job: Job) -> JobData:
    """``job``'s data in this process (one `JobData` per job, so each part loads once)."""
    data = _DATA.get(job)
    if data is None:
        data = _DATA[job] = JobData(job)
    return data
