"""A job streaming a token file through the DataLoader path
(for tests/integration/test_streaming.py).

The windows are long (`SEQ_LEN` tokens, 256 KiB of file each) and the model
is cheap: on the first stage a bag of the embeddings of each window's first
`PREFIX` tokens, on the last a classifier of the token that follows them.
So an epoch over a file of hundreds of MB takes seconds, the time goes into
reading (the DataLoader workers read, convert and collate every window
whole), and the stages' main processes touch one page (and the kernel's
fault-around, 64 KiB) per row of each batch they receive: what they hold is
the run's own memory, hardly the batches'. `write_pattern` writes such a
file quickly.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from evtrain.datasets import TokenFile, write_tokens
from evtrain.job import Job, layer

SEQ_LEN = 131072
PREFIX = 512
VOCAB = 251
BATCH = 8


def write_pattern(path: Path, megabytes: int) -> int:
    """A uint16 token file of ``megabytes`` MiB: one 1 MiB chunk of ids < `VOCAB`, repeated."""
    chunk = (np.arange(1 << 19, dtype=np.int64) * 7919 % VOCAB).astype(np.uint16)
    return write_tokens(path, (chunk for _ in range(megabytes)))


class BagOfTokens(nn.Module):
    """The mean embedding of the first `PREFIX` tokens of each window: ``(B, dim)``.

    Computed as token frequencies times a linear map, which equals
    ``nn.EmbeddingBag(mode="mean")`` without its backward over every token.
    """

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Linear(vocab, dim, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids[:, :PREFIX]
        ones = torch.ones((), device=ids.device).expand(ids.shape)
        counts = torch.zeros(ids.shape[0], self.vocab, device=ids.device)
        return self.embed(counts.scatter_add_(1, ids, ones) / ids.shape[1])


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the token that follows each window's first `PREFIX` tokens."""
    return F.cross_entropy(logits, labels[:, PREFIX - 1])


def make_job(
    run_dir: str, token_file: str, steps: int, workers: int, hooks: list[Any] | None = None
) -> Job:
    return Job(
        name="stream",
        layers=[
            layer(BagOfTokens, VOCAB, 16),
            layer(nn.Linear, 16, 32),
            layer(nn.Tanh),
            layer(nn.Linear, 32, VOCAB),
        ],
        balance=[2, 2],
        stages=2,
        loss_fn=next_token_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        train_data=functools.partial(TokenFile, token_file, SEQ_LEN),
        data_loader={"num_workers": workers},
        input_keys="input_ids",
        target_keys="labels",
        batch_size=BATCH,
        num_microbatches=4,
        max_steps=steps,
        run_dir=run_dir,
        threads=1,
        microbatch_spans="off",
        hooks=hooks or [],
    )
