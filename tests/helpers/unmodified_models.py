"""Models written as their authors write them, for the as-written forward tests.

None of these forwards knows about pipelines: heads are called unconditionally,
containers are indexed or sliced, masks and position ids are built inside
``forward``, and a U-Net's skip connections reach across the model. Spec files
written by tests/integration/test_unmodified_models.py call `make_job`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from evtrain.job import Job

VOCAB, SEQ, WIDTH, BLOCKS = 32, 8, 16, 4
SAMPLES = 32


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))


class GPTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), allowed)
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's layout and forward: the head runs unconditionally and is tied to wte."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, WIDTH),
                "wpe": nn.Embedding(SEQ, WIDTH),
                "h": nn.ModuleList([GPTBlock() for _ in range(BLOCKS)]),
                "ln_f": nn.LayerNorm(WIDTH),
            }
        )
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        _b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        causal = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        eye = torch.eye(t, dtype=torch.bool, device=idx.device)
        allowed = causal & attention_mask[:, None, :].bool() | eye
        for block in self.transformer.h:
            x = block(x, allowed)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = RMSNorm()
        self.wq = nn.Linear(WIDTH, WIDTH, bias=False)
        self.wkv = nn.Linear(WIDTH, 2 * WIDTH // heads, bias=False)
        self.wo = nn.Linear(WIDTH, WIDTH, bias=False)
        self.ffn_norm = RMSNorm()
        self.w1 = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.w3 = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.w2 = nn.Linear(2 * WIDTH, WIDTH, bias=False)

    def forward(
        self, h: torch.Tensor, mask: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        b, t, _ = h.shape
        x = self.attention_norm(h)
        q = self.wq(x).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = self.wkv(x).view(b, t, 1, -1).transpose(1, 2).chunk(2, dim=-1)  # one kv head
        q, k = rotate(q, *freqs), rotate(k, *freqs)
        k, v = k.expand_as(q), v.expand_as(q)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.wo(a.transpose(1, 2).reshape(b, t, -1))
        x = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaDecoder(nn.Module):
    """Position ids from the padding mask, rotary tables and the 4-D mask built in
    ``forward`` and handed to every block; layers sliced by the configured depth."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([LlamaBlock() for _ in range(BLOCKS)])
        self.norm = RMSNorm()
        self.output = nn.Linear(WIDTH, VOCAB, bias=False)
        half = WIDTH // 2 // 2
        self.register_buffer(
            "inv_freq", 1.0 / (10000 ** (torch.arange(half) / half)), persistent=False
        )
        self.n_layers = BLOCKS

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(input_ids)
        t = input_ids.shape[1]
        pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        angles = pos[:, None, :, None].float() * self.inv_freq
        freqs = (angles.cos(), angles.sin())
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        eye = torch.eye(t, dtype=torch.bool, device=h.device)
        mask = (causal & attention_mask[:, None, None, :].bool()) | eye
        for i in range(self.n_layers):
            h = self.layers[i](h, mask, freqs)
        return self.output(self.norm(h))


def conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout))


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            conv_bn(channels, channels), nn.ReLU(), conv_bn(channels, channels)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.body(x))


def cnn() -> nn.Sequential:
    """A small ResNet as one nn.Sequential, BatchNorm throughout."""
    return nn.Sequential(
        conv_bn(3, 8),
        nn.ReLU(),
        Residual(8),
        Residual(8),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        Residual(16),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


class UNet(nn.Module):
    """Skip connections from each encoder level to its decoder level."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1 = nn.Conv2d(3, 4, 3, padding=1)
        self.enc2 = nn.Conv2d(4, 8, 3, padding=1)
        self.mid = nn.Conv2d(8, 8, 3, padding=1)
        self.dec2 = nn.Conv2d(16, 4, 3, padding=1)
        self.dec1 = nn.Conv2d(8, 4, 3, padding=1)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = F.relu(self.enc1(x))
        e2 = F.relu(self.enc2(F.max_pool2d(e1, 2)))
        m = F.relu(self.mid(e2))
        d2 = F.relu(self.dec2(torch.cat([m, e2], dim=1)))
        d1 = F.relu(self.dec1(torch.cat([F.interpolate(d2, scale_factor=2.0), e1], dim=1)))
        return self.head(d1)


class AuxBlock(nn.Module):
    """A block with a gate whose auxiliary loss the model collects; ``route`` says how:
    ``"hook"`` (a forward hook on the gate), ``"attribute"`` (the block sets
    ``self.aux``) or ``"list"`` (the block appends to the model's list)."""

    def __init__(self, route: str, collected: list[torch.Tensor]) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, 4)
        self.mix = nn.Linear(4, WIDTH)
        self.route = route
        self.collected = collected
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.route == "attribute":
            self.aux = logits.softmax(-1).pow(2).mean()
        elif self.route == "list":
            self.collected.append(logits.softmax(-1).pow(2).mean())
        return x + self.mix(logits.tanh())


class AuxLossModel(nn.Module):
    """Blocks whose auxiliary losses the loss sums, collected by one of `AuxBlock`'s routes."""

    def __init__(self, route: str) -> None:
        super().__init__()
        self.collected: list[torch.Tensor] = []
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(AuxBlock(route, self.collected) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.route = route
        if route == "hook":
            for block in self.blocks:
                block.gate.register_forward_hook(self._collect)

    def _collect(self, _module: nn.Module, _args: Any, logits: torch.Tensor) -> None:
        self.collected.append(logits.softmax(-1).pow(2).mean())

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.collected.clear()
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        if self.route == "attribute":
            aux = sum(block.aux for block in self.blocks)
        else:
            aux = sum(self.collected)
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)) + 0.5 * aux


