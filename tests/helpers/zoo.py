"""Hugging Face families built from their smallest configs, as a user hands them over.

Every entry is a model that computes its own loss (``loss_fn=None``) from the
labels among its inputs, with dropout off and ``use_cache=False``, and is split
by automatic balance (no split points). `make_job` builds the job; spec files
written by the zoo tests call it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from evtrain.job import Job

VOCAB, SEQ, WIDTH, BLOCKS = 48, 8, 16, 4
SAMPLES = 16
DECODER = {
    "vocab_size": VOCAB,
    "hidden_size": WIDTH,
    "intermediate_size": 2 * WIDTH,
    "num_hidden_layers": BLOCKS,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 2 * SEQ,
    "use_cache": False,
    "attention_dropout": 0.0,
    "pad_token_id": 0,
}


def _build(config_name: str, model_name: str, **config: Any) -> nn.Module:
    import transformers

    cfg = getattr(transformers, config_name)(**config)
    model: nn.Module = getattr(transformers, model_name)(cfg)
    return model


def _moe(**extra: Any) -> dict[str, Any]:
    return {
        **DECODER,
        "num_local_experts": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": WIDTH,
        "output_router_logits": True,
        "router_aux_loss_coef": 0.5,
        **extra,
    }


class HiddenStatesLoss(nn.Module):
    """A decoder whose loss reads every layer's hidden state (``output_hidden_states``):
    the language-model loss plus a penalty on the hidden states' size, as a
    distillation or probing loss reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = _build("LlamaConfig", "LlamaForCausalLM", **DECODER)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        out = self.lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=labels,
            output_hidden_states=True,
        )
        penalty = sum(h.pow(2).mean() for h in out.hidden_states)
        return out.loss + 0.01 * penalty


@dataclass(frozen=True)
class Family:
    model: Callable[[], nn.Module]
    inputs: tuple[str, ...]
    data: str = "text"
    hf: bool = True
    """The model reloads with ``from_pretrained`` from an ``--hf`` export."""


FAMILIES: dict[str, Family] = {
    "mixtral": Family(
        functools.partial(_build, "MixtralConfig", "MixtralForCausalLM", **_moe()),
        ("input_ids", "attention_mask", "labels"),
    ),
    "qwen3_moe": Family(
        functools.partial(
            _build, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", **_moe(head_dim=8, norm_topk_prob=True)
        ),
        ("input_ids", "attention_mask", "labels"),
    ),
    "hidden_states": Family(HiddenStatesLoss, ("input_ids", "attention_mask", "labels"), hf=False),
    "vit": Family(
        functools.partial(
            _build,
            "ViTConfig",
            "ViTForImageClassification",
            hidden_size=WIDTH,
            num_hidden_layers=BLOCKS,
            num_attention_heads=2,
            intermediate_size=2 * WIDTH,
            image_size=8,
            patch_size=4,
            num_channels=3,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        ("pixel_values", "labels"),
        data="images",
    ),
    "albert": Family(
        functools.partial(
            _build,
            "AlbertConfig",
            "AlbertForMaskedLM",
            vocab_size=VOCAB,
            embedding_size=8,
            hidden_size=WIDTH,
            num_hidden_layers=BLOCKS,
            num_hidden_groups=1,
            num_attention_heads=2,
            intermediate_size=2 * WIDTH,
            max_position_embeddings=2 * SEQ,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            classifier_dropout_prob=0.0,
        ),
        ("input_ids", "attention_mask", "labels"),
    ),
    "opt": Family(
        functools.partial(
            _build,
            "OPTConfig",
            "OPTForCausalLM",
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            ffn_dim=2 * WIDTH,
            num_hidden_layers=BLOCKS,
            num_attention_heads=2,
            max_position_embeddings=2 * SEQ,
            word_embed_proj_dim=WIDTH,
            dropout=0.0,
            attention_dropout=0.0,
            use_cache=False,
            pad_token_id=0,
        ),
        ("input_ids", "attention_mask", "labels"),
    ),
    "t5": Family(
        functools.partial(
            _build,
            "T5Config",
            "T5ForConditionalGeneration",
            vocab_size=VOCAB,
            d_model=WIDTH,
            d_kv=8,
            d_ff=2 * WIDTH,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=2,
            dropout_rate=0.0,
            use_cache=False,
            decoder_start_token_id=0,
            pad_token_id=0,
        ),
        ("input_ids", "attention_mask", "labels"),
    ),
    "bart": Family(
        functools.partial(
            _build,
            "BartConfig",
            "BartForConditionalGeneration",
            vocab_size=VOCAB,
            d_model=WIDTH,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=2 * WIDTH,
            decoder_ffn_dim=2 * WIDTH,
            max_position_embeddings=2 * SEQ,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            use_cache=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
        ),
        ("input_ids", "attention_mask", "labels"),
    ),
    "mamba": Family(
        functools.partial(
            _build,
            "MambaConfig",
            "MambaForCausalLM",
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            state_size=4,
            num_hidden_layers=BLOCKS,
            expand=2,
            conv_kernel=2,
            use_cache=False,
        ),
        ("input_ids", "attention_mask", "labels"),
    ),
    "gemma2": Family(
        functools.partial(
            _build,
            "Gemma2Config",
            "Gemma2ForCausalLM",
            **DECODER,
            head_dim=8,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
            sliding_window=4,
        ),
        ("input_ids", "attention_mask", "labels"),
    ),
    "gpt_neox": Family(
        functools.partial(
            _build,
            "GPTNeoXConfig",
            "GPTNeoXForCausalLM",
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            intermediate_size=2 * WIDTH,
            num_hidden_layers=BLOCKS,
            num_attention_heads=2,
            max_position_embeddings=2 * SEQ,
            use_parallel_residual=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cache=False,
        ),
        ("input_ids", "attention_mask", "labels"),
    ),
    "phi3": Family(
        functools.partial(_build, "Phi3Config", "Phi3ForCausalLM", **DECODER),
        ("input_ids", "attention_mask", "labels"),
    ),
    "roberta": Family(
        functools.partial(
            _build,
            "RobertaConfig",
            "RobertaForMaskedLM",
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            intermediate_size=2 * WIDTH,
            num_hidden_layers=BLOCKS,
            num_attention_heads=2,
            max_position_embeddings=2 * SEQ + 2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=0,
        ),
        ("input_ids", "attention_mask", "labels"),
    ),
    "olmo2": Family(
        functools.partial(_build, "Olmo2Config", "Olmo2ForCausalLM", **DECODER),
        ("input_ids", "attention_mask", "labels"),
    ),
}


def _text() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (SAMPLES, SEQ), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (SAMPLES,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _images() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "pixel_values": torch.randn(SAMPLES, 3, 8, 8, generator=g),
        "labels": torch.randint(0, 3, (SAMPLES,), generator=g),
    }


def data_of(name: str) -> dict[str, torch.Tensor]:
    return _images() if FAMILIES[name].data == "images" else _text()


def make_job(name: str, stages: int, steps: int, run_dir: str, **fields: Any) -> Job:
    family = FAMILIES[name]
    common: dict[str, Any] = {
        "name": f"zoo-{name}",
        "model": family.model,
        "loss_fn": None,
        "optimizer": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        "train_data": functools.partial(data_of, name),
        "input_keys": family.inputs,
        "target_keys": "labels",
        "stages": stages,
        "batch_size": 8,
        "num_microbatches": 4,
        "max_steps": steps,
        "run_dir": run_dir,
        "seed": 3,
    }
    common.update(fields)
    return Job(**common)
