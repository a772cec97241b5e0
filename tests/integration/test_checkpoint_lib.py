"""Checkpoint library: stage shards (DCP), resharding on load, manifest commit, retention, CLI.

Shards are written by REAL stage processes in a gloo process group (this file
run as a script, see ``__main__``), split 2 and 4 ways, and loaded into 1, 2,
3 and 4 stages. The reference is the same deterministic training run on the
unsplit model: every tensor must be bitwise equal.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from evtrain.checkpoint import (
    LATEST_FILE,
    MANIFEST_FILE,
    SHARD_RECORD_FILE,
    CheckpointCorrupt,
    CheckpointError,
    NotCommitted,
    checkpoint_path_template,
    commit_checkpoint,
    find_resume,
    latest_committed,
    list_checkpoints,
    plan_retention,
    prune,
    read_manifest,
    resolve_resume,
    set_latest,
    shard_records,
    stage_dir,
    step_dir,
    validate_checkpoint,
)
from evtrain.checkpoint.loader import (
    RestrictedUnpickler,
    SafeFileSystemReader,
    agree_on_resume,
    load_stage_shard,
    load_weights,
    read_model_tensors,
)
from evtrain.checkpoint.writer import ShardWriter
from evtrain.data import derive_seed
from evtrain.job import Job, layer
from evtrain.stages.partition import build_full_model, build_stage_module, partition

STEPS = 3
HERE = Path(__file__).resolve()

# dcp.save/load(no_dist=True) always warn that they assume a single process.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# ------------------------------------------------------------------ shared helpers


def make_job() -> Job:
    """7 layers (one with buffers); Adam + StepLR: every kind of state a stage saves."""
    return Job(
        name="ckpt",
        layers=[
            layer(nn.Linear, 8, 16),
            layer(nn.Tanh),
            layer(nn.Linear, 16, 16),
            layer(nn.BatchNorm1d, 16),
            layer(nn.Linear, 16, 16),
            layer(nn.Tanh),
            layer(nn.Linear, 16, 4),
        ],
        loss_fn=nn.functional.mse_loss,
        optimizer=functools.partial(torch.optim.Adam, lr=1e-2),
        lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5),
        train_data=(torch.randn(32, 8), torch.randn(32, 4)),
        batch_size=8,
        max_steps=10,
    )


def build(job: Job, num_stages: int, stage: int) -> tuple[nn.Module, Any, Any]:
    """Stage ``stage`` of a ``num_stages`` split with its optimizer and scheduler."""
    module = build_stage_module(job, partition(job, num_stages)[stage])
    optimizer = job.optimizer(module.parameters())
    return module, optimizer, job.lr_scheduler(optimizer)


def train(module: nn.Module, optimizer: Any, scheduler: Any, steps: int, start: int = 0) -> None:
    """Deterministic synthetic steps: each parameter's gradient depends only on (name, step)."""
    for step in range(start, start + steps):
        for name, p in module.named_parameters():
            gen = torch.Generator().manual_seed(derive_seed(7, name, step))
            p.grad = torch.randn(p.shape, generator=gen)
        for _name, b in module.named_buffers():
            if b.is_floating_point():
                b.add_(0.25 * (step + 1))
            else:
                b.add_(1)
        optimizer.step()
        scheduler.step()


def seed_rngs(stage: int) -> None:
    """Each stage's RNGs in a distinct, reproducible state."""
    torch.manual_seed(100 + stage)
    random.seed(100 + stage)
    np.random.seed(100 + stage)
    torch.rand(stage + 1)
    random.random()
    np.random.rand(stage + 2)


def optimizer_by_name(module: nn.Module, optimizer: Any) -> dict[str, dict[str, Any]]:
    ids = {id(p): n for n, p in module.named_parameters()}
    return {ids[id(p)]: dict(s) for p, s in optimizer.state.items()}


def reference(job: Job, steps: int = STEPS) -> tuple[nn.Module, Any, Any]:
    """The unsplit model trained the same way."""
    full, opt, sched = build(job, 1, 0)
    train(full, opt, sched, steps)
    return full, opt, sched


