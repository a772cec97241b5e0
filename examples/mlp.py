"""A tiny job spec: an MLP regressing a smooth function of 16 features, on 2 stages.

Run it with ``evtrain launch examples/mlp.py`` (add ``--stages 3``,
``--microbatches 8``, ``--schedule gpipe``, ``--steps 50`` ... to override).

A spec file is plain Python that defines ``job`` (or ``make_job()``). Every
stage process executes this file itself, so keep it deterministic and cheap
at import time: the data and layers are *factories* that run only where
needed. The fields used here:

* ``layers`` — one factory per pipeline layer (`evtrain.job.layer` makes
  one); stage r builds only its own slice. Each layer is initialized from
  (``seed``, its index), so the initial weights are the same at any number
  of stages.
* ``loss_fn`` — ``(output, target) -> scalar``, mean-reduced.
* ``optimizer`` / ``lr_scheduler`` — factories; every stage builds its own
  over its parameters; the scheduler steps once per optimizer step.
* ``train_data`` / ``eval_data`` — ``(inputs, targets)`` tensors or a
  function returning them (or a map-style data set of pairs).
* ``batch_size`` split into ``num_microbatches`` microbatches per step;
  ``max_steps`` and/or ``epochs`` decide when training ends.
* ``stages`` — pipeline stages; ``balance`` would fix the layers per stage,
  left out it balances by parameter count. ``schedule`` is "1f1b" or "gpipe".
* ``eval_every`` steps, evaluating ``loss`` plus ``metrics`` on the last stage.
* ``hooks`` — processes the launcher starts beside the run.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from evtrain.job import Job, layer

FEATURES = 16
HIDDEN = 64
DATA_SEED = 1234


def make_regression(num_samples: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic data: y = sin(x @ w) + 0.1 * |x|_1 / FEATURES + noise."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    w = torch.randn(FEATURES, 1, generator=gen) / FEATURES**0.5
    # Train and eval draw from the same distribution through disjoint streams.
    gen.manual_seed(DATA_SEED + offset)
    x = torch.randn(num_samples, FEATURES, generator=gen)
    y = torch.sin(x @ w) + 0.1 * x.abs().mean(dim=1, keepdim=True)
    y = y + 0.01 * torch.randn(num_samples, 1, generator=gen)
    return x, y


job = Job(
    name="mlp",
    layers=[
        layer(nn.Linear, FEATURES, HIDDEN),
        layer(nn.Tanh),
        layer(nn.Linear, HIDDEN, HIDDEN),
        layer(nn.Tanh),
        layer(nn.Linear, HIDDEN, 1),
    ],
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.Adam, lr=3e-3),
    lr_scheduler=functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=200),
    train_data=functools.partial(make_regression, 1024, 1),
    eval_data=functools.partial(make_regression, 256, 2),
    batch_size=64,
    num_microbatches=4,
    max_steps=200,
    eval_every=50,
    seed=0,
    stages=2,
    schedule="1f1b",
    hooks=[dict(type="logging", every=10)],
)
