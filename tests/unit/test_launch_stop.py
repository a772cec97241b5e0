"""The launcher's stop as a state machine (`evtrain.launcher.stop`), without any process.

Signals, acknowledgements and the time go in; the action the launcher
carries out comes out: the stop command first, SIGTERM to the agent after
the grace period or a second signal, SIGKILL after that or a third.
"""

from __future__ import annotations

import signal
import threading

import anyio
import pytest

from evtrain.bus.commands import RETRY_S
from evtrain.launcher.stop import (
    KILL_AFTER_S,
    StopAction,
    StopMachine,
    StopRequests,
)

GRACE_S = 30.0
T0 = 1000.0


def started(stages_up: bool = True, bus_down: bool = False) -> StopMachine:
    """A machine that got its first SIGINT at T0."""
    machine = StopMachine(GRACE_S)
    action = machine.on_signal(signal.SIGINT, T0, workers_started=stages_up, bus_down=bus_down)
    if action is StopAction.SEND_STOP:
        machine.sent(T0)
    return machine


def test_nothing_happens_without_a_signal() -> None:
    machine = StopMachine(GRACE_S)
    assert machine.tick(T0, stages=2) is StopAction.NONE
    assert machine.tick(T0 + 10 * GRACE_S, stages=2) is StopAction.NONE
    assert (machine.phase, machine.signal, machine.deadline) == (0, None, None)
    assert not machine.workers_ended_by_us


def test_the_first_signal_sends_the_stop_command_and_starts_the_grace_period() -> None:
    machine = StopMachine(GRACE_S)
    action = machine.on_signal(signal.SIGINT, T0, workers_started=True, bus_down=False)
    assert action is StopAction.SEND_STOP
    assert machine.phase == 1 and machine.signal == signal.SIGINT
    assert machine.deadline == T0 + GRACE_S
    assert machine.reason == "launcher got SIGINT"
    assert not machine.workers_ended_by_us  # the stages stop themselves: deaths still count


def test_the_command_is_sent_again_until_every_stage_acknowledged_it() -> None:
    machine = started()
    assert machine.tick(T0 + RETRY_S / 2, stages=2) is StopAction.NONE
    later = T0 + RETRY_S + 0.1
    assert machine.tick(later, stages=2) is StopAction.RESEND_STOP
    machine.sent(later)
    assert machine.tick(later + RETRY_S / 2, stages=2) is StopAction.NONE
    machine.acknowledged(0)
    machine.acknowledged(0)  # a stage that acknowledges twice is one stage
    assert machine.tick(later + 2 * RETRY_S, stages=2) is StopAction.RESEND_STOP
    machine.acknowledged(1)
    assert machine.tick(later + 3 * RETRY_S, stages=2) is StopAction.NONE
    assert machine.phase == 1


def test_an_unsent_command_is_retried_at_once() -> None:
    machine = StopMachine(GRACE_S)
    # The command socket could not connect: `sent` was never called.
    assert machine.on_signal(signal.SIGTERM, T0, workers_started=True, bus_down=False) is (
        StopAction.SEND_STOP
    )
    assert machine.tick(T0 + 0.01, stages=1) is StopAction.RESEND_STOP


def test_timeouts_escalate_to_sigterm_then_to_sigkill() -> None:
    machine = started()
    assert machine.tick(T0 + GRACE_S, stages=2) is not StopAction.TERMINATE  # not past it yet
    past_grace = T0 + GRACE_S + 0.1
    assert machine.tick(past_grace, stages=2) is StopAction.TERMINATE
    assert machine.phase == 2 and machine.workers_ended_by_us
    assert machine.deadline == past_grace + KILL_AFTER_S
    # No stop command is retried once elastic terminates the workers.
    assert machine.tick(past_grace + 2 * RETRY_S, stages=2) is StopAction.NONE
    past_kill = past_grace + KILL_AFTER_S + 0.1
    assert machine.tick(past_kill, stages=2) is StopAction.KILL
    assert machine.phase == 3 and machine.deadline is None
    assert machine.tick(past_kill + 1000, stages=2) is StopAction.NONE  # nothing after the kill


def test_each_further_signal_is_the_next_phase_and_the_first_signal_is_kept() -> None:
    machine = started()
    second = machine.on_signal(signal.SIGTERM, T0 + 1, workers_started=True, bus_down=False)
    assert second is StopAction.TERMINATE and machine.phase == 2
    assert machine.deadline == T0 + 1 + KILL_AFTER_S
    third = machine.on_signal(signal.SIGTERM, T0 + 2, workers_started=True, bus_down=False)
    assert third is StopAction.KILL and machine.phase == 3 and machine.deadline is None
    fourth = machine.on_signal(signal.SIGINT, T0 + 3, workers_started=True, bus_down=False)
    assert fourth is StopAction.KILL and machine.phase == 4
    assert machine.signal == signal.SIGINT and machine.reason == "launcher got SIGINT"


def test_without_workers_there_is_nothing_to_stop_gently() -> None:
    machine = StopMachine(GRACE_S)
    action = machine.on_signal(signal.SIGTERM, T0, workers_started=False, bus_down=False)
    assert action is StopAction.KILL
    assert machine.phase == 3 and machine.signal == signal.SIGTERM


def test_with_the_bus_down_elastic_terminates_the_workers_first() -> None:
    machine = StopMachine(GRACE_S)
    action = machine.on_signal(signal.SIGINT, T0, workers_started=True, bus_down=True)
    assert action is StopAction.TERMINATE
    assert machine.phase == 2 and machine.deadline == T0 + KILL_AFTER_S
    # The bus coming back later does not bring the command phase back.
    assert machine.tick(T0 + KILL_AFTER_S + 0.1, stages=2) is StopAction.KILL


def test_bus_down_and_no_workers_only_matter_for_the_first_phase() -> None:
    machine = started()
    action = machine.on_signal(signal.SIGINT, T0 + 1, workers_started=False, bus_down=True)
    assert action is StopAction.TERMINATE and machine.phase == 2


def test_workers_killed_after_a_failure_count_as_ended_by_us() -> None:
    machine = StopMachine(GRACE_S)
    machine.killed_workers()
    assert machine.phase == 3 and machine.workers_ended_by_us
    assert machine.signal is None  # not a stop: the exit status stays the failure's
    assert machine.tick(T0, stages=2) is StopAction.NONE


def test_a_stop_in_progress_still_times_out_after_the_workers_were_killed() -> None:
    machine = started()
    machine.killed_workers()
    assert machine.tick(T0 + 1, stages=2) is StopAction.NONE  # no command once they are gone
    assert machine.tick(T0 + GRACE_S + 0.1, stages=2) is StopAction.KILL


@pytest.mark.parametrize(
    ("action", "announced"),
    [
        (StopAction.NONE, False),
        (StopAction.SEND_STOP, True),
        (StopAction.RESEND_STOP, False),
        (StopAction.TERMINATE, True),
        (StopAction.KILL, True),
    ],
)
def test_only_a_new_phase_is_announced(action: StopAction, announced: bool) -> None:
    assert (action.announcement is not None) == announced


def test_requests_from_another_thread_arrive_in_order() -> None:
    requests = StopRequests(poll_s=0.01)

    def send() -> None:
        requests.put(signal.SIGINT)
        requests.put(signal.SIGTERM)

    async def receive() -> list[int]:
        got: list[int] = []
        with anyio.fail_after(5):
            async for signum in requests:
                got.append(signum)
                if len(got) == 2:
                    break
        return got

    thread = threading.Thread(target=send)
    thread.start()
    assert anyio.run(receive) == [signal.SIGINT, signal.SIGTERM]
    thread.join()