def assert_stage_equals_reference(
    module: nn.Module, optimizer: Any, scheduler: Any, ref: tuple[nn.Module, Any, Any]
) -> None:
    full, ref_opt, ref_sched = ref
    ref_sd = full.state_dict()
    for key, value in module.state_dict().items():
        assert torch.equal(value, ref_sd[key]), key
    ref_state = optimizer_by_name(full, ref_opt)
    mine = optimizer_by_name(module, optimizer)
    assert set(mine) == {n for n, _ in module.named_parameters()}
    for name, state in mine.items():
        assert state.keys() == ref_state[name].keys(), name
        for k, v in state.items():
            assert torch.equal(v, ref_state[name][k]), (name, k)
    assert optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert scheduler.state_dict() == ref_sched.state_dict()


def save_all_stages(
    run: Path, job: Job, num_stages: int, *, step: int = STEPS, cid: str = "c", **writer: Any
) -> Path:
    """Save every stage of a split in this process (sync writers), return the checkpoint dir."""
    for k in range(num_stages):
        module, opt, sched = build(job, num_stages, k)
        train(module, opt, sched, step)
        w = ShardWriter(k, num_stages, **writer)
        w.save(
            checkpoint_path_template(run),
            checkpoint_id=cid,
            step=step,
            module=module,
            optimizer=opt,
            scheduler=sched,
        )
        done = w.wait(30)
        w.close()
        assert done and done[0].ok, done
    return step_dir(run, step)


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


# --------------------------------------------------- stage processes (gloo groups)


