"""A small GPT-style language model streaming nanoGPT-style token files.

Run it with ``evtrain launch examples/lm_stream.py`` (``--steps 30`` for a
quick look).

The data are token files as nanoGPT's ``prepare.py`` writes them: a flat
array of uint16 token ids, ``train.bin`` and ``val.bin``. On first use the
built-in text (the opening of Lewis Carroll's *Alice's Adventures in
Wonderland*, public domain) is encoded character by character and written
to such files in the temporary directory (`data_dir`); later runs reuse
them. `evtrain.datasets.TokenFile` reads them through a DataLoader with two
worker processes: sample ``i`` is the window of `SEQ_LEN` + 1 tokens at
``i * SEQ_LEN``, split into ``input_ids`` and ``labels`` (the same, shifted
by one). Only the first stage (inputs) and the last (targets) read the
files; each reader process opens its own descriptor and reads each window
with ``pread``, so a file of many GB costs each process no more memory than
a few batches (tests/integration/test_streaming.py and bench/data_loading.py measure
it).

The model is a decoder in pipeline layers: token and position embeddings,
`BLOCKS` pre-norm blocks of causal self-attention and an MLP, a final norm
and the head; ``balance="compute"`` splits it into two stages of about the
same work. To train it on real token files (GPT-2 token ids from nanoGPT's
``prepare.py``), have `make_job` return ``lm_job(functools.partial(
TokenFile, "train.bin", 256), functools.partial(TokenFile, "val.bin", 256),
vocab_size=50304, seq_len=256)``.

This demonstrates the mechanics, not a useful model: 2.4 kB of text is
soon learned by heart. In 100 steps the training loss falls from ln(51) =
3.9 to about 1 nat per character, while the held-out loss, on text never
seen, stays near 3. Each evaluation starts its own DataLoader workers,
which costs a few seconds on a small machine.
"""

from __future__ import annotations

import functools
import hashlib
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from evtrain.datasets import TokenFile, write_tokens
from evtrain.job import Job, layer

TEXT = """\
Alice was beginning to get very tired of sitting by her sister on the bank, and of
having nothing to do: once or twice she had peeped into the book her sister was
reading, but it had no pictures or conversations in it, 'and what is the use of a
book,' thought Alice 'without pictures or conversations?'
So she was considering in her own mind (as well as she could, for the hot day made
her feel very sleepy and stupid), whether the pleasure of making a daisy-chain would
be worth the trouble of getting up and picking the daisies, when suddenly a White
Rabbit with pink eyes ran close by her.
There was nothing so very remarkable in that; nor did Alice think it so very much
out of the way to hear the Rabbit say to itself, 'Oh dear! Oh dear! I shall be
late!' (when she thought it over afterwards, it occurred to her that she ought to
have wondered at this, but at the time it all seemed quite natural); but when the
Rabbit actually took a watch out of its waistcoat-pocket, and looked at it, and then
hurried on, Alice started to her feet, for it flashed across her mind that she had
never before seen a rabbit with either a waistcoat-pocket, or a watch to take out of
it, and burning with curiosity, she ran across the field after it, and fortunately
was just in time to see it pop down a large rabbit-hole under the hedge.
In another moment down went Alice after it, never once considering how in the world
she was to get out again.
The rabbit-hole went straight on like a tunnel for some way, and then dipped
suddenly down, so suddenly that Alice had not a moment to think about stopping
herself before she found herself falling down a very deep well.
Either the well was very deep, or she fell very slowly, for she had plenty of time
as she went down to look about her and to wonder what was going to happen next.
First, she tried to look down and make out what she was coming to, but it was too
dark to see anything; then she looked at the sides of the well, and noticed that
they were filled with cupboards and book-shelves; here and there she saw maps and
pictures hung upon pegs. She took down a jar from one of the shelves as she passed;
it was labelled 'ORANGE MARMALADE', but to her great disappointment it was empty:
she did not like to drop the jar for fear of killing somebody underneath, so managed
to put it into one of the cupboards as she fell past it.
"""

