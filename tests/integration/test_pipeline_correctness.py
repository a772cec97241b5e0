"""Pipelined training through `evtrain launch` equals plain single-process training.

For P in {1, 2, 3, 4} (every schedule at 2, most at 4, zbv at 3), a small MLP is trained a few steps
by a real ``evtrain launch`` (broker, hook process, elastic agent, P stage
workers). The per-step losses come from the bus (a recorder hook,
tests/helpers/launch_hooks.py) and the final weights from the workers'
``--dump-weights``; both must match a plain PyTorch loop over the same
data, seed and initial weights (fp32, atol 1e-5).

Launch start-up costs seconds, so the launches run two at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.launch_helpers import kill_marked, new_marker, run_launch, write_spec
from safetensors.torch import load_file

from evtrain.overrides import apply_overrides
from evtrain.spec import load_job
from evtrain.stages.job_data import job_data
from evtrain.stages.partition import build_full_model

pytestmark = pytest.mark.slow

STEPS = 5
# Every schedule at 2 stages and most at 4 (interleaved and zbv hold 2 chunks per
# stage: the 6 layers make no more than 3 stages of them), 1F1B at 1 and 3: at one
# stage the schedules run the same computations, and 3 stages add an odd middle,
# which zbv, whose chunks run down and back up, has at 3 too.
CONFIGS = [
    (1, "1f1b"),
    (2, "gpipe"),
    (2, "1f1b"),
    (2, "zb"),
    (2, "interleaved"),
    (2, "zbv"),
    (3, "1f1b"),
    (3, "zbv"),
    (4, "gpipe"),
    (4, "1f1b"),
    (4, "zb"),
]
CHUNKED = {"interleaved", "zbv"}
PARALLEL_LAUNCHES = 2
ATOL = 1e-5


def reference(spec: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final weights of a plain single-process loop on the whole batch."""
    job = apply_overrides(load_job(spec), {"stages": "1"})
    model = build_full_model(job)
    optimizer = job.optimizer(model.parameters())
    inputs, targets = job_data(job).train_tensors()
    stream = job_data(job).train_stream()
    losses = []
    for step in range(1, job.max_steps + 1):
        index = stream.indices(step - 1)  # step k reads the batch of index k - 1
        optimizer.zero_grad()
        loss = job.loss_fn(model(inputs[index]), targets[index])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every (P, schedule) configuration launched once; their outputs by configuration."""
    root = tmp_path_factory.mktemp("pipeline")
    spec = write_spec(
        root,
        steps=STEPS,
        hooks=[{"type": "helpers.launch_hooks:StepRecorder"}],  # path from $EVTRAIN_TEST_STEPS
    )
    markers = [new_marker() for _ in CONFIGS]

    def launch(i: int) -> dict[str, Any]:
        stages, schedule = CONFIGS[i]
        out = root / f"p{stages}-{schedule}"
        out.mkdir()
        proc, leftovers = run_launch(
            spec,
            "--stages",
            str(stages),
            "--schedule",
            schedule,
            "--virtual-stages",
            "2" if schedule in CHUNKED else "1",
            "--run-dir",
            str(out / "run"),
            "--dump-weights",
            str(out / "weights"),
            "--quiet",
            marker=markers[i],
            timeout=120,
            EVTRAIN_TEST_STEPS=str(out / "steps.jsonl"),
        )
        return {"proc": proc, "leftovers": leftovers, "dir": out}

    try:
        with ThreadPoolExecutor(PARALLEL_LAUNCHES) as pool:
            results = list(pool.map(launch, range(len(CONFIGS))))
        yield {"spec": spec, "results": dict(zip(CONFIGS, results, strict=True))}
    finally:
        for token in markers:
            kill_marked(token)


@pytest.fixture(scope="module")
def expected(launched: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference(launched["spec"])


@pytest.mark.parametrize(("stages", "schedule"), CONFIGS)
def test_launch_matches_single_process_training(
    launched: dict[str, Any],
    expected: tuple[list[float], dict[str, torch.Tensor]],
    stages: int,
    schedule: str,
) -> None:
    result = launched["results"][(stages, schedule)]
    proc = result["proc"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not result["leftovers"]
    assert f"run completed: {STEPS}/{STEPS} steps" in proc.stdout

    lines = (result["dir"] / "steps.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["num_stages"] for r in records if "started" in r] == [stages]
    losses = [r["loss"] for r in records if "step" in r]
    assert [r["step"] for r in records if "step" in r] == list(range(1, STEPS + 1))
    assert all(r["stage"] == stages - 1 for r in records if "step" in r)
    ref_losses, ref_weights = expected
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=ATOL)

    shards = sorted((result["dir"] / "weights").glob("stage-*.safetensors"))
    assert len(shards) == stages
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(str(shard))
        assert not set(part) & set(weights), "a parameter appears on two stages"
        weights.update(part)
    assert set(weights) == set(ref_weights)
    for key, value in ref_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=ATOL, msg=key)
    # The run really trained: the weights moved away from the initial ones.
    job = load_job(launched["spec"])
    initial = build_full_model(job).state_dict()
    assert any(not torch.allclose(initial[k], weights[k]) for k in initial)
