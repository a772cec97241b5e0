"""A GPT-2-style language model, given as one ``nn.Module`` and split by module name.

Run it with ``evtrain launch examples/gpt.py`` (``--steps 30`` for a quick
look). It trains in well under a minute on a laptop CPU.

The model is written the way nanoGPT writes GPT-2: token and position
embeddings, pre-LayerNorm blocks of causal self-attention and an MLP, a final
LayerNorm and an LM head whose weight *is* the token embedding's weight
(tied). Its module names are nanoGPT's (``transformer.wte``,
``transformer.h.0`` ... ``lm_head``), so ``split_points=["transformer.h.2"]``
puts the embeddings and blocks 0-1 on stage 0 and blocks 2-3, the final norm
and the head on stage 1. The tied weight then lives on both stages and is
kept equal.

Any model's own ``forward`` runs unchanged on every stage (see
``examples/hf_llama.py``); this one takes the faster ``pruned_forward=True``
path instead. Every stage builds the whole model from the same seed and keeps
only its own modules; the others are ``None`` (or removed from their
container). So the ``forward`` follows three rules:

* skip a module that is not there (``x = wte(x) if wte is not None else x``),
* iterate the blocks that are there,
* return the boundary value ``(h, attention_mask)`` when the head is absent.

Stage 1 then receives that tuple as ``forward(h, attention_mask)``.

The data are samples as a Hugging Face data set yields them: ``input_ids``,
``attention_mask`` and ``labels``, one line of verse each, character by
character, padded to `SEQ_LEN` with ``labels == -100`` at the padding so the
loss ignores it. Lines differ in length, so microbatches hold different
numbers of characters: ``loss_weight`` and ``eval_weight`` count each
microbatch's labelled ones, which makes every step's and every evaluation's
loss the mean over all their characters, at any number of microbatches or
replicas. The padding mask travels from stage 0 to stage 1 beside the
hidden state, because the attention there needs it too.

The text is three public-domain poems (Blake's "The Tyger" and "The Lamb",
Dickinson's "Hope is the thing with feathers"): 51 training lines and 10
held out. This demonstrates the mechanics, not a useful language model: in
100 steps the training loss falls from ln(53) = 4.0 to about 1.6 nats per
character, while the held-out lines, never seen, stay near 2.5.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from evtrain.job import Job

TEXT = """\
Tyger Tyger, burning bright,
In the forests of the night;
What immortal hand or eye,
Could frame thy fearful symmetry?
In what distant deeps or skies.
Burnt the fire of thine eyes?
On what wings dare he aspire?
What the hand, dare seize the fire?
And what shoulder, & what art,
Could twist the sinews of thy heart?
And when thy heart began to beat,
What dread hand? & what dread feet?
What the hammer? what the chain,
In what furnace was thy brain?
What the anvil? what dread grasp,
Dare its deadly terrors clasp!
When the stars threw down their spears
And water'd heaven with their tears:
Did he smile his work to see?
Did he who made the Lamb make thee?
Little Lamb who made thee
Dost thou know who made thee
Gave thee life & bid thee feed.
By the stream & o'er the mead;
Gave thee clothing of delight,
Softest clothing wooly bright;
Gave thee such a tender voice,
Making all the vales rejoice!
Little Lamb I'll tell thee,
He is called by thy name,
For he calls himself a Lamb:
He is meek & he is mild,
He became a little child:
I a child & thou a lamb,
We are called by his name.
Little Lamb God bless thee.
Hope is the thing with feathers -
That perches in the soul -
And sings the tune without the words -
And never stops - at all -
And sweetest - in the Gale - is heard -
And sore must be the storm -
That could abash the little Bird
That kept so many warm -
I've heard it in the chillest land -
And on the strangest Sea -
Yet - never - in Extremity,
It asked a crumb - of me.
"""

PAD = 0
"""Token id of padding; `VOCAB` starts with it so every character id is > 0."""
VOCAB = ["<pad>", *sorted(set(TEXT))]
"""Token strings; a character's id is its index here."""
SEQ_LEN = 32
"""Positions per sample; longer lines continue in the next sample."""
IGNORE = -100
"""Label of positions that carry no loss (`torch.nn.functional.cross_entropy`'s default)."""
EVAL_EVERY_NTH = 6
"""Every 6th sample is held out for evaluation."""


# ------------------------------------------------------------------ the model


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of a `GPT`; the defaults make a small character-level model."""

    vocab_size: int = len(VOCAB)
    block_size: int = SEQ_LEN
    """Longest sequence (the number of learned positions)."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    """Zero by default: each stage has its own RNG, so dropout masks of a pipelined
    run differ from a single-process run's and losses would not match exactly."""
    bias: bool = True


