"""The checkpoint coordinator hook against a real broker and real stage processes.

The stages are this file run as a script (``__main__``): two processes in a
gloo group that train a small split model with synthetic gradients, receive
commands with `CommandReceiver` (agreeing through an all-reduce which commands
to apply at each step boundary, as the real actor does), save REAL shards with
`ShardWriter`, acknowledge, and publish ``checkpoint.shard_saved`` from
`ShardWriter.poll` — the contract the stage actor implements.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from evtrain.bus.address import BusAddress
from evtrain.bus.publisher import Publisher
from evtrain.bus.subscriber import Subscriber
from evtrain.checkpoint import (
    MANIFEST_FILE,
    SHARD_RECORD_FILE,
    latest_committed,
    list_checkpoints,
    read_manifest,
    stage_dir,
)
from evtrain.events import (
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointRequested,
    CheckpointShardSaved,
    Message,
    RunEnded,
    RunStarted,
    StopRun,
)
from evtrain.hooks.checkpoint import COORDINATOR_FILE, CheckpointHook
from evtrain.hooks.hook import Hook
from evtrain.hooks.loader import build_hook
from evtrain.hooks.runner import HookRunner

HERE = Path(__file__).resolve()
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# ------------------------------------------------------------------------ fixtures


@pytest.fixture
def run_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="evt-ckh-", dir="/tmp"))
    yield path
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def start_stages(procs: Any, bus: BusAddress, run_dir: Path, **options: Any) -> list[Any]:
    """The two fake stage processes (killed by the ``procs`` fixture at teardown)."""
    init = run_dir / f"init-{uuid.uuid4().hex[:6]}"
    started = []
    for stage in range(2):
        cfg = {
            "bus": str(bus),
            "run_dir": str(run_dir),
            "stage": stage,
            "world": 2,
            "init": str(init),
            **options,
        }
        started.append(procs.python(str(HERE), json.dumps(cfg)))
    return started


def wait_stages(stages: list[Any], timeout: float = 60.0) -> list[dict[str, Any]]:
    """Wait for the stage processes; their last stdout line is a JSON summary."""
    out = []
    for proc in stages:
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, stderr[-4000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


class Recorder:
    """Every checkpoint event on the bus, read by its own subscriber (not a hook: a hook
    in the coordinator's runner stops at run.ended, before the last commit comes back)."""

    def __init__(self, bus: BusAddress) -> None:
        self.events: list[Message] = []
        self._sub = Subscriber(bus.endpoint("events_out"), ["checkpoint."])

    async def read(self, stop: anyio.Event) -> None:
        while not stop.is_set():
            self.events.extend(await self._sub.receive(timeout=0.2))
        self.events.extend(await self._sub.receive(timeout=1.0))
        self._sub.close()

    def of(self, kind: type[Message]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


async def run_with_stages(
    hook: Hook,
    bus: BusAddress,
    procs: Any,
    run_dir: Path,
    timeout: float = 90.0,
    **stage_options: Any,
) -> tuple[Recorder, list[dict[str, Any]]]:
    """Run ``hook`` in this process against the two fake stages until the run ends."""
    runner = HookRunner([hook], bus, exit_on_run_end=True)
    recorder = Recorder(bus)
    stop = anyio.Event()
    with anyio.fail_after(timeout):
        async with anyio.create_task_group() as outer:
            outer.start_soon(recorder.read, stop)
            async with anyio.create_task_group() as tg:
                tg.start_soon(runner.run)
                await runner.ready.wait()
                stages = start_stages(procs, bus, run_dir, **stage_options)
                summaries = await anyio.to_thread.run_sync(wait_stages, stages, timeout)
                # Leaving this group waits for the runner: it ends after run.ended,
                # once the coordinator committed what was pending.
            stop.set()
    return recorder, summaries


def final_weights_equal(ckpt: Path, dumps: list[str]) -> None:
    """The checkpoint holds exactly the weights the stages ended with."""
    from evtrain.checkpoint.loader import read_model_tensors

    tensors = read_model_tensors(ckpt)
    expected: dict[str, torch.Tensor] = {}
    for path in dumps:
        expected.update(torch.load(path, weights_only=True))
    assert set(tensors) == set(expected)
    for key, value in expected.items():
        assert torch.equal(tensors[key], value), key


# ----------------------------------------------------------------------------- tests


def test_options_are_validated() -> None:
    hook = build_hook("checkpoint", {"every_steps": "5", "mode": "MAX", "keep_last": 2})
    assert isinstance(hook, CheckpointHook)
    assert (hook.every_steps, hook.mode, hook.keep_last) == (5, "max", 2)
    from evtrain.errors import UsageError

    for bad in (
        {"every_steps": 0},
        {"mode": "up"},
        {"keep_last": -1},
        {"every_seconds": 0},
        {"on_stop": "maybe"},
        {"nope": 1},
    ):
        with pytest.raises(UsageError):
            build_hook("checkpoint", bad)


@pytest.mark.anyio
async def test_hook_commits_periodic_best_and_on_stop(
    bus: BusAddress, procs: Any, run_dir: Path
) -> None:
    hook = CheckpointHook(
        every_steps=5, best_metric="loss", mode="min", on_stop=True, keep_last=2, timeout=30
    )
    recorder, summaries = await run_with_stages(
        hook,
        bus,
        procs,
        run_dir,
        steps=16,
        step_s=0.06,
        eval_every=4,
        eval_losses=[0.5, 0.2, 0.4, 0.3],
    )
    assert recorder.of(CheckpointFailed) == []
    commits = recorder.of(CheckpointCommitted)
    reasons = [c.reason for c in commits]
    assert any("every 5 steps" in r for r in reasons), reasons
    assert any("best loss" in r for r in reasons), reasons
    assert commits[-1].reason == "on_stop" and commits[-1].step == 16
    for commit in commits:
        shards = [
            e for e in recorder.of(CheckpointShardSaved) if e.checkpoint_id == commit.checkpoint_id
        ]
        assert sorted(e.stage for e in shards) == [0, 1]  # every stage reported
        assert all(e.path == commit.path for e in shards)
    requested = {e.checkpoint_id: e for e in recorder.of(CheckpointRequested)}
    for commit in commits[:-1]:
        assert requested[commit.checkpoint_id].step == commit.step
    best = [c for c in commits if c.metric is not None]
    assert [c.metric for c in best][:2] == [0.5, 0.2]

    # Retention: the last 2 committed plus the best (loss 0.2); the rest deleted.
    committed = [i for i in list_checkpoints(run_dir) if i.committed]
    kept_steps = sorted(i.step for i in committed)
    best_step = next(c.step for c in commits if c.metric == 0.2)
    assert best_step in kept_steps
    last_two = sorted(c.step for c in commits)[-2:]
    assert set(last_two) <= set(kept_steps)
    assert len(kept_steps) <= 3
    latest = latest_committed(run_dir)
    assert latest is not None and latest.step == 16
    assert read_manifest(latest.path).reason == "on_stop"
    final_weights_equal(latest.path, [s["dump"] for s in summaries])
    state = json.loads((run_dir / "checkpoints" / COORDINATOR_FILE).read_text())
    assert state["pending"] == []


@pytest.mark.anyio
async def test_failed_or_timed_out_checkpoints_are_never_committed(
    bus: BusAddress, procs: Any, run_dir: Path
) -> None:
    hook = CheckpointHook(every_steps=3, keep_last=5, timeout=1.5)
    # Stage 1 fails the 1st request, ignores the 2nd, saves the rest.
    recorder, _ = await run_with_stages(
        hook,
        bus,
        procs,
        run_dir,
        steps=40,
        step_s=0.06,
        stage1_behaviour=["fail", "silent"],
    )
    failed = recorder.of(CheckpointFailed)
    by_stage = [f for f in failed if f.stage == 1]
    by_hook = [f for f in failed if f.stage is None]
    assert by_stage and "disk on fire" in by_stage[0].error
    assert by_hook and "timed out" in by_hook[0].error
    bad_ids = {by_stage[0].checkpoint_id, by_hook[0].checkpoint_id}
    commits = recorder.of(CheckpointCommitted)
    assert commits and not bad_ids & {c.checkpoint_id for c in commits}
    for info in list_checkpoints(run_dir):
        if info.checkpoint_id in bad_ids:
            assert not info.committed
    # The abandoned shards (older than the latest commit) were pruned.
    latest = latest_committed(run_dir)
    assert latest is not None
    assert all(i.committed for i in list_checkpoints(run_dir) if i.step < latest.step)


@pytest.mark.anyio
async def test_killed_hook_recovers_pending_checkpoint_from_disk(
    bus: BusAddress, procs: Any, run_dir: Path
) -> None:
    events = Subscriber(bus.endpoint("events_out"), ["checkpoint.", "run.ended"])
    hook_args = [
        "hook",
        "checkpoint",
        "--bus",
        str(bus),
        "-o",
        f"run_dir={run_dir}",
        "--exit-on-run-end",
    ]
    try:
        first = procs.evtrain(*hook_args, "-o", "every_steps=3")
        await anyio.sleep(0.5)
        stages = start_stages(procs, bus, run_dir, steps=10_000, step_s=0.05, write_delay_s=2.5)
        requested: CheckpointRequested | None = None
        with anyio.fail_after(60):
            while requested is None:
                for msg in await events.receive(timeout=1.0):
                    if isinstance(msg, CheckpointRequested):
                        requested = msg
                assert first.poll() is None, first.communicate()[1][-3000:]
        first.kill()  # kill -9 while the stages are still writing
        first.wait(10)
        ckpt = Path(requested.path)
        assert not (ckpt / MANIFEST_FILE).exists()
        # The stages finish their shards; nobody is there to hear about it.
        with anyio.fail_after(60):
            while not all((stage_dir(ckpt, k) / SHARD_RECORD_FILE).exists() for k in (0, 1)):
                await anyio.sleep(0.1)
        await anyio.sleep(0.3)
        assert not (ckpt / MANIFEST_FILE).exists()
        pending = json.loads((run_dir / "checkpoints" / COORDINATOR_FILE).read_text())
        assert [p["checkpoint_id"] for p in pending["pending"]] == [requested.checkpoint_id]

        # A new hook process recovers from disk and commits it.
        second = procs.evtrain(*hook_args, "-o", "every_steps=100000")
        committed: CheckpointCommitted | None = None
        with anyio.fail_after(60):
            while committed is None:
                for msg in await events.receive(timeout=1.0):
                    if isinstance(msg, CheckpointCommitted):
                        committed = msg
                assert second.poll() is None, second.communicate()[1][-3000:]
        assert committed.checkpoint_id == requested.checkpoint_id
        assert committed.source.startswith("hook/")
        assert read_manifest(ckpt).checkpoint_id == requested.checkpoint_id
        assert latest_committed(run_dir).path == ckpt  # type: ignore[union-attr]

        # End the run: the stages stop, the hook exits on run.ended.
        with Publisher(bus.endpoint("commands_in"), source="test") as commands:
            stop = StopRun(command_id=uuid.uuid4().hex, reason="test over")
            ended = False
            with anyio.fail_after(60):
                while not ended:
                    commands.publish(stop)
                    for msg in await events.receive(timeout=0.5):
                        ended = ended or isinstance(msg, RunEnded)
        await anyio.to_thread.run_sync(wait_stages, stages)
        assert second.wait(30) == 0
        state = json.loads((run_dir / "checkpoints" / COORDINATOR_FILE).read_text())
        assert state["pending"] == []
    finally:
        events.close()


@pytest.mark.anyio
async def test_restarted_hook_recovers_best_and_sets_aside_an_abandoned_future(
    bus: BusAddress, run_dir: Path
) -> None:
    from test_checkpoint_lib import make_job, save_all_stages  # type: ignore[import-not-found]

    from evtrain.checkpoint import commit_checkpoint, set_latest

    job = make_job()
    for step, loss in ((2, 0.3), (4, 0.1), (6, 0.2)):
        ckpt = save_all_stages(run_dir, job, 1, step=step, cid=f"c{step}", asynchronous=False)
        commit_checkpoint(
            ckpt,
            checkpoint_id=f"c{step}",
            num_stages=1,
            metric_name="loss",
            metric=loss,
            metric_mode="min",
        )
        set_latest(run_dir, ckpt)
    save_all_stages(run_dir, job, 1, step=8, cid="c8", asynchronous=False)  # never committed
    await anyio.sleep(0.05)

    hook = CheckpointHook(run_dir=str(run_dir), best_metric="loss", mode="min")
    runner = HookRunner([hook], bus)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner.run)
            await runner.ready.wait()
            assert (hook.best, hook.last_committed_step) == (0.1, 6)
            # The run resumes from step 4: step 6 and 8 belong to an abandoned future.
            with Publisher(bus.endpoint("events_in"), source="stage/0") as pub:
                pub.publish(
                    RunStarted(
                        name="ckpt",
                        num_stages=1,
                        num_microbatches=1,
                        schedule="gpipe",
                        max_steps=10,
                        batch_size=1,
                        start_step=4,
                        run_dir=str(run_dir),
                    )
                )
                while (run_dir / "checkpoints" / "step-00000006").exists():
                    await anyio.sleep(0.05)
            runner.stop()
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert [n for n in names if n.startswith("step-")][:2] == ["step-00000002", "step-00000004"]
    assert any(n.startswith("step-00000006.superseded-") for n in names)
    assert "step-00000008" not in names
    assert [(i.step, i.committed) for i in list_checkpoints(run_dir)] == [(2, True), (4, True)]
    assert latest_committed(run_dir).step == 4  # type: ignore[union-attr]


# ------------------------------------------------------------------ the fake stage


def _fake_stage(cfg: dict[str, Any]) -> None:
    import torch.distributed as dist
    from test_checkpoint_lib import build, make_job, train  # type: ignore[import-not-found]

    from evtrain.bus.commands import CommandReceiver
    from evtrain.checkpoint.writer import ShardWriter, is_on_stop_request
    from evtrain.events import (
        CheckpointNow,
        CommandAcked,
        EvalEnded,
        Heartbeat,
        RunStarted,
        StageStarted,
        StepEnded,
    )

    stage, world = cfg["stage"], cfg["world"]
    address = BusAddress.parse(cfg["bus"])
    dist.init_process_group(
        "gloo", init_method=f"file://{cfg['init']}", rank=stage, world_size=world
    )
    job = make_job()
    module, opt, sched = build(job, world, stage)
    pub = Publisher(address.endpoint("events_in"), source=f"stage/{stage}", run_id="run-1")
    rx = CommandReceiver(address.endpoint("commands_out"))
    writer = ShardWriter(stage, world, write_delay_s=float(cfg.get("write_delay_s", 0.0)))
    behaviour = list(cfg.get("stage1_behaviour", [])) if stage == 1 else []
    pub.publish(
        StageStarted(
            stage=stage,
            num_stages=world,
            rank=stage,
            host="localhost",
            pid=os.getpid(),
            device="cpu",
            layers=[],
            num_params=0,
        )
    )
    dist.barrier()
    if stage == 0:
        pub.publish(
            RunStarted(
                name="ckpt",
                num_stages=world,
                num_microbatches=1,
                schedule="gpipe",
                max_steps=cfg["steps"],
                batch_size=1,
                run_dir=cfg["run_dir"],
            )
        )
    buffered: list[Any] = []
    step = 0
    evals = list(cfg.get("eval_losses", []))
    stop = False
    while True:
        # Boundary `step`: apply the commands every stage has received.
        buffered += rx.poll()
        count = torch.tensor([len(buffered)])
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        applied, buffered = buffered[: int(count)], buffered[int(count) :]
        for cmd in applied:
            ok, detail = True, ""
            if isinstance(cmd, CheckpointNow):
                if is_on_stop_request(cmd):
                    writer.arm_on_stop(cmd)
                elif behaviour and behaviour[0] == "fail":
                    behaviour.pop(0)
                    pub.publish(
                        CheckpointFailed(
                            checkpoint_id=cmd.checkpoint_id,
                            step=step,
                            stage=stage,
                            error="disk on fire",
                        )
                    )
                elif behaviour and behaviour[0] == "silent":
                    behaviour.pop(0)
                else:
                    writer.save(
                        cmd.path,
                        checkpoint_id=cmd.checkpoint_id,
                        step=step,
                        module=module,
                        optimizer=opt,
                        scheduler=sched,
                        reason=cmd.reason,
                    )
            elif isinstance(cmd, StopRun):
                stop = True
            else:
                ok, detail = False, "unknown"
            pub.publish(
                CommandAcked(
                    command_id=cmd.command_id,
                    command=cmd.topic.decode(),
                    stage=stage,
                    step=step,
                    ok=ok,
                    detail=detail,
                )
            )
        for done in writer.poll():
            pub.publish(done.to_event())
        flag = torch.tensor([1 if stop else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() or step >= cfg["steps"]:
            break
        train(module, opt, sched, 1, start=step)
        step += 1
        pub.publish(StepEnded(step=step, stage=stage))
        pub.publish(Heartbeat(stage=stage, step=step))
        every = cfg.get("eval_every")
        if every and step % every == 0 and stage == world - 1 and evals:
            pub.publish(EvalEnded(step=step, stage=stage, metrics={"loss": evals.pop(0)}))
        time.sleep(cfg["step_s"])
    # The end of the run: the armed on-stop save, flushed before run.ended.
    writer.save_on_stop(step=step, module=module, optimizer=opt, scheduler=sched)
    for done in writer.wait():
        pub.publish(done.to_event())
    writer.close()
    dist.barrier()
    dump = Path(cfg["run_dir"]) / f"final-{stage}.pt"
    torch.save(module.state_dict(), dump)
    if stage == 0:
        pub.publish(RunEnded(status="stopped" if stop else "completed", step=step))
    pub.close()
    rx.close()
    dist.destroy_process_group()
    print(json.dumps({"stage": stage, "step": step, "dump": str(dump)}))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))  # for test_checkpoint_lib's helpers
    _fake_stage(json.loads(sys.argv[1]))
