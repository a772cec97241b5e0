"""Splitting a job's layers across pipeline stages and building one stage's slice.

* `partition` — contiguous layer ranges per stage: an explicit balance, or
  automatic by parameter count (counted on the meta device, nothing is
  allocated).
* `build_stage_module` — the layers of one stage as a `StageModule`, whose
  state_dict keys are those of the whole unsplit model (``"3.weight"``), so
  checkpoints taken at one number of stages load at another.
* `build_full_model` — the unsplit ``nn.Sequential`` with identical weights
  (single-process reference, checkpoint export).

Initialization does not depend on the partition: layer i is always built
with the CPU RNG seeded to ``derive_seed(job.seed, "layer", i)`` (see
`build_layer`), whichever stage builds it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import structlog
import torch
from torch import nn

from evtrain.data import derive_seed
from evtrain.errors import SpecError
from evtrain.job import Job, LayerFactory

__all__ = [
    "StageModule",
    "build_full_model",
    "build_layer",
    "build_stage_module",
    "layer_param_counts",
    "partition",
]

log = structlog.get_logger()


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def layer_param_counts(factories: Sequence[LayerFactory]) -> list[int]:
    """Parameters per layer, counted by building each layer on the meta device.

    Meta tensors have shapes but no storage, so even a huge model costs
    nothing here. A factory that fails on meta (e.g. it loads a file) is
    built on the CPU instead, then dropped.
    """
    counts = []
    for i, factory in enumerate(factories):
        # The RNG fork keeps counting free of side effects on the caller's RNG.
        with torch.random.fork_rng(devices=[]):
            try:
                with torch.device("meta"):
                    module = factory()
            except Exception as exc:
                log.warning(
                    "layer does not build on meta; counting on cpu", layer=i, error=str(exc)
                )
                with torch.device("cpu"):
                    module = factory()
        if not isinstance(module, nn.Module):
            raise SpecError(
                "layers", f"layer {i} factory returned {type(module).__name__}, not an nn.Module"
            )
        counts.append(_param_count(module))
        del module
    return counts


def _balanced_split(counts: Sequence[int], num_stages: int) -> list[int]:
    """Layers per stage of the contiguous split minimizing the largest stage.

    Minimizes ``(max params, max layers)`` over stages in lexicographic order:
    parameters first, then layer count, so parameter-free layers (ReLU) are
    spread evenly instead of piling up. Exact dynamic program,
    O(num_stages * L^2) — fine for the few hundred layers of a pipeline.
    """
    n = len(counts)
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int) -> tuple[int, int]:
        return (prefix[j] - prefix[i], j - i)

    # best[k][j]: optimal (max params, max layers) for layers[:j] in k+1 stages.
    best = [[cost(0, j) for j in range(n + 1)]]
    cut: list[list[int]] = [[0] * (n + 1)]
    for k in range(1, num_stages):
        row = [(0, 0)] * (n + 1)
        row_cut = [0] * (n + 1)
        for j in range(k + 1, n + 1):
            choice = None
            for i in range(k, j):
                value = max(best[k - 1][i], cost(i, j))
                if choice is None or value < choice:
                    choice, row_cut[j] = value, i
            row[j] = choice  # type: ignore[assignment]
        best.append(row)
        cut.append(row_cut)
    sizes = []
    j = n
    for k in range(num_stages - 1, 0, -1):
        i = cut[k][j]
        sizes.append(j - i)
        j = i
    sizes.append(j)
    return sizes[::-1]


def partition(
    job_or_layers: Job | Sequence[LayerFactory],
    num_stages: int | None = None,
    balance: Sequence[int] | None = None,
) -> list[range]:
    """Contiguous global layer-index ranges, one per stage.

    With a `Job`, ``num_stages`` and ``balance`` default to ``job.stages`` and
    ``job.balance``. With ``balance`` the ranges follow it; otherwise layers
    are split to minimize the largest per-stage parameter count (see
    `layer_param_counts`), every stage getting at least one layer.
    Deterministic, so every stage process computes the same answer.

    Raises `SpecError` (``stages`` or ``balance``) for impossible requests.
    """
    if isinstance(job_or_layers, Job):
        factories: Sequence[LayerFactory] = job_or_layers.layers
        num_stages = job_or_layers.stages if num_stages is None else num_stages
        balance = job_or_layers.balance if balance is None else balance
    else:
        factories = job_or_layers
        if num_stages is None:
            raise TypeError("partition() needs num_stages when given a list of layer factories")
    n = len(factories)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise SpecError("stages", f"expected an integer >= 1, got {num_stages!r}")
    if num_stages > n:
        raise SpecError("stages", f"{num_stages} stages but only {n} layers to place")
    if balance is not None:
        sizes = list(balance)
        if len(sizes) != num_stages:
            raise SpecError("balance", f"has {len(sizes)} entries but stages is {num_stages}")
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise SpecError("balance", f"every stage needs at least one layer, got {sizes}")
        if sum(sizes) != n:
            raise SpecError("balance", f"{sizes} places {sum(sizes)} layers but there are {n}")
    else:
        sizes = _balanced_split(layer_param_counts(factories), num_stages)
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def build_layer(job: Job, index: int) -> nn.Module:
    """Build layer ``index`` on the CPU with its own RNG seed; the caller's RNG is untouched.

    The CPU generator is seeded to ``derive_seed(job.seed, "layer", index)``
    (and the default device forced to CPU) around the factory call, so a
    layer's initial weights depend only on the seed and its index.
    """
    factory = job.layers[index]
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        # Only the CPU generator: torch.manual_seed would also reseed CUDA
        # generators outside the fork.
        torch.default_generator.manual_seed(derive_seed(job.seed, "layer", index))
        module = factory()
    if not isinstance(module, nn.Module):
        raise SpecError(
            "layers", f"layer {index} factory returned {type(module).__name__}, not an nn.Module"
        )
    return module


class StageModule(nn.ModuleDict):
    """The layers of one stage, keyed by their global index as a string.

    ``state_dict()`` keys therefore equal the unsplit ``nn.Sequential``'s
    (``"3.weight"``). ``forward`` applies the layers in index order.
    """

    def __init__(self, layers: Mapping[int, nn.Module]) -> None:
        ordered = sorted(layers)
        if not ordered or ordered != list(range(ordered[0], ordered[0] + len(ordered))):
            raise ValueError(f"a stage needs a non-empty contiguous run of layers, got {ordered}")
        super().__init__({str(i): layers[i] for i in ordered})
        # Global indices of the layers this stage holds.
        self.layer_range = range(ordered[0], ordered[-1] + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.values():
            x = module(x)
        return x

    def extra_repr(self) -> str:
        return f"layers={self.layer_range.start}..{self.layer_range.stop - 1}"


def build_stage_module(
    job: Job, layer_range: range, device: torch.device | str = "cpu"
) -> StageModule:
    """Build only the layers in ``layer_range`` (see `build_layer`) and move them to ``device``.

    The factories of all other layers are not called.
    """
    if not len(layer_range) or layer_range.step != 1:
        raise ValueError(f"layer_range must be a non-empty contiguous range, got {layer_range}")
    if layer_range.start < 0 or layer_range.stop > job.num_layers:
        raise ValueError(f"{layer_range} is outside the job's {job.num_layers} layers")
    module = StageModule({i: build_layer(job, i) for i in layer_range})
    return module.to(device)


def build_full_model(job: Job, device: torch.device | str = "cpu") -> nn.Sequential:
    """The whole model as ``nn.Sequential``, with the same weights any partition starts from."""
    model = nn.Sequential(*(build_layer(job, i) for i in range(job.num_layers)))
    return model.to(device)