def attention_allowed(
    attention_mask: torch.Tensor | None, seq_len: int, device: torch.device
) -> torch.Tensor:
    """Boolean ``(B, 1, T, T)`` (or ``(T, T)``) mask: True where query i may attend to key j.

    Causal, and a padding key (``attention_mask == 0``) is never attended to,
    except that every position always attends to itself: a padding query
    would otherwise have no key at all. A fully masked row is 0/0 in the
    softmax; torch 2.4's scaled_dot_product_attention and hand-written
    attention return NaN for it, which then poisons every gradient, while
    torch >= 2.5 returns zeros. With the diagonal kept, no row is ever empty.
    """
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if attention_mask is None:
        return causal
    keys = attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    itself = torch.eye(seq_len, dtype=torch.bool, device=device)
    return (causal & keys) | itself


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention through `F.scaled_dot_product_attention` with a given mask."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd {config.n_embd} is not a multiple of n_head {config.n_head}")
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), allowed)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 with nanoGPT's module names, splittable by name (see the module docstring).

    ``forward(input_ids, attention_mask=None)`` returns logits ``(B, T, V)``
    on the stage that holds ``lm_head``; elsewhere it returns
    ``(hidden, attention_mask)`` for the next stage, which is called as
    ``forward(hidden, attention_mask)``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.transformer = nn.ModuleDict(
            dict(
                wte=wte,
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # One Parameter under two names: GPT-2 ties its input and output embeddings.
        wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by depth so the residual stream's
        # variance does not grow with the number of blocks.
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        # The first stage is called with the sample's keys as keywords; a later
        # stage gets the hidden state from the one before in their place.
        x = input_ids
        t = x.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence of {t} exceeds block_size {self.config.block_size}")
        # A pipeline stage holds only some of the modules: the others are None,
        # or removed from their container, so each one is looked up with a default.
        tr = self.transformer
        wte, wpe, drop = (getattr(tr, name, None) for name in ("wte", "wpe", "drop"))
        if wte is not None:
            x = wte(x)
        if wpe is not None:
            x = x + wpe(torch.arange(t, device=x.device))
        if drop is not None:
            x = drop(x)
        blocks = getattr(tr, "h", None)
        if blocks is not None and len(blocks) > 0:
            # Built on every stage from the small (B, T) mask rather than sent
            # as (B, 1, T, T): it costs microseconds and keeps the boundary small.
            allowed = attention_allowed(attention_mask, t, x.device)
            for block in blocks:
                x = block(x, allowed)
        ln_f = getattr(tr, "ln_f", None)
        if ln_f is not None:
            x = ln_f(x)
        if self.lm_head is None:
            return x, attention_mask
        return self.lm_head(x)


# ------------------------------------------------------------------ the data


def encode(text: str) -> list[int]:
    """Token ids of ``text``; every character must be in `VOCAB`."""
    index = {ch: i for i, ch in enumerate(VOCAB)}
    return [index[ch] for ch in text]


def decode(ids: torch.Tensor) -> str:
    """The text of token ids, padding left out."""
    return "".join(VOCAB[i] for i in ids.tolist() if i != PAD)


def samples(part: str) -> dict[str, torch.Tensor]:
    """Stacked samples ``{"input_ids", "attention_mask", "labels"}``, each ``(N, SEQ_LEN)``.

    One sample per line of `TEXT` (a line longer than `SEQ_LEN` continues in
    the next sample); the labels are the inputs shifted by one, ending with
    the newline. Padding is on the right: ids `PAD`, mask 0, labels `IGNORE`.
    ``part`` is ``"train"`` or ``"eval"`` (every `EVAL_EVERY_NTH` sample).
    """
    if part not in ("train", "eval"):
        raise ValueError(f"part must be 'train' or 'eval', got {part!r}")
    rows: list[tuple[list[int], list[int]]] = []
    for line in TEXT.splitlines():
        ids = encode(line + "\n")
        for start in range(0, len(ids) - 1, SEQ_LEN):
            piece = ids[start : start + SEQ_LEN + 1]
            rows.append((piece[:-1], piece[1:]))
    held_out = [i % EVAL_EVERY_NTH == EVAL_EVERY_NTH - 1 for i in range(len(rows))]
    rows = [r for r, h in zip(rows, held_out, strict=True) if h == (part == "eval")]
    n = len(rows)
    input_ids = torch.full((n, SEQ_LEN), PAD, dtype=torch.int64)
    attention_mask = torch.zeros((n, SEQ_LEN), dtype=torch.int64)
    labels = torch.full((n, SEQ_LEN), IGNORE, dtype=torch.int64)
    for i, (inputs, targets) in enumerate(rows):
        input_ids[i, : len(inputs)] = torch.tensor(inputs)
        attention_mask[i, : len(inputs)] = 1
        labels[i, : len(targets)] = torch.tensor(targets)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions whose label is not `IGNORE`."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


def labelled(labels: torch.Tensor) -> torch.Tensor:
    """The positions a microbatch's loss averages over."""
    return (labels != IGNORE).sum()


def token_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Share of labelled positions whose most likely next character is the right one."""
    keep = labels != IGNORE
    return (logits.argmax(dim=-1)[keep] == labels[keep]).float().mean()


# ------------------------------------------------------------------ the job


def cosine(
    optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """Cosine decay that reaches its minimum on the run's last step, whatever ``--steps`` says."""
    return torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=max(total_steps - 1, 1), eta_min=3e-4
    )


def make_job() -> Job:
    """The job: the `GPT` above on 2 stages, split before block 2."""
    return Job(
        name="gpt",
        model=functools.partial(GPT, GPTConfig()),
        split_points=["transformer.h.2"],
        pruned_forward=True,
        input_keys=("input_ids", "attention_mask"),
        target_keys="labels",
        loss_fn=lm_loss,
        loss_weight=labelled,
        eval_weight=labelled,
        optimizer=functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.01),
        lr_scheduler=cosine,
        train_data=functools.partial(samples, "train"),
        eval_data=functools.partial(samples, "eval"),
        metrics={"accuracy": token_accuracy},
        batch_size=16,
        num_microbatches=4,
        eval_batch_size=8,
        max_steps=100,
        eval_every=50,
        grad_clip=1.0,
        stages=2,
        threads=1,
        hooks=[dict(type="logging", every=10)],
    )