def _hf_decoder(family: str, heads: int = 2, kv_heads: int = 1, **fields: Any) -> nn.Module:
    import transformers

    config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=BLOCKS,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=SEQ,
        use_cache=False,
        **fields,
    )
    model: nn.Module = getattr(transformers, f"{family}ForCausalLM")(config)
    return model


hf_llama = functools.partial(_hf_decoder, "Llama")
hf_qwen2 = functools.partial(_hf_decoder, "Qwen2")
hf_llama_4_heads = functools.partial(_hf_decoder, "Llama", 4, 2)
"""The Llama with heads that two tensor ranks split: 4 query heads, 2 key/value heads."""
hf_llama_tied = functools.partial(_hf_decoder, "Llama", 4, 2, tie_word_embeddings=True)
"""That Llama with its head tied to its embedding."""
hf_qwen3_4_heads = functools.partial(_hf_decoder, "Qwen3", 4, 2, head_dim=WIDTH // 4)
"""A Qwen3 two tensor ranks split, whose plan keeps the per-head query and key norms
whole on each rank (``replicated_with_grad_allreduce``)."""


def hf_llama_split_logits() -> nn.Module:
    """The 4-head Llama that refuses whole logits once its head is split over tensor
    ranks: a loss-parallel run must leave them split (a DTensor sharded on the
    vocabulary)."""
    from torch.distributed.tensor import DTensor

    model = hf_llama_4_heads()

    def check(module: nn.Module, args: Any, output: Any) -> None:
        weight = module.lm_head.weight
        if isinstance(weight, DTensor) and "tp" in (weight.device_mesh.mesh_dim_names or ()):
            logits = output.logits
            assert isinstance(logits, DTensor) and logits.placements[-1].is_shard(2), logits

    model.register_forward_hook(check)
    return model


def hf_llama_checkpointed() -> nn.Module:
    """The Llama with Hugging Face's own activation checkpointing on (its default kind)."""
    model = hf_llama()
    model.activation_checkpointing_enable()  # type: ignore[operator]
    return model


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=WIDTH,
        n_layer=BLOCKS,
        n_head=2,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return GPT2LMHeadModel(config)


def hf_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=BLOCKS,
        num_attention_heads=2,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        pad_token_id=0,
    )
    return BertForSequenceClassification(config)


