"""Event filters and base-class subscriptions of ``@on``, on a real broker; misuse errors."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from evtrain.bus.address import BusAddress
from evtrain.bus.publisher import Publisher
from evtrain.events import (
    MESSAGE_TYPES,
    EpochEnded,
    EvalEnded,
    Event,
    Heartbeat,
    MicrobatchBackward,
    MicrobatchForward,
    MicrobatchSpan,
    MicrobatchWait,
    RunStarted,
    StageFailed,
    StepEnded,
)
from evtrain.hooks import EventFilter, Hook, HookRunner, on
from evtrain.steps import MergedStep

pytestmark = pytest.mark.anyio

NOWHERE = BusAddress("ipc", "/nonexistent-filter-test")
"""An address never connected to: a runner is only built, not run."""


@asynccontextmanager
async def attached(hook: Hook, bus: BusAddress) -> AsyncIterator[HookRunner]:
    runner = HookRunner([hook], bus)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        with anyio.fail_after(20):
            await runner.ready.wait()
        try:
            yield runner
        finally:
            runner.stop()


async def wait_until(predicate: Any, timeout: float = 20.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.01)


def stage_pubs(bus: BusAddress, stages: int) -> list[Publisher]:
    return [
        Publisher(bus.endpoint("events_in"), source=f"stage/{s}", run_id="run-1")
        for s in range(stages)
    ]


class Picky(Hook):
    """Records (stage, step) per handler; ``everything`` comes last, so it is seen last."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, list[tuple[int, int]]] = defaultdict(list)

    def _record(self, name: str, ev: StepEnded) -> None:
        self.calls[name].append((ev.stage, ev.step))

    @on(StepEnded, every=3)
    def every3(self, ev: StepEnded) -> None:
        self._record("every3", ev)

    @on(StepEnded, once=4)
    def once4(self, ev: StepEnded) -> None:
        self._record("once4", ev)

    @on(StepEnded, once=4, stage=1)
    def once4_on_1(self, ev: StepEnded) -> None:
        self._record("once4_on_1", ev)

    @on(StepEnded, stage=1)
    def on_1(self, ev: StepEnded) -> None:
        self._record("on_1", ev)

    @on(StepEnded, every=2, stage=[0, 2])
    def even_on_0_2(self, ev: StepEnded) -> None:
        self._record("even_on_0_2", ev)

    @on(Heartbeat, stage=2)
    def heartbeat_of_2(self, ev: Heartbeat) -> None:
        self.calls["heartbeat_of_2"].append((ev.stage or 0, ev.step))

    @on(StepEnded)
    def everything(self, ev: StepEnded) -> None:
        self._record("everything", ev)


async def test_every_once_and_stage_pick_their_events(bus: BusAddress) -> None:
    hook = Picky()
    pubs = stage_pubs(bus, 3)
    try:
        async with attached(hook, bus):
            for stage, pub in enumerate(pubs):
                pub.publish(Heartbeat(stage=None, step=0))  # a stage filter passes no None
                pub.publish(Heartbeat(stage=stage, step=0))
                for step in range(1, 10):
                    pub.publish(StepEnded(step=step, stage=stage))
            await wait_until(lambda: len(hook.calls["everything"]) == 27)
            await wait_until(lambda: len(hook.calls["heartbeat_of_2"]) == 1)
    finally:
        for pub in pubs:
            pub.close()
    calls = {name: sorted(seen) for name, seen in hook.calls.items()}
    assert calls["every3"] == [(s, k) for s in range(3) for k in (3, 6, 9)]
    assert calls["once4"] == [(0, 4), (1, 4), (2, 4)]  # once per stage
    assert calls["once4_on_1"] == [(1, 4)]
    assert calls["on_1"] == [(1, k) for k in range(1, 10)]
    assert calls["even_on_0_2"] == [(s, k) for s in (0, 2) for k in (2, 4, 6, 8)]
    assert calls["heartbeat_of_2"] == [(2, 0)]


class Spans(Hook):
    """Base-class subscriptions; ``any_span`` comes last, so it is seen last."""

    def __init__(self) -> None:
        super().__init__()
        self.twice: list[tuple[str, int]] = []
        self.mixed: list[tuple[str, int]] = []
        self.any_span: list[tuple[str, int]] = []

    @on(MicrobatchSpan, MicrobatchForward)
    def base_and_subclass(self, ev: MicrobatchSpan) -> None:
        self.twice.append((ev.topic.decode(), ev.step))

    @on(MicrobatchForward)
    @on(MicrobatchSpan, every=2)
    def forward_always_others_even(self, ev: MicrobatchSpan) -> None:
        self.mixed.append((ev.topic.decode(), ev.step))

    @on(MicrobatchSpan)
    def span(self, ev: MicrobatchSpan) -> None:
        self.any_span.append((ev.topic.decode(), ev.step))


