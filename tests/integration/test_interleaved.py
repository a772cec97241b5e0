"""Interleaved 1F1B through `evtrain launch`: checkpoints that resume at any shape.

Two stages hold two model chunks each (the model split in four; stage s holds
chunks s and s + 2, Megatron's placement). Each stage saves
one shard holding both its chunks; the manifest's layer ranges tile the model.
A checkpoint of the interleaved run resumes as plain 1F1B on three stages, as
interleaved with two replicas and as zbv (the same four chunks placed in a V:
stage s holds chunks 1 - s and 2 + s), and each ends within 1e-6 of the
uninterrupted interleaved run. (Its equality with single-process training is
in test_stage_runtime and test_data_parallel.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_data_parallel import launch, resume_and_compare, spec_file

from evtrain.checkpoint import list_checkpoints
from evtrain.checkpoint.storage import read_manifest
from evtrain.overrides import apply_overrides
from evtrain.spec import load_job
from evtrain.stages.partition import partition

pytestmark = pytest.mark.slow

INTERLEAVED = ("--schedule", "interleaved", "--virtual-stages", "2")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An interleaved run of 20 steps that committed checkpoints at steps 10 and 20."""
    d = tmp_path_factory.mktemp("interleaved")
    spec = spec_file(d, hooks=[{"type": "checkpoint", "every_steps": 10}])
    out = launch(spec, *INTERLEAVED, "--dump-weights", str(d / "weights"))
    assert "run completed: 20/20 steps" in out
    assert "(interleaved x 2 chunks, 4 microbatches)" in out
    return d


def test_each_stage_saves_its_chunks_in_one_shard(uninterrupted: Path) -> None:
    committed = [c for c in list_checkpoints(uninterrupted / "run") if c.committed]
    assert [c.step for c in committed] == [10, 20]
    manifest = read_manifest(committed[0].path)
    job = apply_overrides(
        load_job(uninterrupted / "spec.py"), {"schedule": "interleaved", "virtual_stages": "2"}
    )
    chunks = partition(job)
    assert len(chunks) == 4
    assert sorted((e.stage, e.layers) for e in manifest.stages) == [
        (s, [chunks[s].start, chunks[s].stop, chunks[s + 2].start, chunks[s + 2].stop])
        for s in range(2)
    ]
    done = subprocess.run(
        [sys.executable, "-m", "evtrain", "ckpt", "verify", str(committed[0].path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    "layout",
    [
        ("--stages", "3", "--schedule", "1f1b"),
        (*INTERLEAVED, "--dp", "2"),
        ("--schedule", "zbv", "--virtual-stages", "2"),
    ],
    ids=["1f1b-P3", "interleaved-D2", "zbv"],
)
def test_an_interleaved_checkpoint_resumes_at_another_shape(
    uninterrupted: Path, tmp_path: Path, layout: tuple[str, ...]
) -> None:
    resume_and_compare(uninterrupted, tmp_path, *layout)
