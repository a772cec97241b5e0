"""A tiny character-level transformer language model split across 4 pipeline stages.

Run it with ``evtrain launch examples/transformer.py`` (``--steps 50`` for a
quick look, ``--stages 2`` to fold it onto 2 processes).

The model reads 32 characters and predicts each next one. Its pipeline
layers are the embedding (characters and positions), four pre-norm
transformer blocks with causal self-attention, and the head (final norm and
a linear map to character logits); ``balance=[2, 1, 1, 2]`` puts the
embedding with the first block and the head with the last, so the four
stages hold about the same number of parameters. Every layer takes one
tensor and returns one, which is all a pipeline layer needs: token ids
``(B, T)`` go into the embedding, activations ``(B, T, D)`` travel between
stages, logits ``(B, T, V)`` come out of the head.

The text is five of Shakespeare's sonnets (public domain), embedded below;
the first 90 % trains, the rest is held out. Evaluation reports the
cross-entropy loss in nats per character (perplexity is ``exp(loss)``) and
next-character accuracy. This is a demonstration of splitting a transformer,
not a useful language model: 3 kB of text is soon learned by heart, which is
why it stops after 120 steps (the held-out loss stops improving around
there; it falls from ln(51) = 3.9 to about 2.4 nats per character).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from evtrain.job import Job, layer

TEXT = """\
Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.

When, in disgrace with fortune and men's eyes,
I all alone beweep my outcast state,
And trouble deaf heaven with my bootless cries,
And look upon myself and curse my fate,
Wishing me like to one more rich in hope,
Featured like him, like him with friends possess'd,
Desiring this man's art and that man's scope,
With what I most enjoy contented least;
Yet in these thoughts myself almost despising,
Haply I think on thee, and then my state,
Like to the lark at break of day arising
From sullen earth, sings hymns at heaven's gate;
For thy sweet love remember'd such wealth brings
That then I scorn to change my state with kings.

That time of year thou mayst in me behold
When yellow leaves, or none, or few, do hang
Upon those boughs which shake against the cold,
Bare ruin'd choirs, where late the sweet birds sang.
In me thou see'st the twilight of such day
As after sunset fadeth in the west,
Which by and by black night doth take away,
Death's second self, that seals up all in rest.
In me thou see'st the glowing of such fire
That on the ashes of his youth doth lie,
As the death-bed whereon it must expire,
Consumed with that which it was nourish'd by.
This thou perceivest, which makes thy love more strong,
To love that well which thou must leave ere long.

Let me not to the marriage of true minds
Admit impediments. Love is not love
Which alters when it alteration finds,
Or bends with the remover to remove:
O no! it is an ever-fixed mark
That looks on tempests and is never shaken;
It is the star to every wandering bark,
Whose worth's unknown, although his height be taken.
Love's not Time's fool, though rosy lips and cheeks
Within his bending sickle's compass come;
Love alters not with his brief hours and weeks,
But bears it out even to the edge of doom.
If this be error and upon me proved,
I never writ, nor no man ever loved.

My mistress' eyes are nothing like the sun;
Coral is far more red than her lips' red;
If snow be white, why then her breasts are dun;
If hairs be wires, black wires grow on her head.
I have seen roses damask'd, red and white,
But no such roses see I in her cheeks;
And in some perfumes is there more delight
Than in the breath that from my mistress reeks.
I love to hear her speak, yet well I know
That music hath a far more pleasing sound;
I grant I never saw a goddess go;
My mistress, when she walks, treads on the ground:
And yet, by heaven, I think my love as rare
As any she belied with false compare.
"""

VOCAB = sorted(set(TEXT))
"""The characters of the text; a character's id is its index here."""
CONTEXT = 32
"""Characters per training sample."""
DIM = 64
HEADS = 4
BLOCKS = 4
TRAIN_FRACTION = 0.9


def encode(text: str) -> torch.Tensor:
    """Character ids (int64) of ``text``; every character must be in `VOCAB`."""
    index = {ch: i for i, ch in enumerate(VOCAB)}
    return torch.tensor([index[ch] for ch in text], dtype=torch.int64)


def decode(ids: torch.Tensor) -> str:
    """The text of character ids."""
    return "".join(VOCAB[i] for i in ids.tolist())


def windows(part: str, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)``: windows of `CONTEXT` ids and the same shifted by one.

    ``part`` is ``"train"`` (the first `TRAIN_FRACTION` of the text) or
    ``"eval"`` (the rest); windows start every ``stride`` characters.
    """
    ids = encode(TEXT)
    cut = int(len(ids) * TRAIN_FRACTION)
    ids = ids[:cut] if part == "train" else ids[cut:]
    starts = torch.arange(0, len(ids) - CONTEXT - 1, stride)
    offsets = torch.arange(CONTEXT)
    inputs = ids[starts[:, None] + offsets]
    targets = ids[starts[:, None] + offsets + 1]
    return inputs, targets


class Embedding(nn.Module):
    """Character ids ``(B, T)`` -> character plus position embeddings ``(B, T, D)``."""

    def __init__(self, vocab: int, dim: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class Block(nn.Module):
    """A pre-norm transformer block: causal multi-head self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        # True above the diagonal: position t may not attend to later positions.
        mask = torch.triu(torch.ones(context, context, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.norm1(x)
        attended, _ = self.attn(h, h, h, attn_mask=self.causal_mask[:t, :t], need_weights=False)
        x = x + attended
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Final layer norm and the map to character logits ``(B, T, V)``."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position of every sequence."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def char_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Share of positions whose most likely next character is the right one."""
    return (logits.argmax(dim=-1) == targets).float().mean()


job = Job(
    name="char-transformer",
    layers=[
        layer(Embedding, len(VOCAB), DIM, CONTEXT),
        *(layer(Block, DIM, HEADS, CONTEXT) for _ in range(BLOCKS)),
        layer(Head, DIM, len(VOCAB)),
    ],
    loss_fn=lm_loss,
    optimizer=functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.01),
    lr_scheduler=functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=120),
    train_data=functools.partial(windows, "train", 4),
    eval_data=functools.partial(windows, "eval", CONTEXT // 2),
    metrics={"accuracy": char_accuracy},
    batch_size=32,
    num_microbatches=8,
    eval_batch_size=16,
    max_steps=120,
    eval_every=40,
    stages=4,
    balance=[2, 1, 1, 2],
    schedule="1f1b",
    threads=1,
    hooks=[dict(type="logging", every=20)],
)
