"""The benchmark's MLP (8 x Linear(512)+ReLU, batch 256, M=8) for the README timeline.

Run: evtrain launch examples/bench_mlp.py --run-dir runs/mlp512
then: evtrain timeline runs/mlp512 -o runs/mlp512/trace.json --png docs/timeline.png --steps 28:30
"""

import torch
from torch import nn

from evtrain import Job, layer

g = torch.Generator().manual_seed(0)
X = torch.randn(4096, 512, generator=g)
Y = torch.randn(4096, 512, generator=g)

layers = []
for _ in range(8):
    layers += [layer(nn.Linear, 512, 512), layer(nn.ReLU)]

job = Job(
    name="mlp512",
    layers=layers,
    loss_fn=nn.functional.mse_loss,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
    train_data=(X, Y),
    batch_size=256,
    num_microbatches=8,
    max_steps=30,
    stages=2,
    microbatch_spans="all",
    hooks=[dict(type="recorder")],
)
