"""The hook runtime on a real broker: errors, priorities, commands, late join."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import structlog.testing
import zmq
from helpers.bus_procs import SCRIPT, Lines, connect

from evtrain import events
from evtrain.bus import Broker
from evtrain.bus.address import BusAddress
from evtrain.bus.publisher import Publisher
from evtrain.bus.sequence import MAX_GAP, SequenceTracker
from evtrain.bus.state_service import fetch_snapshot
from evtrain.bus.subscriber import Subscriber
from evtrain.events import (
    BusGaps,
    Command,
    CommandAcked,
    EvaluateNow,
    HookError,
    HookStarted,
    Message,
    RunEnded,
    RunStarted,
    StageStarted,
    StepEnded,
    StopRun,
    encode,
)
from evtrain.hooks import CommandTimeout, Hook, HookRunner, on
from evtrain.hooks.checkpoint import CheckpointHook
from evtrain.hooks.runner import BUS_LOST_AFTER_S, BUS_QUIET_S, HOOK_TRACEBACKS
from evtrain.ratelimit import RateLimitedLog

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def attached(*hooks: Hook, bus: BusAddress, **options: object) -> AsyncIterator[HookRunner]:
    """Run ``hooks`` in this process until the block ends."""
    runner = HookRunner(list(hooks), bus, **options)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        with anyio.fail_after(20):
            await runner.ready.wait()
        try:
            yield runner
        finally:
            runner.stop()


def stage_pub(bus: BusAddress, stage: int = 0) -> Publisher:
    return Publisher(bus.endpoint("events_in"), source=f"stage/{stage}", run_id="run-1")


async def subscribed(bus: BusAddress, topic: str) -> Subscriber:
    """A subscriber to ``topic`` whose subscription is proven to have reached the broker."""
    sub = Subscriber(bus.endpoint("events_out"), [topic])
    await connect(sub, bus)
    return sub


def run_started(name: str, num_stages: int, **fields: Any) -> RunStarted:
    """A run's start as the first stage publishes it (1F1B; the sizes do not matter here)."""
    sizes = {"num_microbatches": 1, "max_steps": 100, "batch_size": 1}
    return RunStarted(name=name, num_stages=num_stages, schedule="1f1b", **(sizes | fields))


