"""The examples: every spec loads and trains; the loss-spike guard stops a run over a real bus."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from helpers.launch_helpers import kill_marked, launch_env, new_marker, wait_no_marked

from evtrain.bus.address import BusAddress
from evtrain.bus.broker import Broker
from evtrain.bus.commands import CommandReceiver
from evtrain.bus.publisher import Publisher
from evtrain.data import microbatches
from evtrain.errors import UsageError
from evtrain.events import CommandAcked, StopRun
from evtrain.hooks.registry import build_hook, build_hook_from_spec
from evtrain.job import Job
from evtrain.spec import load_job
from evtrain.stages.job_data import job_data
from evtrain.stages.partition import build_full_model, partition

if TYPE_CHECKING:
    from conftest import ProcessGroup

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SPECS = ["mlp.py", "demo.py", "transformer.py"]


def train_steps(job: Job, steps: int) -> list[float]:
    """Train ``steps`` steps in one process the way the pipeline does; the step losses."""
    torch.set_num_threads(1)
    model = build_full_model(job)
    optimizer = job.optimizer(model.parameters())
    inputs, targets = job_data(job).train_tensors()
    stream = job_data(job).train_stream()
    m = job.num_microbatches
    losses = []
    for step in range(steps):
        indices = stream.indices(step)
        optimizer.zero_grad()
        total = 0.0
        xs, ys = microbatches(inputs, indices, m), microbatches(targets, indices, m)
        for x, y in zip(xs, ys, strict=True):
            loss = job.loss_fn(model(x), y) / m
            loss.backward()
            total += loss.detach().item()
        optimizer.step()
        losses.append(total)
    return losses


@pytest.mark.parametrize("name", SPECS)
def test_example_spec_loads_validates_and_trains(name: str) -> None:
    job = load_job(EXAMPLES / name)
    job.validate()
    assert len(partition(job)) == job.stages
    for hook in job.hooks:
        build_hook_from_spec(hook)  # type: ignore[arg-type]
    losses = train_steps(job, 3)
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0]


def test_transformer_is_embedding_blocks_head_on_four_stages() -> None:
    job = load_job(EXAMPLES / "transformer.py")
    assert job.stages == 4
    model = build_full_model(job)
    kinds = [type(layer).__name__ for layer in model]
    assert kinds == ["Embedding", "Block", "Block", "Block", "Block", "Head"]
    ranges = partition(job)
    assert [kinds[r.start : r.stop] for r in ranges] == [
        ["Embedding", "Block"],
        ["Block"],
        ["Block"],
        ["Block", "Head"],
    ]
    inputs, targets = job_data(job).train_tensors()
    assert inputs.dtype == torch.int64 and inputs.shape[1:] == targets.shape[1:]
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next characters
    logits = model(inputs[:2])
    vocab = job.layers[-1].args[1]  # type: ignore[attr-defined]  # layer(Head, DIM, VOCAB)
    assert logits.shape == (2, inputs.shape[1], vocab)
    # Causal: changing a later character leaves earlier predictions alone.
    changed = inputs[:1].clone()
    changed[0, -1] = (changed[0, -1] + 1) % logits.shape[-1]
    model.eval()
    with torch.no_grad():
        before, after = model(inputs[:1]), model(changed)
    assert torch.allclose(before[0, :-1], after[0, :-1], atol=1e-5)
    assert not torch.allclose(before[0, -1], after[0, -1])


@pytest.mark.slow
def test_transformer_trains_through_four_stage_launch(tmp_path: Path) -> None:
    marker = new_marker()
    cmd = [
        sys.executable,
        "-m",
        "evtrain",
        "launch",
        str(EXAMPLES / "transformer.py"),
        "--steps",
        "2",
        "--eval-every",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        "--no-hooks",
        "--quiet",
    ]
    try:
        done = subprocess.run(
            cmd,
            env=launch_env(marker),
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
        )
    finally:
        left = wait_no_marked(marker, timeout=5.0)
        kill_marked(marker)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not left
    assert "run completed: 2/2 steps" in done.stdout
    assert "last eval (step 2)" in done.stdout


# ------------------------------------------------------------- loss-spike guard


def test_spike_detector() -> None:
    sys.path.insert(0, str(REPO))
    try:
        from examples.loss_spike_guard import SpikeDetector
    finally:
        sys.path.remove(str(REPO))

    detector = SpikeDetector(factor=3.0, window=4, warmup=3)
    # Warm-up: a falling loss is never a spike, however steep.
    assert not any(detector.check(x) for x in (10.0, 2.0, 1.0))
    assert not any(detector.check(x) for x in (1.0, 1.1, 0.9, 2.5))
    assert detector.mean == pytest.approx((1.1 + 0.9 + 2.5 + 1.0) / 4)
    assert detector.check(100.0)
    assert detector.mean == pytest.approx((1.1 + 0.9 + 2.5 + 1.0) / 4)  # spikes stay out
    assert detector.check(float("nan")) and detector.check(float("inf"))
    with pytest.raises(ValueError, match="factor"):
        SpikeDetector(factor=1.0)


GUARD = "examples.loss_spike_guard:LossSpikeGuard"

PUBLISHER = """
import sys, time
from evtrain.bus.publisher import Publisher
from evtrain.events import RunStarted, StepEnded

