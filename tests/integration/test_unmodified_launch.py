"""Models as their authors wrote them, launched: the other half of
tests/integration/test_unmodified_models.py's launches, and a Hugging Face model's round trip
through `evtrain ckpt export --hf` and ``from_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.unmodified_models import Sentences, pad_batch
from test_real_models import ATOL, dumped, export_command, launch, reference
from test_unmodified_models import train_and_compare, write

from evtrain.checkpoint import latest_committed
from evtrain.data import DataStream, eval_microbatches
from evtrain.job import Job
from evtrain.spec import load_job
from evtrain.stages.loading import split_sample
from evtrain.stages.partition import build_full_model
from evtrain.stages.pytree import call, split

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

LAUNCHED = [
    ("nanogpt", (1, 4)),
    ("cnn", (2, 4)),
    ("unet", (4,)),
    ("hf_bert", (2,)),
    ("hf_gpt2", (4,)),
]


@pytest.mark.parametrize(("name", "stage_counts"), LAUNCHED, ids=[n for n, _ in LAUNCHED])
def test_launched_runs_train_as_one_process(
    tmp_path: Path, name: str, stage_counts: tuple[int, ...]
) -> None:
    train_and_compare(tmp_path, name, stage_counts)


def test_gpt2_computing_its_own_loss_exports_for_from_pretrained(tmp_path: Path) -> None:
    """GPT2LMHeadModel, its head tied to wte across two stages, its loss its own
    (loss_fn=None, labels= among the inputs): trained, checkpointed, exported as a
    Hugging Face directory, and loaded by from_pretrained with the trained weights."""
    from transformers import GPT2LMHeadModel

    steps = 5
    spec = write(
        tmp_path, "hf_gpt2_own_loss", 2, steps, hooks=[{"type": "checkpoint", "on_stop": True}]
    )
    want, _ = reference(load_job(spec), steps)
    launch(spec, "--dump-weights", str(tmp_path / "dump"))
    for shard in dumped(tmp_path / "dump"):
        for key, value in shard.items():
            torch.testing.assert_close(value, want[key], atol=ATOL, rtol=0, msg=key)
    ckpt = latest_committed(tmp_path / "run2")
    assert ckpt is not None and ckpt.step == steps
    out = tmp_path / "hf"
    printed = export_command(tmp_path / "run2", "--hf", str(out))
    assert "GPT2Config" in printed, printed
    model = GPT2LMHeadModel.from_pretrained(str(out))
    assert model.lm_head.weight is model.transformer.wte.weight
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, want[key], atol=ATOL, rtol=0, msg=key)


def varlen_reference(
    job: Job, steps: int, eval_every: int
) -> tuple[dict[str, torch.Tensor], dict[int, float], set[int]]:
    """One process over the same padded batches: the weights, the eval loss at each
    evaluation, and the padded lengths the training batches had."""
    model = build_full_model(job)
    optimizer = job.optimizer(model.parameters())
    data = Sentences()
    stream = DataStream(len(data), job.batch_size, job.seed)
    lengths: set[int] = set()

    def read(indices: list[int]) -> tuple[object, object]:
        return split_sample(pad_batch([data[i] for i in indices]), job.input_keys, job.target_keys)

    evals: dict[int, float] = {}
    for step in range(1, steps + 1):
        x, y = read(stream.indices(step - 1).tolist())
        lengths.add(x["input_ids"].shape[1])  # type: ignore[index]
        optimizer.zero_grad()
        pieces = list(
            zip(split(x, job.microbatch_size), split(y, job.microbatch_size), strict=True)
        )
        for xm, ym in pieces:
            (job.loss(call(model, xm), ym) / len(pieces)).backward()
        optimizer.step()
        if step % eval_every == 0:
            model.eval()
            total = 0.0
            with torch.no_grad():
                plan = eval_microbatches(len(data), job.batch_size, job.num_microbatches)
                for r in (r for batch in plan for r in batch):
                    xm, ym = read(list(r))
                    total += float(job.loss(call(model, xm), ym)) * len(r)
            model.train()
            evals[step] = total / len(data)
    return dict(model.state_dict()), evals, lengths


VARLEN = [("1f1b", 1, "none"), ("zbv", 2, "none"), ("1f1b", 1, "grads")]


@pytest.mark.parametrize(
    ("schedule", "chunks", "shard"), VARLEN, ids=[f"{s}-{shard}" for s, _, shard in VARLEN]
)
def test_batches_padded_to_their_own_longest_train_as_one_process(
    tmp_path: Path, schedule: str, chunks: int, shard: str
) -> None:
    """A new sequence length in many steps (and in the microbatches of an evaluation):
    every new shape is agreed on the way, and training and evaluation equal one
    process's. Sharded, two replicas pad their halves to lengths of their own."""
    steps, every = 6, 3
    fields = {
        "varlen": True,
        "eval_every": every,
        "schedule": schedule,
        "virtual_stages": chunks,
        "hooks": [{"type": "metrics"}],
    }
    if shard != "none":
        fields.update(data_parallel=2, shard=shard)
    spec = write(tmp_path, "llama_style", 2, steps, **fields)
    want, want_evals, lengths = varlen_reference(load_job(spec), steps, every)
    assert len(lengths) >= 2, lengths  # the data does take new shapes
    launch(spec, "--dump-weights", str(tmp_path / "dump"))
    for shard in dumped(tmp_path / "dump"):
        for key, value in shard.items():
            torch.testing.assert_close(value, want[key], atol=ATOL, rtol=0, msg=key)
    rows = [json.loads(line) for line in (tmp_path / "run2" / "metrics.jsonl").open()]
    got_evals = {r["step"]: r["metrics"]["loss"] for r in rows if r["type"] == "eval"}
    assert got_evals.keys() == want_evals.keys()
    for step, loss in want_evals.items():
        assert got_evals[step] == pytest.approx(loss, abs=ATOL), step