async def wait_until(predicate: object, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():  # type: ignore[operator]
            await anyio.sleep(0.01)


class Flaky(Hook):
    """Raises on step 2; records everything it handled."""

    def __init__(self) -> None:
        super().__init__()
        self.handled: list[int] = []

    @on(StepEnded)
    async def check(self, ev: StepEnded) -> None:
        if ev.step == 2:
            raise ValueError("boom at step 2")
        self.handled.append(ev.step)


async def test_a_raising_handler_does_not_stop_its_hook(bus: BusAddress) -> None:
    errors = await subscribed(bus, "hook.error")
    hook = Flaky()
    async with attached(hook, bus=bus):
        with stage_pub(bus) as pub:
            for step in range(5):
                pub.publish(StepEnded(step=step, stage=0))
            await wait_until(lambda: hook.handled == [0, 1, 3, 4])
        reported: list[HookError] = []
        with anyio.fail_after(10):
            while not reported:
                reported = [m for m in await errors.receive() if isinstance(m, HookError)]
    error = reported[0]
    assert (error.hook, error.handler, error.event_type) == ("flaky", "check", "step.ended")
    assert "boom at step 2" in error.error and "ValueError" in error.traceback
    assert error.source == "hook/flaky"
    errors.close()


class Ordered(Hook):
    def __init__(self, label: str, calls: list[str], priority: int | None = None) -> None:
        super().__init__(priority=priority)
        self.label = label
        self.calls = calls

    @classmethod
    def hook_name(cls) -> str:
        return "ordered"

    @on(StepEnded)
    def seen(self, ev: StepEnded) -> None:
        self.calls.append(f"{self.label}{ev.step}")


async def test_hooks_in_one_runner_run_by_priority_then_registration(bus: BusAddress) -> None:
    calls: list[str] = []
    late = Ordered("late", calls, priority=50)
    first = Ordered("first", calls, priority=5)
    tie = Ordered("tie", calls, priority=50)
    async with attached(late, first, tie, bus=bus):
        with stage_pub(bus) as pub:
            pub.publish(StepEnded(step=1, stage=0))
            pub.publish(StepEnded(step=2, stage=0))
        await wait_until(lambda: len(calls) == 6)
    assert calls == ["first1", "late1", "tie1", "first2", "late2", "tie2"]


class Commander(Hook):
    """Sends commands on request of the test."""


async def test_a_command_reaches_a_stage_process_and_its_ack_returns(
    bus: BusAddress, procs: object
) -> None:
    stage = procs.python(SCRIPT, "stage", "--bus", str(bus), "--stage", "0")  # type: ignore[attr-defined]
    lines = Lines(stage)
    assert (await anyio.to_thread.run_sync(lines.json))["ready"]
    hook = Commander()
    async with attached(hook, bus=bus, retry_interval=0.2):
        command = EvaluateNow(command_id=uuid.uuid4().hex)
        acks = await hook.send_command(command, timeout=15, acks=1)
        assert [(a.command_id, a.stage, a.ok, a.detail) for a in acks] == [
            (command.command_id, 0, True, "done")
        ]
        assert isinstance(acks[0], CommandAcked) and acks[0].source == "stage/0"
        # stop() goes through the same path and the stage saw each command once.
        stop_acks = await hook.stop("enough", timeout=15)
        assert stop_acks[0].command == "cmd.stop"
    seen = [await anyio.to_thread.run_sync(lines.json) for _ in range(2)]
    assert [s["command"] for s in seen] == ["cmd.evaluate", "cmd.stop"]


async def test_a_command_sent_before_the_stage_connects_gets_through_by_retry(
    bus: BusAddress, procs: object
) -> None:
    hook = Commander()
    async with attached(hook, bus=bus, retry_interval=0.2):
        result: dict[str, list[CommandAcked]] = {}

        async def send() -> None:
            result["acks"] = await hook.send_command(
                StopRun(command_id="early", reason="test"), timeout=20, acks=1
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            await anyio.sleep(0.6)  # published at least twice into the void by now
            assert "acks" not in result
            procs.python(SCRIPT, "stage", "--bus", str(bus), "--stage", "3")  # type: ignore[attr-defined]
    assert [(a.command_id, a.stage) for a in result["acks"]] == [("early", 3)]


async def test_an_unacknowledged_command_times_out(bus: BusAddress) -> None:
    hook = Commander()
    async with attached(hook, bus=bus, retry_interval=0.1):
        with anyio.fail_after(5):
            with pytest.raises(CommandTimeout, match="0 of 2 acknowledgements"):
                await hook.send_command(EvaluateNow(command_id="lost"), timeout=0.5, acks=2)


async def test_a_command_waits_no_longer_once_its_run_ended(bus: BusAddress) -> None:
    hook = Commander()
    failure: list[CommandTimeout] = []

    async def send() -> None:
        with pytest.raises(CommandTimeout, match="the run ended with 0 of 2") as caught:
            await hook.send_command(EvaluateNow(command_id="after-the-end"), timeout=600, acks=2)
        failure.append(caught.value)

    async with attached(hook, bus=bus, retry_interval=0.1):
        with anyio.fail_after(30), stage_pub(bus) as pub:
            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                # Until the runner's subscription to run.ended reached the broker.
                while not failure:
                    pub.publish(RunEnded(status="completed", reason="done"))
                    await anyio.sleep(0.2)


class StateWatcher(Hook):
    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, int]] = []

    @on(StepEnded)
    def step(self, ev: StepEnded) -> None:
        self.steps.append((ev.stage, ev.step))


async def test_a_late_joiner_knows_the_run_at_once(bus: BusAddress) -> None:
    with stage_pub(bus, 0) as pub0, stage_pub(bus, 1) as pub1:
        pub0.publish(run_started("late", 2, num_microbatches=4, max_steps=100, batch_size=32))
        for stage, pub in ((0, pub0), (1, pub1)):
            pub.publish(
                StageStarted(
                    stage=stage,
                    num_stages=2,
                    rank=stage,
                    host="h",
                    pid=1,
                    device="cpu",
                    layers=[stage],
                    num_params=10,
                )
            )
            pub.publish(StepEnded(step=5, stage=stage, loss=0.5 if stage else None))
        # Nobody listened; the broker's state service did.
        with anyio.fail_after(10):
            while len([m for m in fetch_snapshot(bus) if isinstance(m, StepEnded)]) < 2:
                await anyio.sleep(0.02)
        hook = StateWatcher()
        async with attached(hook, bus=bus):
            state = hook.state
            assert state.run is not None and state.run.name == "late"
            assert sorted(state.stages) == [0, 1] and state.num_stages == 2
            assert state.step == 5
            assert state.last_step[1].loss == 0.5
            assert sorted(hook.steps) == [(0, 5), (1, 5)]  # handlers saw the snapshot
            pub1.publish(StepEnded(step=6, stage=1))
            await wait_until(lambda: (1, 6) in hook.steps)
            assert hook.state.step == 6
            assert sorted(hook.steps) == [(0, 5), (1, 5), (1, 6)]  # nothing twice