def _text() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (SAMPLES, SEQ), generator=g)
    lengths = torch.randint(2, SEQ + 1, (SAMPLES,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    labels = torch.roll(ids, -1, dims=1).masked_fill(mask == 0, -100)
    classes = torch.randint(0, 3, (SAMPLES,), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "classes": classes}


def _images(channels_out: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 3, 8, 8, generator=g)
    if channels_out is None:
        return x, torch.randint(0, 10, (SAMPLES,), generator=g)
    return x, torch.randn(SAMPLES, channels_out, 8, 8, generator=g)


def logits_of(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits_of(output).reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100
    )


def class_loss(output: Any, classes: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_of(output), classes)


MODELS: dict[str, Any] = {
    "nanogpt": (NanoGPT, ("input_ids", "attention_mask"), "labels", lm_loss),
    "llama_style": (LlamaDecoder, ("input_ids", "attention_mask"), "labels", lm_loss),
    "cnn": (cnn, None, None, F.cross_entropy),
    "unet": (UNet, None, None, F.mse_loss),
    "aux_hook": (
        functools.partial(AuxLossModel, "hook"),
        ("input_ids", "labels"),
        "labels",
        None,
    ),
    "aux_attribute": (
        functools.partial(AuxLossModel, "attribute"),
        ("input_ids", "labels"),
        "labels",
        None,
    ),
    "aux_list": (
        functools.partial(AuxLossModel, "list"),
        ("input_ids", "labels"),
        "labels",
        None,
    ),
    "hf_llama": (hf_llama, ("input_ids", "attention_mask"), "labels", lm_loss),
    "hf_qwen2": (hf_qwen2, ("input_ids", "attention_mask"), "labels", lm_loss),
    "hf_llama_4_heads": (hf_llama_4_heads, ("input_ids", "attention_mask"), "labels", lm_loss),
    "hf_llama_tied": (hf_llama_tied, ("input_ids", "attention_mask"), "labels", lm_loss),
    "hf_llama_split_logits": (
        hf_llama_split_logits,
        ("input_ids", "attention_mask"),
        "labels",
        lm_loss,
    ),
    "hf_llama_split_logits_own_loss": (
        hf_llama_split_logits,
        ("input_ids", "attention_mask", "labels"),
        "labels",
        None,
    ),
    "hf_qwen3_4_heads": (hf_qwen3_4_heads, ("input_ids", "attention_mask"), "labels", lm_loss),
    "hf_llama_tied_own_loss": (
        hf_llama_tied,
        ("input_ids", "attention_mask", "labels"),
        "labels",
        None,
    ),
    "hf_gpt2": (hf_gpt2, ("input_ids", "attention_mask"), "labels", lm_loss),
    "hf_bert": (hf_bert, ("input_ids", "attention_mask"), "classes", class_loss),
    # The model computes its own loss from labels= (Hugging Face's convention).
    "hf_llama_own_loss": (hf_llama, ("input_ids", "attention_mask", "labels"), "labels", None),
    "hf_gpt2_own_loss": (hf_gpt2, ("input_ids", "attention_mask", "labels"), "labels", None),
}


class Sentences(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token sequences of their own lengths (2 to SEQ), unpadded: `pad_batch` pads each
    batch to its own longest, so the batches' shapes differ."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(11)
        self.ids = torch.randint(1, VOCAB, (SAMPLES, SEQ + 1), generator=g)
        # Mostly short, a few long: the longest of a batch varies from batch to batch.
        self.lengths = [SEQ if i % 9 == 0 else 2 + i % 3 for i in range(SAMPLES)]

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = self.lengths[i]
        return {"input_ids": self.ids[i, :n], "labels": self.ids[i, 1 : n + 1]}


def pad_batch(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest sample: ids with 0, labels with -100, and the mask."""
    t = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), t, dtype=torch.long)
    labels = torch.full((len(samples), t), -100, dtype=torch.long)
    mask = torch.zeros(len(samples), t, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = s["input_ids"], s["labels"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def data_of(name: str) -> Any:
    if name == "cnn":
        return _images(None)
    if name == "unet":
        return _images(2)
    text = _text()
    if name == "nanogpt":
        text["idx"] = text["input_ids"]
    return text


def make_job(
    name: str, stages: int, steps: int, run_dir: str, *, varlen: bool = False, **fields: Any
) -> Job:
    """``varlen``: the text read from `Sentences` through a DataLoader, each batch padded
    to its own longest sample (training and evaluation)."""
    model, inputs, targets, loss = MODELS[name]
    if name == "nanogpt":
        inputs = ("idx", "attention_mask")
    common: dict[str, Any] = {
        "name": f"unmodified-{name}",
        "model": model,
        "loss_fn": loss,
        "optimizer": functools.partial(torch.optim.SGD, lr=0.2, momentum=0.9),
        "train_data": functools.partial(data_of, name),
        "input_keys": inputs,
        "target_keys": targets,
        "stages": stages,
        "batch_size": 8,
        "num_microbatches": 4,
        "max_steps": steps,
        "run_dir": run_dir,
        "seed": 3,
    }
    if varlen:
        common.update(
            train_data=Sentences, eval_data=Sentences, data_loader={"collate_fn": pad_batch}
        )
    common.update(fields)
    return Job(**common)