def _stage_process(cfg: dict[str, Any]) -> None:
    """One stage saving its shard inside a real gloo group (run by ``__main__``)."""
    import torch.distributed as dist

    rank, world = cfg["rank"], cfg["world"]
    dist.init_process_group(
        "gloo", init_method=f"file://{cfg['init']}", rank=rank, world_size=world
    )
    job = make_job()
    seed_rngs(rank)
    module, opt, sched = build(job, world, rank)
    train(module, opt, sched, STEPS)
    x = torch.ones(1)
    dist.all_reduce(x)  # the group is live before and after the saves
    writer = ShardWriter(rank, world, write_delay_s=0.3)
    if rank == 0:
        # Only rank 0 saves here: a save that used a collective would hang.
        writer.save(
            cfg["solo"],
            checkpoint_id="solo",
            step=STEPS,
            module=module,
            optimizer=opt,
            scheduler=sched,
        )
        assert writer.wait(30)[0].ok
    blocked = writer.save(
        cfg["template"],
        checkpoint_id=cfg["cid"],
        step=STEPS,
        module=module,
        optimizer=opt,
        scheduler=sched,
        data_position=STEPS,
    )
    # Training goes on while the shard is written: it must not see this.
    assert writer.busy()
    train(module, opt, sched, 2, start=STEPS)  # optimizer.step() fences the copy
    writer.fence()  # before changing parameters in place any other way
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    for state in opt.state.values():
        state["exp_avg"].mul_(3.0)
    done = writer.wait(60)
    writer.close()
    dist.all_reduce(x)
    assert x.item() == world * world
    # The coordinator's part (here: rank 0), then a resume inside the group.
    if rank == 0:
        ckpt = step_dir(cfg["run"], STEPS)
        commit_checkpoint(ckpt, checkpoint_id=cfg["cid"], num_stages=world)
        set_latest(cfg["run"], ckpt)
    dist.barrier()
    path = agree_on_resume(cfg["run"])
    fresh, fopt, fsched = build(job, world, rank)
    state = load_stage_shard(path, rank, fresh, fopt, fsched)
    assert_stage_equals_reference(fresh, fopt, fsched, reference(job))
    try:
        agree_on_resume(str(Path(cfg["run"]) / "missing"))
        raised = ""
    except CheckpointError as exc:
        raised = str(exc)
    result = {
        "ok": [d.ok for d in done],
        "blocked_s": blocked,
        "error": done[0].error,
        "path": str(path),
        "step": state.step,
        "raised": raised,
    }
    Path(cfg["out"]).write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved_runs() -> Iterator[dict[int, Path]]:
    """Checkpoints written by 2 and 4 real stage processes (module-scoped: ~10 s)."""
    base = Path(tempfile.mkdtemp(prefix="evt-ck-", dir="/tmp"))
    started: list[subprocess.Popen[str]] = []
    try:
        outs = []
        for world in (2, 4):
            run = base / f"run{world}"
            run.mkdir()
            init = base / f"init{world}"
            for rank in range(world):
                out = base / f"out{world}-{rank}.json"
                outs.append(out)
                cfg = {
                    "rank": rank,
                    "world": world,
                    "init": str(init),
                    "template": checkpoint_path_template(run),
                    "run": str(run),
                    "cid": f"ck{world}",
                    "solo": str(base / f"solo{world}"),
                    "out": str(out),
                }
                started.append(
                    subprocess.Popen(
                        [sys.executable, str(HERE), "stage", json.dumps(cfg)],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                        start_new_session=True,
                    )
                )
        for proc in started:
            try:
                output, _ = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
            assert proc.returncode == 0, output[-3000:]
        for out in outs:
            result = json.loads(out.read_text())
            assert result["ok"] == [True], result
            # Every rank agreed on the same committed checkpoint and loaded it.
            assert result["path"].endswith("step-00000003") and result["step"] == STEPS
            assert "does not exist" in result["raised"]
        yield {2: base / "run2", 4: base / "run4"}
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("saved_with", [2, 4])
def test_shards_from_gloo_stages_reshard_bitwise(
    saved_runs: dict[int, Path], saved_with: int
) -> None:
    run = saved_runs[saved_with]
    ckpt = step_dir(run, STEPS)
    records = shard_records(ckpt)
    assert sorted(records) == list(range(saved_with))
    assert read_manifest(ckpt).num_stages == saved_with  # committed by rank 0
    assert resolve_resume(run) == ckpt
    # Keys are the unsplit model's: "0.weight" ... and optimizer state by name.
    all_keys = set().union(*(r.model_keys for r in records.values()))
    assert all_keys == set(build_full_model(make_job()).state_dict())
    assert "optim.0.weight.exp_avg" in records[0].tensors

    job = make_job()
    ref = reference(job)
    for num_stages in (1, 2, 3, 4):
        for k in range(num_stages):
            module, opt, sched = build(job, num_stages, k)
            torch.manual_seed(12345)
            state = load_stage_shard(ckpt, k, module, opt, sched)
            assert (state.step, state.data_position) == (STEPS, STEPS)
            assert state.saved_num_stages == saved_with
            assert_stage_equals_reference(module, opt, sched, ref)
            if num_stages == saved_with:
                # The RNG states are this stage's own at the save.
                seed_rngs(k)
                expected = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1])
                seed_rngs(k)  # re-seed, then restore over it from the checkpoint
                torch.manual_seed(999)
                load_stage_shard(ckpt, k, module, opt, sched)
                assert torch.equal(torch.get_rng_state(), expected[0])
                assert random.getstate() == expected[1]
                assert np.array_equal(np.random.get_state()[1], expected[2])
            if num_stages == 3:
                # Training continues exactly as the uninterrupted run would.
                train(module, opt, sched, 2, start=STEPS)
                cont = reference(job, STEPS + 2)
                assert_stage_equals_reference(module, opt, sched, cont)

    # The full model (the export path) gets every tensor too.
    full = build_full_model(job)
    load_weights(ckpt, full)
    for key, value in full.state_dict().items():
        assert torch.equal(value, ref[0].state_dict()[key]), key


def test_solo_save_needs_no_collective(saved_runs: dict[int, Path]) -> None:
    # Rank 0 saved alone while its peers sat in the group: only stage-0 exists.
    solo = saved_runs[2].parent / "solo2"
    assert sorted(shard_records(solo)) == [0]