async def test_a_checkpoint_hook_replaying_an_ended_run_holds_up_no_sibling(
    bus: BusAddress, tmp_path: Path
) -> None:
    # A host restarted after the run ended replays its start: the checkpoint hook
    # must not send the plan and await acknowledgements no stage is left to send.
    with stage_pub(bus) as pub:
        pub.publish(
            run_started(
                "over", 1, num_microbatches=1, max_steps=3, batch_size=4, run_dir=str(tmp_path)
            )
        )
        pub.publish(StepEnded(step=3, stage=0))
        pub.publish(RunEnded(status="completed", step=3))
        with anyio.fail_after(10):
            while not any(isinstance(m, RunEnded) for m in fetch_snapshot(bus)):
                await anyio.sleep(0.02)
        sibling = StateWatcher()
        checkpoint = CheckpointHook(run_dir=str(tmp_path), command_timeout=120.0)
        # `attached` bounds the replay at 20 s, well below the command timeout.
        async with attached(checkpoint, sibling, bus=bus):
            assert checkpoint.state.ended is not None
            pub.publish(StepEnded(step=4, stage=0))
            await wait_until(lambda: (0, 4) in sibling.steps)


COMMAND_TIMEOUT = 30.0


class Rearms(Hook):
    """On the run's start (replayed, for a hook that attaches mid-run) it sends a command
    and waits for every stage's acknowledgement, as a hook re-arming a save does."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.acks: list[CommandAcked] = []
        self.took: float | None = None

    @on(RunStarted)
    async def run_started(self, ev: RunStarted) -> None:
        started = time.monotonic()
        self.acks = await self.send_command(
            EvaluateNow(command_id=uuid.uuid4().hex), timeout=COMMAND_TIMEOUT
        )
        self.took = time.monotonic() - started
        self.calls.append("acknowledged")

    @on(StepEnded)
    def step(self, ev: StepEnded) -> None:
        self.calls.append(f"{ev.stage}:{ev.step}")


async def act_as_stages(bus: BusAddress, pubs: list[Publisher]) -> None:
    """Acknowledge every command for each stage; before the first acks, end step 6 live."""
    with Subscriber(bus.endpoint("commands_out"), ["cmd."]) as commands:
        stepped = False
        while True:
            for command in await commands.receive():
                if not isinstance(command, Command):
                    continue
                for stage, pub in enumerate(pubs):
                    if not stepped:
                        pub.publish(StepEnded(step=6, stage=stage))
                    pub.publish(
                        CommandAcked(
                            command_id=command.command_id,
                            command=command.topic.decode(),
                            stage=stage,
                            step=5,
                        )
                    )
                stepped = True


async def test_a_late_joiner_awaits_acks_while_it_replays_the_snapshot(bus: BusAddress) -> None:
    with stage_pub(bus, 0) as pub0, stage_pub(bus, 1) as pub1:
        pub0.publish(run_started("late", 2, num_microbatches=4, max_steps=100, batch_size=32))
        for stage, pub in ((0, pub0), (1, pub1)):
            pub.publish(StepEnded(step=5, stage=stage))
        with anyio.fail_after(10):
            while len([m for m in fetch_snapshot(bus) if isinstance(m, StepEnded)]) < 2:
                await anyio.sleep(0.02)
        hook = Rearms()
        async with anyio.create_task_group() as stages:
            stages.start_soon(act_as_stages, bus, [pub0, pub1])
            # `attached` waits at most 20 s for the replay: less than the command timeout.
            async with attached(hook, bus=bus, retry_interval=0.2):
                assert hook.took is not None and hook.took < COMMAND_TIMEOUT / 3
                assert sorted(a.stage for a in hook.acks) == [0, 1]  # the run's two stages
                await wait_until(lambda: len(hook.calls) == 5)
            stages.cancel_scope.cancel()
    # The snapshot in full first, then the live events that queued up meanwhile; none twice.
    assert hook.calls[0] == "acknowledged"
    assert sorted(hook.calls[1:3]) == ["0:5", "1:5"]
    assert sorted(hook.calls[3:]) == ["0:6", "1:6"]


async def test_stop_ends_a_runner_whose_replay_awaits_acks(bus: BusAddress) -> None:
    with stage_pub(bus) as pub:
        pub.publish(run_started("nobody acks", 1, num_microbatches=1, max_steps=10, batch_size=1))
        with anyio.fail_after(10):
            while not any(isinstance(m, RunStarted) for m in fetch_snapshot(bus)):
                await anyio.sleep(0.02)
    hook = Rearms()
    runner = HookRunner([hook], bus, retry_interval=0.2)
    with Subscriber(bus.endpoint("commands_out"), ["cmd."]) as commands:
        with anyio.fail_after(COMMAND_TIMEOUT / 3):
            async with anyio.create_task_group() as tg:
                tg.start_soon(runner.run)
                await commands.receive()  # the replayed handler now awaits its acks
                runner.stop()
    assert hook.took is None and not runner.ready.is_set()


class Ender(Hook):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[Message] = []

    @on(RunEnded)
    def ended(self, ev: RunEnded) -> None:
        self.events.append(ev)


async def test_exit_on_run_end(bus: BusAddress) -> None:
    hook = Ender()
    runner = HookRunner([hook], bus, exit_on_run_end=True)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner.run)
            await runner.ready.wait()
            with stage_pub(bus) as pub:
                pub.publish(RunEnded(status="completed", reason="done"))
    assert [e.reason for e in hook.events] == ["done"]  # type: ignore[attr-defined]


async def test_hook_started_comes_once_after_the_runner_received_its_own_probe(
    bus: BusAddress,
) -> None:
    # What the launcher relies on: once a process's HookStarted arrived, whatever
    # is published reaches its hooks (a probe seen elsewhere would not say that).
    watch = await subscribed(bus, "hook.")
    hook = Ender()
    runner = HookRunner([hook], bus, exit_on_run_end=True)
    arrived: list[Message] = []
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner.run)
            while not any(isinstance(m, HookStarted) for m in arrived):
                arrived += [m for m in await watch.receive() if m.source == "hook/ender"]
            with stage_pub(bus) as pub:
                pub.publish(RunEnded(status="completed", reason="right after HookStarted"))
    assert [e.reason for e in hook.events] == ["right after HookStarted"]  # type: ignore[attr-defined]
    kinds = [type(m).__name__ for m in arrived]
    assert kinds[-1] == "HookStarted" and set(kinds[:-1]) == {"HookProbe"}, kinds
    started = arrived[-1]
    assert isinstance(started, HookStarted) and started.hooks == ["ender"]
    assert started.topics == [RunEnded.topic.decode()]
    watch.close()


# -- hostile sequence numbers, repeated raises ---------------------------------------------


def test_sequence_counts_saturate_and_the_table_stays_bounded() -> None:
    tracker = SequenceTracker(max_tracked=8)
    for seq in (-(2**63), 2**63 - 1, -(2**63), 2**200, 0, 5):
        tracker.observe("stage/0", b"step.ended", seq)
    assert tracker.total_missing == 4  # 0 -> 5; the absurd jumps count as restarts
    assert tracker.restarts == 4
    tracker.total_missing = events.MAX_INT - 1
    tracker.observe("stage/0", b"step.ended", 5 + MAX_GAP)
    assert tracker.total_missing == events.MAX_INT  # saturated, still encodable
    encode(BusGaps(from_source="stage/0", missing=MAX_GAP, total_missing=tracker.total_missing))
    for i in range(100):
        tracker.observe(f"made-up/{i}", b"step.ended", 0)
    assert len(tracker.expected) == 8


async def test_hostile_sequence_numbers_do_not_stop_a_hook(bus: BusAddress) -> None:
    """StepEnded with seq -2**63, 2**63-1, -2**63, 2**63-1 once killed every hook."""
    hook = StateWatcher()
    gaps = await subscribed(bus, "bus.gaps")
    context = zmq.Context()
    raw = context.socket(zmq.XPUB)
    raw.connect(bus.endpoint("events_in"))
    assert raw.poll(10_000, zmq.POLLIN)
    try:
        async with attached(hook, bus=bus):
            for seq in (-(2**63), 2**63 - 1, -(2**63), 2**63 - 1, events.MAX_INT, 0, 7):
                payload = msgspec.msgpack.encode(
                    {"type": "step.ended", "v": 1, "seq": seq, "step": 1, "stage": 0}
                )
                raw.send_multipart([b"step.ended", payload])
            await wait_until(lambda: len(hook.steps) == 3)
            with stage_pub(bus) as pub:
                pub.publish(StepEnded(step=2, stage=0))
                await wait_until(lambda: (0, 2) in hook.steps)
            reported: list[BusGaps] = []
            with anyio.fail_after(10):
                while not reported:
                    reported = [m for m in await gaps.receive() if isinstance(m, BusGaps)]
            assert reported[0].missing == 6  # 0 -> 7
    finally:
        raw.close(linger=0)
        context.term()
        gaps.close()


class AlwaysRaises(Hook):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    @on(StepEnded)
    def check(self, ev: StepEnded) -> None:
        self.calls += 1
        raise ValueError(f"boom at {ev.step}")


async def test_a_handler_raising_on_every_event_reports_a_few_tracebacks_then_counts(
    bus: BusAddress,
) -> None:
    errors = await subscribed(bus, "hook.error")
    received: list[HookError] = []
    hook = AlwaysRaises()
    with structlog.testing.capture_logs() as logs:
        async with attached(hook, bus=bus):
            with stage_pub(bus) as pub:
                for step in range(200):
                    pub.publish(StepEnded(step=step, stage=0))
            with anyio.fail_after(10):
                while len(received) < HOOK_TRACEBACKS:
                    received += [m for m in await errors.receive() if isinstance(m, HookError)]
            # Stopping before every event was handled would leave some uncounted.
            await wait_until(lambda: hook.calls == 200, timeout=30)
        # Teardown reported the rest as one count.
        with anyio.fail_after(10):
            while sum(e.count for e in received) < 200:
                received += [m for m in await errors.receive() if isinstance(m, HookError)]
    errors.close()
    full = [e for e in logs if e["event"] == "hook handler raised"]
    assert len(full) == HOOK_TRACEBACKS and all("exc_info" in e for e in full)
    counts = [e for e in logs if e["event"] == "hook handler raised (repeated)"]
    assert [(c["kind"], c["more"]) for c in counts] == [
        ("always_raises.check: ValueError", 200 - HOOK_TRACEBACKS)
    ]
    assert [e.count for e in received] == [1] * HOOK_TRACEBACKS + [200 - HOOK_TRACEBACKS]
    assert all(e.traceback for e in received[:HOOK_TRACEBACKS]) and not received[-1].traceback


def test_rate_limited_log_counts_every_occurrence_and_logs_a_few_lines() -> None:
    now = [0.0]
    lines: list[tuple[str, dict[str, object]]] = []
    summaries: list[tuple[str, int]] = []

    class Sink:
        def warning(self, event: str, **fields: object) -> None:
            lines.append((event, fields))

    limited = RateLimitedLog(
        Sink(),
        "bad",
        first=2,
        interval=10.0,
        clock=lambda: now[0],
        on_summary=lambda kind, more: summaries.append((kind, more)),
    )
    for i in range(1000):
        now[0] = i * 0.1  # 100 s in all
        limited("a", i=i)
    limited("b")
    limited.flush()
    assert limited.counts == {"a": 1000, "b": 1} and limited.total == 1001
    assert [fields.get("i") for event, fields in lines if event == "bad"] == [0, 1, None]
    assert len(lines) <= 2 + 1 + 100 / 10 + 1
    assert sum(more for kind, more in summaries if kind == "a") == 998
    assert ("b", 1) not in summaries  # logged in full: nothing left to count


async def test_a_runner_says_when_its_bus_is_lost_and_when_it_answers_again(
    ipc_bus: BusAddress,
) -> None:
    broker = Broker(ipc_bus)
    broker.start()

    async def logged(text: str, logs: list[dict[str, Any]]) -> None:
        # Bounds for a failure: the runner probes after BUS_QUIET_S and gives up
        # BUS_LOST_AFTER_S later.
        with anyio.fail_after(BUS_QUIET_S + BUS_LOST_AFTER_S + 60):
            while not any(text in str(e["event"]) for e in logs):
                await anyio.sleep(0.1)

    try:
        with structlog.testing.capture_logs() as logs:
            async with attached(Ender(), bus=ipc_bus):
                await anyio.sleep(BUS_QUIET_S + 2)  # quiet, yet answering: no word
                assert not [e for e in logs if "bus" in str(e["event"])], logs
                broker.stop()
                await logged("the bus is lost", logs)
                broker = Broker(ipc_bus)
                broker.start()
                await logged("the bus answers again", logs)
        lost = [e for e in logs if "the bus is lost" in str(e["event"])]
        assert len(lost) == 1 and lost[0]["log_level"] == "warning", logs
        assert lost[0]["bus"] == str(ipc_bus)
    finally:
        broker.stop()
