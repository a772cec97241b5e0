"""A job read through the DataLoader path, for tests/integration/test_data_loading.py.

Its data set augments every sample with noise and a random flip (seeded per
sample and epoch by evtrain), and logs each read as ``RANK index draw`` to
``$EVTRAIN_TEST_READS``; a `KillOnce` layer SIGKILLs its stage at a given step
the first time (a marker file remembers).
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from evtrain.job import Job, layer

SAMPLES, FEATURES, CLASSES = 48, 16, 4


class Augmented(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g)
        self.y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        noise = 0.1 * torch.randn(FEATURES)
        x = self.x[i] + noise
        if torch.rand(()) < 0.5:
            x = x.flip(0)
        reads = os.environ.get("EVTRAIN_TEST_READS")
        if reads:
            with open(reads, "a") as f:
                f.write(f"{os.environ.get('RANK', '?')} {i} {float(noise[0]):.9f}\n")
        return {"x": x, "y": self.y[i]}


class Streamed(IterableDataset[dict[str, torch.Tensor]]):
    """The same samples as an iterable data set, each worker yielding its share."""

    def __init__(self) -> None:
        self.samples = Augmented()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(start, SAMPLES, step):
            yield self.samples[i]


class KillOnce(nn.Module):
    """Identity; SIGKILLs this process in training step ``step`` unless ``marker`` exists."""

    def __init__(self, step: int | None, marker: str | None, microbatches: int) -> None:
        super().__init__()
        self.step, self.marker, self.microbatches = step, marker, microbatches
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            step = (self.calls - 1) // self.microbatches + 1
            first_time = self.marker is not None and not os.path.exists(self.marker)
            if step == self.step and first_time:
                assert self.marker is not None
                open(self.marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        return x


def cosine(
    optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """Reaches its minimum (0) on the run's last step, whatever --steps says."""
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps - 1)


def make_job(
    run_dir: str,
    steps: int,
    workers: int,
    kill_step: int | None = None,
    marker: str | None = None,
    hooks: list[Any] | None = None,
    schedule: bool = False,
    iterable: bool = False,
) -> Job:
    return Job(
        lr_scheduler=cosine if schedule else None,
        name="loader",
        layers=[
            layer(nn.Linear, FEATURES, 32),
            layer(nn.ReLU),
            layer(KillOnce, kill_step, marker, 4),
            layer(nn.Linear, 32, 32),
            layer(nn.ReLU),
            layer(nn.Linear, 32, CLASSES),
        ],
        balance=[2, 2, 2],
        stages=3,
        loss_fn=nn.functional.cross_entropy,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        train_data=Streamed if iterable else Augmented,
        data_loader={"num_workers": workers},
        input_keys="x",
        target_keys="y",
        batch_size=8,
        num_microbatches=4,
        max_steps=steps,
        run_dir=run_dir,
        threads=1,
        hooks=hooks or [],
    )