losses = [float(x) for x in sys.argv[2].split(",")]
with Publisher(sys.argv[1], source="stage/0") as pub:
    pub.publish(RunStarted(name="spiky", num_stages=1, num_microbatches=1, schedule="1f1b",
                           max_steps=len(losses), batch_size=1))
    for step, loss in enumerate(losses, start=1):
        pub.publish(StepEnded(step=step, stage=0, loss=loss))
        time.sleep(0.01)
"""


def start_hook_attached(
    procs: ProcessGroup, bus: BusAddress, *options: str
) -> tuple[subprocess.Popen[str], list[str]]:
    """``evtrain hook GUARD ...`` run from the repository root, once it logged that it attached."""
    args = ["hook", GUARD, "--bus", str(bus)]
    for option in options:
        args += ["-o", option]
    # The installed `evtrain` script, as the example's docstring runs it (it does
    # not put the working directory on sys.path the way `python -m` does).
    script = Path(sys.executable).with_name("evtrain")
    assert script.exists(), f"no evtrain console script next to {sys.executable}"
    proc = procs.start(str(script), *args, cwd=str(REPO))
    lines: list[str] = []
    attached = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "hooks attached" in line:
                attached.set()

    threading.Thread(target=pump, daemon=True).start()
    if not attached.wait(30):
        proc.kill()
        pytest.fail("the guard did not attach:\n" + "".join(lines))
    return proc, lines


def test_guard_stops_the_run_on_a_spike(ipc_bus: BusAddress, procs: ProcessGroup) -> None:
    steady = [2.0 / (1 + 0.1 * i) + 0.05 * (i % 3) for i in range(30)]  # falling, noisy
    losses = [*steady, 9.0, 1.0, 1.0]  # the spike is step 31
    with Broker(ipc_bus):
        receiver = CommandReceiver(ipc_bus.endpoint("commands_out"))
        try:
            guard, lines = start_hook_attached(procs, ipc_bus, "factor=3", "window=10", "warmup=5")
            publisher = procs.python(
                "-c",
                PUBLISHER,
                ipc_bus.endpoint("events_in"),
                ",".join(map(str, losses)),
            )
            stop: StopRun | None = None
            deadline = time.monotonic() + 120  # a hook process starting on a loaded machine
            while stop is None and time.monotonic() < deadline:
                stop = next((c for c in receiver.poll() if isinstance(c, StopRun)), None)
                time.sleep(0.05)
            assert stop is not None, "no StopRun arrived:\n" + "".join(lines)
            assert "loss spike at step 31" in stop.reason
            assert "9 > 3 x running mean" in stop.reason
            assert publisher.wait(timeout=30) == 0

            # Acknowledge as the one stage would; the guard then logs it and goes quiet.
            with Publisher(ipc_bus.endpoint("events_in"), source="stage/0") as stage:
                stage.publish(
                    CommandAcked(command_id=stop.command_id, command="cmd.stop", stage=0, step=31)
                )
                deadline = time.monotonic() + 60
                while not any("stop acknowledged" in line for line in lines):
                    assert time.monotonic() < deadline, "".join(lines)
                    time.sleep(0.05)
            assert guard.poll() is None  # a hook keeps running until the run ends
        finally:
            receiver.close()


def test_guard_options_are_checked() -> None:
    sys.path.insert(0, str(REPO))
    try:
        hook = build_hook(GUARD, {"factor": 4, "window": 5})
        assert hook.detector.factor == 4.0  # type: ignore[attr-defined]
        with pytest.raises(UsageError, match="factor must be > 1"):
            build_hook(GUARD, {"factor": 0.5})
    finally:
        sys.path.remove(str(REPO))
