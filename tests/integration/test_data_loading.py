"""The DataLoader path through `evtrain launch`: only the consuming stages read, worker
processes change nothing, augmentation is per epoch and reproducible, and a stage
killed mid-epoch resumes with exactly the samples an uninterrupted run reads."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.launch_helpers import TESTS_DIR, new_marker, run_launch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

STEPS = 12  # two epochs of 6 batches


def write(directory: Path, **args: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    spec = directory / "spec.py"
    fields = ", ".join(f"{k}={v!r}" for k, v in args.items())
    spec.write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS_DIR)!r})\nfrom helpers import loader_spec\n"
        f"job = loader_spec.make_job({str(directory / 'run')!r}, {fields})\n"
    )
    return spec


def launch(spec: Path, *args: str, **env: str) -> str:
    proc, leftovers = run_launch(spec, "--quiet", *args, marker=new_marker(), timeout=240, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not leftovers
    return proc.stdout


def weights(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("stage-*.safetensors")):
        out.update(load_file(str(f)))
    return out


def reads(path: Path) -> list[tuple[str, int, str]]:
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(rank, int(i), draw) for rank, i, draw in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("loader") / "workers2"
    launch(
        write(d, steps=STEPS, workers=2),
        "--dump-weights",
        str(d / "w"),
        EVTRAIN_TEST_READS=str(d / "reads"),
    )
    return {"weights": weights(d / "w"), "reads": reads(d / "reads")}


def test_only_consuming_stages_read_and_augmentation_is_per_epoch(
    uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    rows = uninterrupted["reads"]
    # Stage 0 reads the inputs and stage 2 the targets; stage 1 never opens a sample.
    # ("?" is the launcher, which reads one microbatch to check the model on meta.)
    assert {rank for rank, _, _ in rows} == {"0", "2", "?"}
    assert len([r for r in rows if r[0] == "?"]) == 2  # one microbatch of 8 / 4
    draws: dict[tuple[str, int], list[str]] = defaultdict(list)
    for rank, index, draw in rows:
        draws[(rank, index)].append(draw)
    # Each of the two epochs draws another augmentation of a sample (workers may
    # prefetch into a third), and both reading stages draw the same ones.
    for index in range(48):
        last = draws[("2", index)]
        assert len(set(last)) == len(last) >= 2, (index, last)
        assert set(last) <= set(draws[("0", index)]), index

    # Without workers, everything is the same: the draws and the trained weights.
    d = tmp_path / "workers0"
    launch(
        write(d, steps=STEPS, workers=0),
        "--dump-weights",
        str(d / "w"),
        EVTRAIN_TEST_READS=str(d / "reads"),
    )
    assert set(reads(d / "reads")) <= set(rows)  # the same draws, less prefetching
    got = weights(d / "w")
    for key, value in uninterrupted["weights"].items():
        assert torch.equal(got[key], value), key


def test_kill_mid_epoch_resumes_the_same_samples(
    uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    d = tmp_path / "killed"
    spec = write(
        d,
        steps=STEPS,
        workers=2,
        kill_step=9,  # epoch 1, batch 3 of 6
        marker=str(tmp_path / "killed.marker"),
        hooks=[{"type": "checkpoint", "every_steps": 2}],
    )
    launch(spec, "--max-restarts", "1", "--dump-weights", str(d / "w"))
    assert (tmp_path / "killed.marker").exists()  # the stage really died once
    got = weights(d / "w")
    for key, value in uninterrupted["weights"].items():
        assert torch.equal(got[key], value), key


def test_a_cosine_schedule_ends_on_the_last_step_after_steps(tmp_path: Path) -> None:
    d = tmp_path / "cosine"
    spec = write(d, steps=200, workers=0, schedule=True, hooks=[{"type": "metrics"}])
    launch(spec, "--steps", "5")
    lines = [json.loads(x) for x in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = [x["lr"] for x in lines if x.get("type") == "step"]
    assert len(lrs) == 5
    assert lrs[0] == pytest.approx(0.1) and lrs[-1] == pytest.approx(0.0, abs=1e-9), lrs


def test_an_iterable_data_set_restarts_mid_stream_to_the_same_weights(tmp_path: Path) -> None:
    plain, killed = tmp_path / "plain", tmp_path / "killed"
    launch(write(plain, steps=8, workers=2, iterable=True), "--dump-weights", str(plain / "w"))
    spec = write(
        killed,
        steps=8,
        workers=2,
        iterable=True,
        kill_step=7,  # the second pass over the stream, batch 1 of 6
        marker=str(tmp_path / "killed.marker"),
        hooks=[{"type": "checkpoint", "every_steps": 2}],
    )
    launch(spec, "--max-restarts", "1", "--dump-weights", str(killed / "w"))
    assert (tmp_path / "killed.marker").exists()
    want, got = weights(plain / "w"), weights(killed / "w")
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_a_data_set_defined_in_the_spec_file_reaches_the_workers(tmp_path: Path) -> None:
    spec = tmp_path / "spec.py"
    spec.write_text(
        "import functools, torch\n"
        "from torch import nn\n"
        "from torch.utils.data import Dataset\n"
        "from evtrain.job import Job, layer\n"
        "class Pairs(Dataset):\n"
        "    def __len__(self):\n"
        "        return 32\n"
        "    def __getitem__(self, i):\n"
        "        return torch.full((4,), float(i)), torch.zeros(1)\n"
        "job = Job(name='inline', layers=[layer(nn.Linear, 4, 1)], stages=1,\n"
        "          loss_fn=nn.functional.mse_loss,\n"
        "          optimizer=functools.partial(torch.optim.SGD, lr=0.01),\n"
        "          train_data=Pairs, data_loader={'num_workers': 2}, batch_size=8,\n"
        f"          num_microbatches=1, max_steps=3, run_dir={str(tmp_path / 'run')!r})\n"
    )
    assert "run completed: 3/3 steps" in launch(spec)