async def test_a_base_class_subscribes_to_each_concrete_event_and_calls_once(
    bus: BusAddress,
) -> None:
    hook = Spans()
    kinds = (MicrobatchForward, MicrobatchBackward, MicrobatchWait)
    sent = [(kind.topic.decode(), step) for step in range(1, 5) for kind in kinds]
    pubs = stage_pubs(bus, 1)
    try:
        async with attached(hook, bus) as runner:
            assert runner.topics == sorted(kind.topic.decode() for kind in kinds)
            for step in range(1, 5):
                for kind in kinds:
                    pubs[0].publish(kind(step=step, stage=0, microbatch=0, start=1.0, end=2.0))
            await wait_until(lambda: len(hook.any_span) == len(sent))
    finally:
        pubs[0].close()
    assert hook.any_span == sent
    assert hook.twice == sent  # registered for the base and the subclass: still one call
    assert hook.mixed == [
        (topic, step) for topic, step in sent if topic == "microbatch.forward" or step % 2 == 0
    ]


class Everything(Hook):
    @on(Event)
    def seen(self, ev: Event) -> None:
        pass


def test_on_event_subscribes_to_every_event_topic() -> None:
    runner = HookRunner([Everything()], NOWHERE)
    assert runner.topics == sorted(t.topic.decode() for t in MESSAGE_TYPES if issubclass(t, Event))


# -- the filter as a value -------------------------------------------------------------------


def test_a_filter_is_a_value_that_works_on_anything_with_a_step() -> None:
    every5 = EventFilter(every=5)
    assert [s for s in range(1, 21) if every5(MergedStep(s))] == [5, 10, 15, 20]
    assert EventFilter(once=3)(MergedStep(3)) and not EventFilter(once=3)(MergedStep(6))
    assert EventFilter(stage=[1, 2]) == EventFilter(stage=(2, 1)) == EventFilter(stage={1, 2})
    assert hash(EventFilter(stage=1)) == hash(EventFilter(stage=[1]))
    assert EventFilter()(SimpleNamespace())  # no condition: everything passes
    # Some events leave a step or a stage out: those do not pass a filter on it.
    assert not every5(StageFailed(stage=0, error="e", traceback="", step=None))
    assert not EventFilter(stage=0)(Heartbeat(stage=None))
    with pytest.raises(AttributeError):
        every5.every = 3  # type: ignore[misc]


def test_on_epoch_ended_every_and_once_count_epochs() -> None:
    # Epochs of 4 steps after a first one of 3: the epoch ends fall on odd steps.
    ends = [EpochEnded(epoch=e, step=4 * e + 3) for e in range(6)]
    assert [e.epoch for e in ends if EventFilter(every=2)(e)] == [1, 3, 5]
    assert [e.epoch for e in ends if EventFilter(every=3)(e)] == [2, 5]
    assert [e.epoch for e in ends if EventFilter(once=1)(e)] == [0]
    assert [e.epoch for e in ends if EventFilter(once=7)(e)] == []  # not step 7


def test_the_filtered_path_leaves_unfiltered_types_alone() -> None:
    class Mixed(Hook):
        @on(StepEnded, every=2)
        def even(self, ev: StepEnded) -> None:
            pass

        @on(EvalEnded)
        def evals(self, ev: EvalEnded) -> None:
            pass

    runner = HookRunner([Mixed()], NOWHERE)
    steps = [runner._prepare(StepEnded(step=k, stage=0)) for k in (1, 2)]
    assert [[method for _, method, _ in handlers] for handlers in steps] == [[], ["even"]]
    assert [m for _, m, _ in runner._prepare(EvalEnded(step=1, stage=0, metrics={}))] == ["evals"]


# -- misuse is an error at class definition -----------------------------------------------------


class NotOnTheBus(Event, kw_only=True, tag="not.on.the.bus"):
    """Decodable by nobody: the schema's union does not hold it."""

    step: int


