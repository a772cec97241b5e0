"""Models as their authors wrote them, launched: the other half of
tests/test_unmodified_models.py's launches, and a Hugging Face model's round trip
through `evtrain ckpt export --hf` and ``from_pretrained``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_real_models import ATOL, dumped, launch, reference
from test_unmodified_models import train_and_compare, write

from evtrain.checkpoint import latest_committed
from evtrain.spec import load_job

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

LAUNCHED = [("nanogpt", (1, 4)), ("cnn", (4,)), ("unet", (4,)), ("hf_bert", (2,))]


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
    export = subprocess.run(
        [
            sys.executable,
            "-m",
            "evtrain",
            "ckpt",
            "export",
            str(tmp_path / "run2"),
            "--hf",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert export.returncode == 0, export.stderr
    assert "GPT2Config" in export.stdout, export.stdout
    model = GPT2LMHeadModel.from_pretrained(str(out))
    assert model.lm_head.weight is model.transformer.wte.weight
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, want[key], atol=ATOL, rtol=0, msg=key)