@pytest.mark.parametrize("overlap", [True, False])
def test_async_save_captures_the_requested_step(tmp: Path, overlap: bool) -> None:
    job = make_job()
    module, opt, sched = build(job, 1, 0)  # every layer: parameters and BatchNorm buffers
    train(module, opt, sched, STEPS)
    expected = {k: v.clone() for k, v in module.state_dict().items()}
    exp_avg = {n: s["exp_avg"].clone() for n, s in optimizer_by_name(module, opt).items()}
    lr = opt.param_groups[0]["lr"]
    writer = ShardWriter(0, 1, write_delay_s=0.3, overlap_copy=overlap)
    writer._copy_delay_s = 0.4  # the parameter copy (overlapped) lags behind training
    blocked = writer.save(
        checkpoint_path_template(tmp),
        checkpoint_id="a",
        step=STEPS,
        module=module,
        optimizer=opt,
        scheduler=sched,
    )
    assert writer.busy() and writer.poll() == []
    # Training continues at once: buffers change in place (as forward does), then
    # the optimizer steps (its pre-hook fences until the parameters are copied).
    train(module, opt, sched, 2, start=STEPS)
    if not overlap:
        with torch.no_grad():  # without overlap nothing needs a fence
            for p in module.parameters():
                p.mul_(-2.0).add_(1.0)
            for s in opt.state.values():
                s["exp_avg"].add_(5.0)
    done = writer.wait(30)
    writer.close()
    assert len(done) == 1 and done[0].ok, done
    if overlap:
        assert done[0].blocked_s >= 0.3 > blocked  # the fence waited at optimizer.step()
    else:
        assert done[0].blocked_s == blocked
    assert done[0].blocked_s < done[0].duration_s
    assert done[0].bytes > 0 and done[0].step == STEPS
    assert done[0].to_event().topic == b"checkpoint.shard_saved"

    ckpt = step_dir(tmp, STEPS)
    commit_checkpoint(ckpt, checkpoint_id="a", num_stages=1)
    fresh, fopt, fsched = build(job, 2, 1)  # and load into another split, for good measure
    load_stage_shard(ckpt, 1, fresh, fopt, fsched)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k]), k
    for n, s in optimizer_by_name(fresh, fopt).items():
        assert torch.equal(s["exp_avg"], exp_avg[n]), n
        assert s["step"].item() == STEPS
    assert fopt.param_groups[0]["lr"] == lr


def test_sync_writer_blocks_for_the_whole_write(tmp: Path) -> None:
    module, opt, sched = build(make_job(), 1, 0)
    train(module, opt, sched, 1)
    writer = ShardWriter(0, 1, asynchronous=False)
    blocked = writer.save(
        checkpoint_path_template(tmp),
        checkpoint_id="s",
        step=1,
        module=module,
        optimizer=opt,
        scheduler=sched,
    )
    done = writer.poll()
    assert done[0].ok and (shard_records(step_dir(tmp, 1))[0].blocked_s > 0)
    assert done[0].blocked_s == pytest.approx(done[0].duration_s) and blocked > 0


def _committed(tmp: Path, num_stages: int = 2) -> Path:
    ckpt = save_all_stages(tmp, make_job(), num_stages)
    commit_checkpoint(ckpt, checkpoint_id="c", num_stages=num_stages)
    return ckpt