@pytest.mark.parametrize(
    ("types", "options", "error", "says"),
    [
        ((StepEnded,), dict(every=0), ValueError, "every= must be >= 1, got 0"),
        ((StepEnded,), dict(every=-3), ValueError, "every= must be >= 1, got -3"),
        ((StepEnded,), dict(every=2.5), TypeError, "every= must be an int, got 2.5"),
        ((StepEnded,), dict(every=True), TypeError, "every= must be an int, got True"),
        ((StepEnded,), dict(once=-1), ValueError, "once= must be a step >= 0, got -1"),
        ((StepEnded,), dict(once="3"), TypeError, "once= must be an int, got '3'"),
        ((StepEnded,), dict(once=3, every=3), ValueError, "once= and every= exclude each other"),
        ((StepEnded,), dict(stage="0"), TypeError, "stage= must be an int or a collection"),
        ((StepEnded,), dict(stage=[]), ValueError, "stage= names no stage"),
        ((StepEnded,), dict(stage=-1), ValueError, "stage= must be stage indices >= 0"),
        ((StepEnded,), dict(stage=[0, 1.5]), TypeError, "stage= must hold ints only"),
        ((RunStarted,), dict(every=5), TypeError, "RunStarted has no step field for every="),
        ((RunStarted,), dict(once=5), TypeError, "RunStarted has no step field for once="),
        ((EvalEnded, RunStarted), dict(stage=0), TypeError, "RunStarted has no stage field"),
        ((Event,), dict(stage=1), TypeError, "Event has no stage field for stage="),
        ((int,), {}, TypeError, "expects evtrain event types, got <class 'int'>"),
        ((NotOnTheBus,), {}, TypeError, "NotOnTheBus is not an event type of the bus schema"),
    ],
)
def test_misuse_is_an_error_at_class_definition_naming_the_handler(
    types: tuple[type, ...], options: dict[str, Any], error: type[Exception], says: str
) -> None:
    names = ", ".join(t.__name__ for t in types)
    expected = rf"@on\({re.escape(names)}\) on .*Wrong\.handler: .*{re.escape(says)}"
    with pytest.raises(error, match=expected):

        class Wrong(Hook):
            @on(*types, **options)
            def handler(self, ev: Any) -> None:
                pass


def test_on_needs_an_event_type() -> None:
    with pytest.raises(TypeError, match="at least one event type"):
        on()


def test_a_stage_filter_takes_any_collection() -> None:
    stages: Collection[int]
    for stages in ([1, 3], (1, 3), {1, 3}, frozenset({1, 3}), range(1, 4, 2)):
        assert EventFilter(stage=stages).stage == frozenset({1, 3})


class PerReplica(Hook):
    """Records (stage, replica, step) of replica 0's steps and of stage 1 replica 1's."""

    def __init__(self) -> None:
        super().__init__()
        self.replica0: list[tuple[int, int, int]] = []
        self.stage1_replica1: list[tuple[int, int, int]] = []
        self.everything = 0

    @on(StepEnded, replica=0)
    def first_replica(self, ev: StepEnded) -> None:
        self.replica0.append((ev.stage, ev.replica, ev.step))

    @on(StepEnded, stage=1, replica={1})
    def one_process(self, ev: StepEnded) -> None:
        self.stage1_replica1.append((ev.stage, ev.replica, ev.step))

    @on(StepEnded)
    def all_steps(self, ev: StepEnded) -> None:
        self.everything += 1


async def test_a_replica_filter_sees_each_step_of_a_stage_once(bus: BusAddress) -> None:
    hook = PerReplica()
    pubs = {
        (s, r): Publisher(
            bus.endpoint("events_in"), source=f"stage/{s}" + (f"/{r}" if r else ""), run_id="run-1"
        )
        for s in range(2)
        for r in range(2)
    }
    try:
        async with attached(hook, bus):
            for (stage, replica), pub in pubs.items():
                for step in range(1, 4):
                    pub.publish(StepEnded(step=step, stage=stage, replica=replica))
            await wait_until(lambda: hook.everything == 12)
    finally:
        for pub in pubs.values():
            pub.close()
    assert sorted(hook.replica0) == [(s, 0, k) for s in range(2) for k in range(1, 4)]
    assert sorted(hook.stage1_replica1) == [(1, 1, k) for k in range(1, 4)]


def test_a_replica_filter_refuses_what_names_no_replica() -> None:
    with pytest.raises(ValueError, match="replica= names no replica"):
        EventFilter(replica=[])
    with pytest.raises(TypeError, match="replica= must hold ints only"):
        EventFilter(replica=["0"])
    with pytest.raises(TypeError, match="RunStarted has no replica field for replica= to read"):
        on(RunStarted, replica=0)(lambda self, ev: None)
