"""A small ResNet (BatchNorm, residual blocks) classifying digits, balanced by compute.

Run it with ``evtrain launch examples/resnet.py`` (``--stages 3`` to split it
three ways, ``--steps 30`` for a quick look).

The network is ResNet-18's design at toy size: a 3x3 stem, five BasicBlocks
(two 3x3 convolutions with BatchNorm and a shortcut that is a strided 1x1
convolution where the shape changes), global average pooling and a linear
classifier. Each of those is one pipeline layer.

Why ``balance="compute"``: as the feature maps halve and the channels
double, every block costs about the same arithmetic, but the parameter
count grows fourfold each time. Balancing by parameters (the default)
would put five layers on the first stage and only the last block and the
head, under a fifth of the work, on the second; balancing by an estimate
of each layer's floating-point operations puts the stem and two blocks on
the first stage and the rest on the second, within 10 % of each other.

BatchNorm normalises each microbatch by its own statistics and updates its
running averages once per microbatch, exactly as a single process does
when it feeds the same microbatches one after another.

The data are scikit-learn's bundled handwritten digits (1,797 grey 8x8
images, 10 classes), upsampled to 16x16; every fifth image is held out.
They are a map-style data set (`Digits`) read through a DataLoader with two
worker processes (``data_loader``), which augments every training image
with a random crop of the image padded by `CROP_PAD` pixels and a random
left-right flip (`crop_and_flip`). evtrain seeds each sample's draws by the
epoch and the sample, so an image is cropped and flipped differently in
every epoch, the same in every rerun and with any number of workers, and a
resumed run draws what an uninterrupted one would have.

Held-out accuracy reaches about 95 % in the 150 steps. Augmentation does
not pay in so short a run, it is here to show the mechanics: with crops
alone it reached 98 %, without augmentation 99 % (one run each). Mirroring
suits natural images more than digits, whose mirror images are not always
digits of the same class.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Dataset

from evtrain.job import Job, accuracy, layer

IMAGE_SIZE = 16
CLASSES = 10
EVAL_EVERY_NTH = 5
"""Every 5th image is held out for evaluation."""
CROP_PAD = 2
"""Pixels of background added around a training image before a random crop."""
BACKGROUND = -1.0
"""The value of a blank pixel after `digits` centres the images."""


def digits(part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images (N, 1, 16, 16) float32, labels (N,) int64)`` of ``part`` "train" or "eval"."""
    if part not in ("train", "eval"):
        raise ValueError(f"part must be 'train' or 'eval', got {part!r}")
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0
    images = F.interpolate(images, size=IMAGE_SIZE, mode="bilinear", align_corners=False)
    labels = torch.tensor(data.target, dtype=torch.int64)
    held_out = torch.arange(len(labels)) % EVAL_EVERY_NTH == EVAL_EVERY_NTH - 1
    keep = held_out if part == "eval" else ~held_out
    # Centred around zero, so the stem's first convolution starts from a sensible scale.
    return (images[keep] - 0.5) / 0.5, labels[keep]


def crop_and_flip(image: torch.Tensor) -> torch.Tensor:
    """A random ``IMAGE_SIZE`` crop of ``image`` ``(C, H, W)`` padded by `CROP_PAD` pixels of
    background (a shift of up to 2 pixels each way), mirrored left-right half the time.

    Draws from torch's global generator, which evtrain seeds per sample and epoch.
    """
    padded = F.pad(image, (CROP_PAD,) * 4, value=BACKGROUND)
    top, left = torch.randint(0, 2 * CROP_PAD + 1, (2,)).tolist()
    out = padded[:, top : top + IMAGE_SIZE, left : left + IMAGE_SIZE]
    if torch.rand(()) < 0.5:
        out = out.flip(-1)
    return out


class Digits(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The images of `digits` as ``(image, label)`` samples; ``augment`` crops and flips
    every image at random (`crop_and_flip`) as it is read."""

    def __init__(self, part: str, augment: bool = False) -> None:
        self.images, self.labels = digits(part)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        return (crop_and_flip(image) if self.augment else image), self.labels[index]


class Stem(nn.Module):
    """3x3 convolution from the grey image to ``channels`` feature maps, BatchNorm, ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, plus the shortcut.

    With ``stride`` 2 or a change of width, the shortcut is a strided 1x1
    convolution with BatchNorm, as in ResNet's "option B".
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Head(nn.Module):
    """Global average pooling and the linear classifier: logits ``(B, classes)``."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


LAYERS = [
    layer(Stem, 16),
    layer(BasicBlock, 16, 16),
    layer(BasicBlock, 16, 32, stride=2),
    layer(BasicBlock, 32, 32),
    layer(BasicBlock, 32, 64, stride=2),
    layer(BasicBlock, 64, 64),
    layer(Head, 64, CLASSES),
]
"""The pipeline layers, in order: 16x16 maps with 16 channels, 8x8 with 32, 4x4 with 64."""


def make_job() -> Job:
    """The job: the ResNet above on 2 stages, split where the estimated compute is halved."""
    return Job(
        name="resnet",
        layers=LAYERS,
        loss_fn=F.cross_entropy,
        optimizer=functools.partial(
            torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True
        ),
        lr_scheduler=functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=150),
        train_data=functools.partial(Digits, "train", augment=True),
        eval_data=functools.partial(Digits, "eval"),
        data_loader={"num_workers": 2},
        metrics={"accuracy": accuracy},
        batch_size=64,
        num_microbatches=4,
        eval_batch_size=128,
        max_steps=150,
        eval_every=50,
        stages=2,
        balance="compute",
        threads=1,
        hooks=[dict(type="logging", every=10)],
    )
