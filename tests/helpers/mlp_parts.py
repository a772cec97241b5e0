"""The parts of the small MLP jobs that the launch tests' spec files share.

Stage processes import them from the spec (``tests/`` is on their
PYTHONPATH, `helpers.launch_helpers.launch_env`).
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn


def make_data(num_samples: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth regression problem of 8 features, the same for a given ``offset``."""
    gen = torch.Generator().manual_seed(4321 + offset)
    x = torch.randn(num_samples, 8, generator=gen)
    y = 0.5 * x[:, :1] + torch.sin(x[:, 1:2]) - 0.25 * x[:, 2:3] * x[:, 3:4]
    return x, y


def make_classes(num_samples: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`make_data`'s problem as 6 classes (its target binned)."""
    x, y = make_data(num_samples, offset)
    return x, torch.bucketize(y[:, 0], torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0]))


def split_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy that refuses whole logits in a launched run: its head leaves them
    split over the tensor ranks, and the loss of the halves gathers none of them (loss
    parallelism)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    if not torch.distributed.is_initialized():
        return nn.functional.cross_entropy(output, target)
    assert isinstance(output, DTensor) and output.placements[-1].is_shard(1), output
    with CommDebugMode() as comms:
        loss = nn.functional.cross_entropy(output, target)
    gathers = [str(op) for op in comms.get_comm_counts() if "gather" in str(op)]
    assert not gathers, gathers
    return loss


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(-1) == target).double().mean()


def mae(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).abs().mean()


class Slow(nn.Module):
    """Identity that sleeps in training forwards; with ``pid_dir``, each stage worker
    records its process id there."""

    def __init__(self, delay: float, pid_dir: str | None = None) -> None:
        super().__init__()
        self.delay = delay
        if pid_dir:
            os.makedirs(pid_dir, exist_ok=True)
            if "RANK" in os.environ:  # a stage worker (not the launcher checking the spec)
                name = os.environ["RANK"] + "-" + str(os.getpid())
                open(os.path.join(pid_dir, name), "w").close()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.delay:
            time.sleep(self.delay)
        return x


class Fault(nn.Module):
    """Identity that raises during training step ``fail_at_step`` (1-based) and may sleep.

    With ``marker`` it fails only while the marker file does not exist (and creates it).
    With ``stamp`` it writes the wall-clock time of the failure to that file first.
    """

    def __init__(
        self,
        fail_at_step: int | None = None,
        microbatches: int = 4,
        marker: str | None = None,
        delay: float = 0.0,
        stamp: str | None = None,
    ) -> None:
        super().__init__()
        self.fail_at_step = fail_at_step
        self.microbatches = microbatches
        self.marker = marker
        self.delay = delay
        self.stamp = stamp
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            step = (self.calls - 1) // self.microbatches + 1
            failing = self.fail_at_step is not None and step == self.fail_at_step
            if failing and (self.marker is None or not os.path.exists(self.marker)):
                if self.marker is not None:
                    open(self.marker, "w").close()
                if self.stamp is not None:
                    with open(self.stamp, "w") as fh:
                        fh.write(repr(time.time()))
                raise RuntimeError(f"injected failure at step {step}")
        if self.delay:
            time.sleep(self.delay)
        return x


class FeedForward(nn.Module):
    """``x + down(tanh(up(x)))``: the pair a tensor-parallel plan splits (up by columns,
    down by rows)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class NormedFeedForward(FeedForward):
    """``x + down(tanh(up(norm(x))))``: a transformer's MLP half, whose norm a
    sequence-parallel plan runs on each rank's slice of the sequence."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__(width, hidden)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class LengthProbe(nn.Module):
    """Identity that records, once per stage worker, the sequence length (dimension 1) of
    what it is given, in ``directory/RANK``."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "RANK" in os.environ:
            path = os.path.join(self.directory, os.environ["RANK"])
            if not os.path.exists(path):
                with open(path, "w") as f:
                    f.write(str(x.shape[1]))
        return x


def make_sequences(num_samples: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of ``length`` tokens of 8 features, with 2 targets per token that depend
    on the token and its position."""
    gen = torch.Generator().manual_seed(1234 + length)
    x = torch.randn(num_samples, length, 8, generator=gen)
    position = torch.linspace(-1, 1, length).view(1, length, 1)
    y = torch.cat([0.5 * x[..., :1] + position, torch.sin(x[..., 1:2]) * position], dim=-1)
    return x, y
