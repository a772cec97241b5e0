"""Hugging Face's ``LlamaForCausalLM``, exactly as transformers ships it, on 2 stages.

Run it with ``evtrain launch examples/hf_llama.py`` after
``pip install -e '.[hf]'``. The model is built from a small `LlamaConfig`,
so nothing is downloaded, and trained on the verse bundled with
``examples/gpt.py``.

Nothing in the model is adapted to the pipeline. Its units are found inside
it (``model.embed_tokens``, ``model.layers.0`` ... ``model.norm``,
``lm_head``), ``split_points=["model.layers.2"]`` puts the embedding and
layers 0-1 on stage 0, and every stage runs ``LlamaForCausalLM.forward`` as
written: the causal mask and the rotary tables are built on each stage from
the inputs, and only the hidden state after layer 1 and the padding mask
cross the boundary. To fine-tune pretrained weights, give the launch
``--load-weights`` a ``save_pretrained`` directory's ``model.safetensors``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from gpt import PAD, SEQ_LEN, VOCAB, cosine, lm_loss, samples, token_accuracy

from evtrain.job import Job


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
        use_cache=False,  # a pipeline trains without a key/value cache
    )
    return LlamaForCausalLM(config)


def loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return lm_loss(output.logits, labels)


def accuracy(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return token_accuracy(output.logits, labels)


def make_job() -> Job:
    return Job(
        name="hf-llama",
        model=llama,
        split_points=["model.layers.2"],
        input_keys=("input_ids", "attention_mask"),
        target_keys="labels",
        loss_fn=loss,
        optimizer=functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.01),
        lr_scheduler=cosine,
        train_data=functools.partial(samples, "train"),
        eval_data=functools.partial(samples, "eval"),
        metrics={"accuracy": accuracy},
        batch_size=16,
        num_microbatches=4,
        eval_batch_size=8,
        max_steps=100,
        eval_every=50,
        grad_clip=1.0,
        stages=2,
        threads=1,
        # A checkpoint at the end, for `evtrain ckpt export RUN --hf DIR`.
        hooks=[dict(type="logging", every=10), dict(type="checkpoint", on_stop=True)],
    )