VOCAB = sorted(set(TEXT))
"""The characters of the text; a character's id is its index here."""
SEQ_LEN = 32
"""Tokens per sample."""
DIM = 64
HEADS = 4
BLOCKS = 4
TRAIN_FRACTION = 0.9
"""The first 90 % of the text is ``train.bin``, the rest ``val.bin``."""
LOADER: Mapping[str, Any] = MappingProxyType({"num_workers": 2})
"""The DataLoader options: two worker processes per reading stage."""


# ------------------------------------------------------------------ the data


def encode(text: str) -> list[int]:
    """Character ids of ``text``; every character must be in `VOCAB`."""
    index = {ch: i for i, ch in enumerate(VOCAB)}
    return [index[ch] for ch in text]


def decode(ids: torch.Tensor) -> str:
    """The text of character ids."""
    return "".join(VOCAB[i] for i in ids.tolist())


def data_dir() -> Path:
    """Where the built-in text's token files live: a temporary directory named by the
    text's digest, so an edited text gets new files."""
    digest = hashlib.sha256(TEXT.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"evtrain-lm-stream-{digest}"


def builtin_tokens(split: str) -> TokenFile:
    """The `TokenFile` of ``split`` (``"train"`` or ``"val"``) of the built-in text,
    written on first use.

    Every process of a run calls this; whichever comes first writes the files
    (each under a temporary name, renamed when complete, so two writers
    never leave a half-written file).
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    directory = data_dir()
    path = directory / f"{split}.bin"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        ids = encode(TEXT)
        cut = int(len(ids) * TRAIN_FRACTION)
        write_tokens(path, ids[:cut] if split == "train" else ids[cut:])
    return TokenFile(path, SEQ_LEN)


# ------------------------------------------------------------------ the model


class Embedding(nn.Module):
    """Token ids ``(B, T)`` -> token plus position embeddings ``(B, T, D)``."""

    def __init__(self, vocab: int, dim: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Final layer norm and the map to token logits ``(B, T, V)``."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position of every window."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def token_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Share of positions whose most likely next token is the right one."""
    return (logits.argmax(dim=-1) == labels).float().mean()


def cosine(
    optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """Cosine decay that reaches its minimum on the run's last step."""
    return torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=max(total_steps - 1, 1), eta_min=3e-4
    )


# ------------------------------------------------------------------ the job


def lm_job(
    train_data: Callable[[], Any] | Any,
    eval_data: Callable[[], Any] | Any | None = None,
    *,
    vocab_size: int,
    seq_len: int,
    dim: int = DIM,
    heads: int = HEADS,
    blocks: int = BLOCKS,
    data_loader: Mapping[str, Any] | None = LOADER,
    **fields: Any,
) -> Job:
    """The decoder above as a 2-stage job on samples ``{"input_ids", "labels"}``.

    ``train_data``/``eval_data`` are `TokenFile` factories (or any data of
    such samples); ``data_loader`` are the DataLoader options (None: the
    data are stacked in memory instead); ``fields`` override the other
    `evtrain.job.Job` fields.
    """
    options: dict[str, Any] = dict(
        name="lm-stream",
        layers=[
            layer(Embedding, vocab_size, dim, seq_len),
            *(layer(Block, dim, heads) for _ in range(blocks)),
            layer(Head, dim, vocab_size),
        ],
        balance="compute",
        loss_fn=lm_loss,
        optimizer=functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.01),
        lr_scheduler=cosine,
        train_data=train_data,
        data_loader=None if data_loader is None else dict(data_loader),
        input_keys="input_ids",
        target_keys="labels",
        batch_size=16,
        num_microbatches=4,
        max_steps=100,
        grad_clip=1.0,
        stages=2,
        threads=1,
        hooks=[dict(type="logging", every=10)],
    )
    if eval_data is not None:
        options.update(
            eval_data=eval_data,
            metrics={"accuracy": token_accuracy},
            eval_batch_size=8,
            eval_every=50,
        )
    options.update(fields)
    return Job(**options)


def make_job() -> Job:
    """The job: the decoder trained on the built-in text's token files."""
    return lm_job(
        functools.partial(builtin_tokens, "train"),
        functools.partial(builtin_tokens, "val"),
        vocab_size=len(VOCAB),
        seq_len=SEQ_LEN,
    )