@pytest.mark.parametrize(
    ("target", "damage"),
    [
        ("__0_0.distcp", "flip"),
        ("__0_0.distcp", "truncate"),
        (".metadata", "flip"),
        ("state.json", "truncate"),
        (".metadata", "delete"),
        (SHARD_RECORD_FILE, "flip"),
    ],
)
def test_corrupted_shard_is_named(tmp: Path, target: str, damage: str) -> None:
    ckpt = _committed(tmp)
    path = stage_dir(ckpt, 1) / target
    data = path.read_bytes()
    if damage == "flip":
        i = len(data) // 2
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x55]) + data[i + 1 :])
    elif damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.unlink()
    module, opt, sched = build(make_job(), 1, 0)
    with pytest.raises(CheckpointCorrupt) as err:
        load_stage_shard(ckpt, 0, module, opt, sched)
    assert str(path) in str(err.value)
    with pytest.raises(CheckpointCorrupt) as err:
        validate_checkpoint(ckpt)
    assert str(path) in str(err.value)
    # The CLI says the same in one line, exit status 2.
    proc = subprocess.run(
        [sys.executable, "-m", "evtrain", "ckpt", "verify", str(ckpt)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and str(path) in proc.stderr


class _Evil:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("touch /tmp/evt-pwned-by-checkpoint",))


def test_metadata_is_never_unpickled_freely(tmp: Path) -> None:
    import io

    marker = Path("/tmp/evt-pwned-by-checkpoint")
    marker.unlink(missing_ok=True)
    with pytest.raises(pickle.UnpicklingError, match="forbidden global"):
        RestrictedUnpickler(io.BytesIO(pickle.dumps(_Evil()))).load()
    # DCP's own metadata round-trips through the restricted reader...
    ckpt = _committed(tmp)
    sdir = stage_dir(ckpt, 0)
    metadata = SafeFileSystemReader(sdir).read_metadata()
    assert "0.weight" in metadata.state_dict_metadata
    # ...and a hostile .metadata is refused without running anything.
    (sdir / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointCorrupt, match="forbidden global"):
        SafeFileSystemReader(sdir).read_metadata()
    assert not marker.exists()


def test_uncommitted_is_never_latest_or_resumed(tmp: Path) -> None:
    job = make_job()
    first = save_all_stages(tmp, job, 2, step=2, cid="first")
    commit_checkpoint(first, checkpoint_id="first", num_stages=2)
    set_latest(tmp, first)
    # A crash between the shard writes and the commit: shards, no manifest.
    second = save_all_stages(tmp, job, 2, step=4, cid="second")
    # A crash while writing the manifest leaves only its temp file.
    (second / f".{MANIFEST_FILE}.tmp-99").write_text("{")
    infos = list_checkpoints(tmp)
    assert [(i.step, i.committed) for i in infos] == [(2, True), (4, False)]
    assert latest_committed(tmp).path == first  # type: ignore[union-attr]
    assert resolve_resume(tmp) == first
    assert resolve_resume(tmp / "checkpoints") == first
    assert resolve_resume(tmp / "checkpoints" / LATEST_FILE) == first
    with pytest.raises(NotCommitted, match="not committed"):
        resolve_resume(second)
    with pytest.raises(NotCommitted):
        load_stage_shard(second, 0, build(job, 2, 0)[0])
    # `latest` pointing at an uncommitted directory is ignored.
    (tmp / "checkpoints" / LATEST_FILE).write_text("step-00000004\n")
    assert resolve_resume(tmp) == first
    with pytest.raises(CheckpointError):
        set_latest(tmp, second)
    # Only complete shard sets commit: one stage missing -> refused, nothing written.
    shutil.rmtree(stage_dir(second, 1))
    with pytest.raises(CheckpointCorrupt, match="stage-1"):
        commit_checkpoint(second, checkpoint_id="second", num_stages=2)
    assert not (second / MANIFEST_FILE).exists()
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_resume(tmp / "nope")


def test_a_corrupt_committed_manifest_is_reported_never_skipped_silently(tmp: Path) -> None:
    from helpers.launch_helpers import write_spec

    from evtrain.launcher import Launcher, LaunchOptions

    job = make_job()
    first = save_all_stages(tmp, job, 2, step=2, cid="first")
    commit_checkpoint(first, checkpoint_id="first", num_stages=2)
    second = save_all_stages(tmp, job, 2, step=4, cid="second")
    commit_checkpoint(second, checkpoint_id="second", num_stages=2)
    set_latest(tmp, second)
    (second / MANIFEST_FILE).write_text('{"checkpoint_id": "second", "step": ')  # torn

    infos = list_checkpoints(tmp)
    assert [(i.step, i.committed, i.corrupt is not None) for i in infos] == [
        (2, True, False),
        (4, False, True),
    ]
    choice = find_resume(tmp)
    assert choice.path == first and [i.path for i in choice.skipped] == [second]
    (warning,) = choice.warnings()
    assert str(second / MANIFEST_FILE) in warning and first.name in warning
    assert resolve_resume(tmp) == first  # falls back, with that warning logged

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "evtrain", "ckpt", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    listing = cli("list", str(tmp))
    assert listing.returncode == 0, listing.stderr
    row4 = next(line for line in listing.stdout.splitlines() if line.split()[0] == "4")
    assert " CORRUPT " in row4
    assert str(second / MANIFEST_FILE) in listing.stderr
    as_json = [json.loads(line) for line in cli("list", str(tmp), "--json").stdout.splitlines()]
    assert [bool(r["corrupt"]) for r in as_json] == [False, True]
    verify = cli("verify", str(tmp))
    assert verify.returncode == 2 and "not ok" in verify.stderr, verify.stdout + verify.stderr
    assert str(second / MANIFEST_FILE) in verify.stderr and "ok:" not in verify.stdout
    assert cli("verify", str(first)).returncode == 0
    assert cli("verify", str(second)).returncode == 2

    # The launcher resolves the same before anything starts, and says so.
    spec = write_spec(tmp, run_dir=str(tmp))
    launcher = Launcher(LaunchOptions(spec=str(spec), resume="latest"))
    launcher.prepare()
    assert launcher.resume_path == first
    assert launcher.warnings == [warning]


def test_killed_writer_leaves_no_committable_shard(tmp: Path, procs: Any) -> None:
    proc = procs.python(str(HERE), "slow-writer", json.dumps({"run": str(tmp)}))
    sdir = stage_dir(step_dir(tmp, STEPS), 0)
    deadline = time.monotonic() + 60
    while not (sdir / "state.json").exists() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.kill()  # kill -9 with the data written but the shard not yet recorded
    proc.wait(10)
    assert (sdir / "__0_0.distcp").exists()
    assert not (sdir / SHARD_RECORD_FILE).exists()
    assert shard_records(step_dir(tmp, STEPS)) == {}
    with pytest.raises(CheckpointCorrupt, match=SHARD_RECORD_FILE):
        commit_checkpoint(step_dir(tmp, STEPS), checkpoint_id="c", num_stages=1)
    assert latest_committed(tmp) is None
    assert [(i.step, i.committed) for i in list_checkpoints(tmp)] == [(STEPS, False)]


def _slow_writer(cfg: dict[str, Any]) -> None:
    job = make_job()
    module, opt, sched = build(job, 1, 0)
    train(module, opt, sched, STEPS)
    writer = ShardWriter(0, 1, record_delay_s=60.0)
    writer.save(
        checkpoint_path_template(cfg["run"]),
        checkpoint_id="c",
        step=STEPS,
        module=module,
        optimizer=opt,
        scheduler=sched,
    )
    writer.wait()


def test_retention_keeps_last_k_and_best(tmp: Path) -> None:
    job = make_job()
    metrics = {1: 0.9, 2: 0.1, 3: 0.5, 4: 0.4, 5: 0.3, 6: 0.35}
    for step, metric in metrics.items():
        ckpt = save_all_stages(tmp, job, 1, step=step, cid=f"s{step}", asynchronous=False)
        commit_checkpoint(
            ckpt,
            checkpoint_id=f"s{step}",
            num_stages=1,
            metric_name="loss",
            metric=metric,
            metric_mode="min",
        )
        set_latest(tmp, ckpt)
        time.sleep(0.01)  # distinct commit times
    # An abandoned uncommitted one (older than the latest) and one in progress.
    abandoned = save_all_stages(tmp, job, 1, step=0, cid="old", asynchronous=False)
    os.utime(abandoned / "stage-0" / SHARD_RECORD_FILE, (1, 1))
    for f in (abandoned / "stage-0").iterdir():
        os.utime(f, (1, 1))
    in_progress = step_dir(tmp, 7)
    stage_dir(in_progress, 0).mkdir(parents=True)

    infos = list_checkpoints(tmp)
    plan = plan_retention(
        infos,
        keep_last=2,
        keep_best=True,
        metric_name="loss",
        mode="min",
        in_progress=[in_progress],
    )
    assert sorted(i.step for i in plan) == [0, 1, 3, 4]
    deleted = prune(
        tmp, keep_last=2, keep_best=True, metric_name="loss", mode="min", in_progress=[in_progress]
    )
    assert sorted(p.name for p in deleted) == [
        "step-00000000",
        "step-00000001",
        "step-00000003",
        "step-00000004",
    ]
    left = [(i.step, i.committed) for i in list_checkpoints(tmp)]
    assert left == [(2, True), (5, True), (6, True), (7, False)]
    # max mode keeps the highest metric instead.
    plan = plan_retention(
        list_checkpoints(tmp), keep_last=1, keep_best=True, metric_name="loss", mode="max"
    )
    assert sorted(i.step for i in plan) == [2, 5]
    # The latest (and only) committed checkpoint is never deleted.
    prune(tmp, keep_last=1, keep_best=False)
    assert [(i.step, i.committed) for i in list_checkpoints(tmp)] == [(6, True), (7, False)]
    prune(tmp, keep_last=1, keep_best=False)
    assert latest_committed(tmp).step == 6  # type: ignore[union-attr]


def test_cli_list_and_export(tmp: Path) -> None:
    job = make_job()
    ckpt = save_all_stages(tmp, job, 3)
    manifest = commit_checkpoint(
        ckpt, checkpoint_id="c", num_stages=3, metric_name="loss", metric=0.25, metric_mode="min"
    )
    set_latest(tmp, ckpt)
    save_all_stages(tmp, job, 3, step=5, cid="unfinished")
    assert manifest.step == STEPS

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "evtrain", "ckpt", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    listing = cli("list", str(tmp))
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert lines[0].split()[:6] == ["STEP", "TIME", "SIZE", "METRIC", "COMMITTED", "SHARDS"]
    row3 = next(line for line in lines if line.split()[:2] == ["*", "3"])
    assert "loss=0.25" in row3 and " yes " in row3 and "3/3" in row3
    row5 = next(line for line in lines if line.split()[0] == "5")
    assert " no " in row5
    as_json = [json.loads(line) for line in cli("list", str(tmp), "--json").stdout.splitlines()]
    assert [(r["step"], r["committed"], r["latest"]) for r in as_json] == [
        (3, True, True),
        (5, False, False),
    ]

    out = tmp / "model.safetensors"
    export = cli("export", str(tmp), "-o", str(out))
    assert export.returncode == 0, export.stderr
    from safetensors.torch import load_file

    full = build_full_model(job)
    full.load_state_dict(load_file(str(out)))  # strict: every key, nothing else
    ref = reference(job)[0].state_dict()
    for key, value in full.state_dict().items():
        assert torch.equal(value, ref[key]), key
    # Weights-only loading accepts the exported file too.
    stage = build_stage_module(job, partition(job, 2)[1])
    load_weights(out, stage)
    assert torch.equal(stage.state_dict()["6.weight"], ref["6.weight"])
    assert read_model_tensors(ckpt, ["6.bias"])["6.bias"].equal(ref["6.bias"])

    bad = cli("export", str(step_dir(tmp, 5)), "-o", str(tmp / "x.safetensors"))
    assert bad.returncode == 2 and "not committed" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    missing = cli("list", str(tmp / "missing"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    nodir = cli("export", str(tmp), "-o", str(tmp / "no" / "x.safetensors"))
    assert nodir.returncode == 2 and "does not exist" in nodir.stderr
    assert read_manifest(ckpt).metric == 0.25


def test_the_package_and_its_storage_layer_import_without_torch() -> None:
    # A fresh interpreter: this one has torch loaded already.
    code = (
        "import sys\n"
        "import evtrain.checkpoint as pkg\n"
        "from evtrain.checkpoint import storage\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert sorted(pkg.__all__) == sorted(storage.__all__)\n"
        "assert all(getattr(pkg, n) is getattr(storage, n) for n in storage.__all__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


if __name__ == "__main__":
    _mode, _cfg = sys.argv[1], json.loads(sys.argv[2])
    {
        "stage": _stage_process,
        "slow-writer": _slow_writer,
    }[_mode](_cfg)


class _RootBuffered(nn.Module):
    """Units l0..l4 and a persistent buffer on the root, which every stage keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(4.0))
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) + self.table
        return x


def test_rng_comes_from_the_shard_of_the_first_unit_despite_shared_root_buffers(
    tmp: Path,
) -> None:
    job = Job(
        name="root",
        model=_RootBuffered,
        loss_fn=nn.functional.mse_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        train_data=(torch.randn(8, 4), torch.randn(8, 4)),
        batch_size=4,
        max_steps=1,
        stages=3,
        split_points=["blocks.1", "blocks.4"],
    )
    ranges = partition(job)
    for k, units in enumerate(ranges):
        module = build_stage_module(job, units)
        seed_rngs(k)
        w = ShardWriter(k, 3, asynchronous=False)
        w.save(checkpoint_path_template(tmp), checkpoint_id="r", step=1, module=module)
        assert w.wait(30)[0].ok
        w.close()
    commit_checkpoint(step_dir(tmp, 1), checkpoint_id="r", num_stages=3)
    # At 5 stages, stage 3 holds blocks.3: saved by stage 1, whose RNG it takes,
    # although "table" (its first state_dict key) is in every shard.
    five = partition(job, 5, balance=[1, 1, 1, 1, 1])
    module = build_stage_module(job.with_overrides(stages=5, split_points=None), five[3])
    state = load_stage_shard(step_dir(tmp, 1), 3, module)
    assert state.rng_restored_from == 1
