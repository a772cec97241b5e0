"""`Job.loss_weight`: a padded token model's training steps are the mean over every token
of the step's batch, at any number of microbatches, replicas and accumulation passes.

A 2-stage pipeline (real stage workers under elastic, `helpers.stage_driver`)
trains a small embedding model whose sequences are padded to different lengths,
so its microbatches hold different numbers of tokens; losses and final weights
must equal one process stepping on each whole batch, and the same job without
``loss_weight`` must not (the mean of microbatch means weights tokens unequally).
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.stage_driver import Bus, finish, start_driver
from safetensors.torch import load_file

from evtrain.errors import SpecError
from evtrain.events import StageStopped, StepEnded
from evtrain.overrides import apply_overrides
from evtrain.spec import load_job
from evtrain.stages.job_data import job_data
from evtrain.stages.partition import build_full_model
from evtrain.stages.worker import WorkerConfig

pytestmark = pytest.mark.slow

SPEC = """
import functools
import torch
from torch import nn
from torch.nn import functional as F
from evtrain.job import Job, layer

VOCAB, SEQ, ROWS = 11, 6, 64


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (ROWS,), generator=g)
    pad = torch.arange(SEQ)[None, :] >= lengths[:, None]
    x[pad] = 0
    y[pad] = -100
    return x, y


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100)


def tokens(target):
    return (target != -100).sum()


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, h):
        return h + torch.tanh(self.linear(h))


job = Job(
    name="padded",
    layers=[layer(nn.Embedding, VOCAB, 8), layer(Mix), layer(Mix), layer(nn.Linear, 8, VOCAB)],
    loss_fn=loss_fn,
    loss_weight=tokens if {weighted} else None,
    optimizer=functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9),
    train_data=data,
    batch_size=16,
    num_microbatches=2,
    max_steps=10,
    grad_accum={grad_accum},
    seed=5,
    threads=1,
)
"""

ATOL = 1e-5


def write_spec(directory: Path, *, weighted: bool, grad_accum: int) -> Path:
    path = directory / f"padded_w{int(weighted)}_a{grad_accum}.py"
    path.write_text(
        SPEC.replace("{weighted}", str(weighted)).replace("{grad_accum}", str(grad_accum))
    )
    return path


def whole_batch_training(
    spec: Path, clip: str = "none"
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, one optimizer step per step on the step's whole batch (every
    accumulation pass), its loss the mean over the batch's tokens: the losses, the
    gradient norms before clipping and the final weights."""
    job = apply_overrides(load_job(spec), {"stages": "1", "grad_clip": clip})
    model = build_full_model(job)
    optimizer = job.optimizer(model.parameters())
    data = job_data(job).train_tensors()
    stream = job_data(job).train_stream()
    losses, norms = [], []
    for step in range(1, job.max_steps + 1):
        idx = torch.cat([stream.indices(step - 1, a) for a in range(job.grad_accum)])
        loss = job.loss_fn(model(data.inputs[idx]), data.targets[idx])
        loss.backward()
        limit = job.grad_clip if job.grad_clip is not None else math.inf
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), limit)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, model.state_dict()


@pytest.fixture
def bus() -> Iterator[Bus]:
    b = Bus()
    try:
        yield b
    finally:
        b.close()


# (schedule, microbatches, replicas, grad_accum, grad_clip, weighted); the clip
# binds in most steps, so the global norm must be the weighted gradients'.
RUNS = [
    ("1f1b", 2, 1, 1, "none", True),
    ("zb", 8, 1, 1, "0.3", True),
    ("1f1b", 4, 2, 2, "none", True),
    ("1f1b", 8, 1, 1, "none", False),
]


def test_token_weighted_steps_equal_whole_batch_training(
    tmp_path: Path, bus: Bus, procs: object
) -> None:
    runs = []
    for schedule, microbatches, replicas, grad_accum, clip, weighted in RUNS:
        spec = write_spec(tmp_path, weighted=weighted, grad_accum=grad_accum)
        run_id = f"{schedule}-m{microbatches}-d{replicas}-{uuid.uuid4().hex[:6]}"
        config = WorkerConfig(
            spec_path=str(spec),
            overrides={
                "stages": "2",
                "schedule": schedule,
                "microbatches": str(microbatches),
                "data_parallel": str(replicas),
                "grad_clip": clip,
            },
            bus=str(bus.address),
            run_id=run_id,
            dump_weights_dir=str(tmp_path / run_id),
        )
        runs.append((2 * replicas, config, spec, clip, weighted))
    proc = start_driver(procs, [(nproc, config) for nproc, config, *_ in runs])
    code, output = finish(proc, timeout=600, bus=bus)
    assert code == 0, output[-4000:]
    for nproc, config, *_ in runs:
        bus.wait_count(StageStopped, nproc, config.run_id)

    for _nproc, config, spec, clip, weighted in runs:
        what = f"{config.overrides} weighted={weighted} {spec.name}"
        whole = write_spec(tmp_path, weighted=True, grad_accum=2 if "_a2" in spec.name else 1)
        ref_losses, ref_norms, ref_weights = whole_batch_training(whole, clip)
        ended = [e for e in bus.of(StepEnded, config.run_id) if e.stage == 1 and e.replica == 0]
        ended.sort(key=lambda e: e.step)
        losses = [e.loss for e in ended]
        norms = [e.grad_norm for e in ended]
        weights: dict[str, torch.Tensor] = {}
        for stage in range(2):
            dump = Path(config.dump_weights_dir or "")
            weights.update(load_file(str(dump / f"stage-{stage}.safetensors")))
        assert sorted(weights) == sorted(ref_weights), what
        if weighted:
            assert losses == pytest.approx(ref_losses, abs=ATOL), what
            assert norms == pytest.approx(ref_norms, rel=1e-4), what
            if clip != "none":
                assert sum(n > float(clip) for n in ref_norms) >= 5, "the clip must bind"
            for name, ref in ref_weights.items():
                torch.testing.assert_close(weights[name], ref, atol=ATOL, rtol=0, msg=what)
        else:
            # The mean of microbatch means is another objective: it drifts away.
            assert losses[0] != pytest.approx(ref_losses[0], abs=1e-4), what
            drift = max((weights[n] - ref).abs().max().item() for n, ref in ref_weights.items())
            assert drift > 1e-3, what


def test_loss_weight_must_be_callable(tmp_path: Path) -> None:
    job = load_job(write_spec(tmp_path, weighted=True, grad_accum=1))
    with pytest.raises(SpecError, match=r"loss_weight.*callable"):
        dataclasses.replace(job, loss_weight=3)
