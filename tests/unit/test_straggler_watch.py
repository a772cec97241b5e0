"""Which stage or replica is a straggler, from the steps' busy times (`StragglerWatch`).

Synthetic `StepEnded` events; the launches that slow a stage for real are in
`tests/integration/test_stragglers.py`.
"""

from __future__ import annotations

from collections.abc import Callable

from evtrain.events import StepEnded, StragglerReported, TensorRankStepEnded
from evtrain.launcher.stragglers import BASELINE, SLOWER, WARMUP, WINDOW, StragglerWatch

Busy = Callable[[int, int, int], float]
"""(step, stage, replica) -> seconds busy."""


def run(watch: StragglerWatch, steps: int, busy: Busy) -> list[StragglerReported]:
    changes = []
    for step in range(1, steps + 1):
        for stage in range(watch.stages):
            for replica in range(watch.replicas):
                b = busy(step, stage, replica)
                # The others wait on the slowest: a step lasts as long as the busiest.
                longest = max(
                    busy(step, s, r) for s in range(watch.stages) for r in range(watch.replicas)
                )
                ev = StepEnded(
                    step=step,
                    stage=stage,
                    replica=replica,
                    duration_s=longest,
                    forward_s=b / 3,
                    comm_wait_s=longest - b,
                )
                changes += watch.step_ended(ev)
    return changes


def test_an_even_run_names_nobody_and_an_uneven_split_is_no_straggler() -> None:
    # Stage 2 always does twice the work of the others: the split, not a straggler.
    def uneven(step: int, stage: int, replica: int) -> float:
        return 0.02 if stage == 2 else 0.01 + 0.001 * (step % 3)

    assert run(StragglerWatch(3, 1), 60, uneven) == []
    assert run(StragglerWatch(2, 2), 60, lambda step, s, r: 0.01 + 0.002 * ((step + r) % 2)) == []


def test_a_stage_that_slows_down_is_named_within_a_window_and_cleared_when_it_recovers() -> None:
    slow_from, fast_again = 20, 40

    def busy(step: int, stage: int, replica: int) -> float:
        return 0.05 if stage == 1 and slow_from <= step < fast_again else 0.01

    changes = run(StragglerWatch(3, 1), 60, busy)
    assert [(c.stage, c.whole_stage, c.straggling) for c in changes] == [
        (1, True, True),
        (1, True, False),
    ]
    found, cleared = changes
    assert slow_from < found.step <= slow_from + WINDOW
    assert found.slowdown > SLOWER
    assert fast_again < cleared.step <= fast_again + WINDOW
    assert found.describe() == (
        f"stage 1 is a straggler from step {found.step}: relative to the other stages, "
        f"its steps take {found.slowdown:.1f} times as long as at the start"
    )


def test_a_machine_wide_slowdown_names_nobody() -> None:
    def busy(step: int, stage: int, replica: int) -> float:
        return 0.05 if step >= 20 else 0.01

    assert run(StragglerWatch(3, 1), 50, busy) == []


def test_a_slow_replica_is_named_against_its_stage_from_the_first_steps() -> None:
    def busy(step: int, stage: int, replica: int) -> float:
        return 0.03 if (stage, replica) == (1, 1) else 0.01

    changes = run(StragglerWatch(2, 2), 30, busy)
    named = [(c.stage, c.replica, c.whole_stage) for c in changes if c.straggling]
    assert named == [(1, 1, False)]
    # No baseline to learn: it is named once the first window after the warm-up is full.
    assert changes[0].step == WARMUP + WINDOW
    assert "stage 1 replica 1 is a straggler" in changes[0].describe()
    assert (
        "its work takes 3.0 times as long as its stage's other replicas'" in changes[0].describe()
    )


def test_noise_below_the_threshold_and_lost_events_name_nobody() -> None:
    watch = StragglerWatch(2, 1)

    def noisy(step: int, stage: int, replica: int) -> float:
        return 0.01 * (1.8 if step % 2 and stage == 0 else 1.0)

    assert run(watch, 40, noisy) == []
    # A step whose other stage's event never came is not judged.
    assert watch.step_ended(StepEnded(step=41, stage=0, duration_s=9.0)) == []
    assert BASELINE > 0


def test_a_slower_part_that_costs_the_step_little_is_no_straggler() -> None:
    # Replica 1's forwards take 3x its peer's, but they are 1 % of a 1-second step.
    watch = StragglerWatch(1, 2)
    changes = []
    for step in range(1, 40):
        for replica in (0, 1):
            forward = 0.003 if replica else 0.001
            ev = StepEnded(step=step, stage=0, replica=replica, duration_s=1.0, forward_s=forward)
            changes += watch.step_ended(ev)
    assert changes == []


def tensor_run(
    watch: StragglerWatch, steps: int, cpu: Callable[[int, int, int, int], float]
) -> list[StragglerReported]:
    """Steps on the CPU: each process's CPU seconds from ``cpu(step, stage, replica, tp)``;
    tensor rank 0 publishes `StepEnded`, the others `TensorRankStepEnded`."""
    changes = []
    places = [
        (s, r, t)
        for s in range(watch.stages)
        for r in range(watch.replicas)
        for t in range(watch.tensor_ranks)
    ]
    for step in range(1, steps + 1):
        longest = max(cpu(step, *place) for place in places)
        for stage, replica, tp in places:
            times = {"duration_s": longest, "cpu_s": cpu(step, stage, replica, tp)}
            ev: StepEnded | TensorRankStepEnded
            if tp:
                ev = TensorRankStepEnded(step=step, stage=stage, replica=replica, tp=tp, **times)
            else:
                ev = StepEnded(step=step, stage=stage, replica=replica, **times)
            changes += watch.step_ended(ev)
    return changes


def test_a_slow_tensor_rank_is_named_alone_against_its_replicas_other_tensor_ranks() -> None:
    def cpu(step: int, stage: int, replica: int, tp: int) -> float:
        return 0.03 if (stage, replica, tp) == (1, 1, 1) else 0.01 + 0.001 * (step % 2)

    changes = tensor_run(StragglerWatch(2, 2, tensor_ranks=2), 30, cpu)
    named = [(c.stage, c.replica, c.tp, c.whole_stage) for c in changes if c.straggling]
    # Not its replica (tensor rank 0 is as fast as the others), not its stage: the rank.
    assert named == [(1, 1, 1, False)]
    assert changes[0].step == WARMUP + WINDOW
    assert (
        changes[0]
        .describe()
        .startswith(
            f"stage 1 replica 1 tensor rank 1 is a straggler from step {WARMUP + WINDOW}: "
            "its work takes"
        )
    )
    assert "its replica's other tensor ranks'" in changes[0].describe()


def test_a_step_waits_for_every_tensor_rank_and_an_even_run_names_nobody() -> None:
    watch = StragglerWatch(1, 1, tensor_ranks=4)
    assert tensor_run(watch, 40, lambda step, s, r, t: 0.01 + 0.002 * ((step + t) % 2)) == []
    watch = StragglerWatch(1, 1, tensor_ranks=4)
    changes = tensor_run(watch, 30, lambda step, s, r, t: 0.05 if t == 2 else 0.01)
    assert [(c.tp, c.straggling) for c in changes] == [(2, True)]
    # Tensor ranks 1 and 2 far slower, but rank 3's events never come: no step is judged.
    quiet = StragglerWatch(1, 1, tensor_ranks=4)
    for step in range(1, 30):
        for tp in range(3):
            ev = TensorRankStepEnded(step=step, stage=0, tp=tp, cpu_s=0.05) if tp else None
            assert quiet.step_ended(ev or StepEnded(step=step, stage=0, cpu_s=0.01)) == []


def test_on_a_device_a_slow_tensor_rank_is_named_as_its_replica() -> None:
    """Without CPU times, tensor ranks' forwards wait for each other inside their
    all-reduces: the one a slow tensor rank slows is its replica, against the others."""
    watch = StragglerWatch(1, 2, tensor_ranks=2)
    changes = []
    for step in range(1, 30):
        for replica in (0, 1):
            forward = 0.03 if replica == 1 else 0.01  # its tensor rank 1 is the slow one
            for tp in (0, 1):
                times = {"duration_s": 0.1, "forward_s": forward}
                ev: StepEnded | TensorRankStepEnded
                if tp:
                    ev = TensorRankStepEnded(step=step, stage=0, replica=replica, tp=tp, **times)
                else:
                    ev = StepEnded(step=step, stage=0, replica=replica, **times)
                changes += watch.step_ended(ev)
    assert [(c.replica, c.tp, c.straggling) for c in changes] == [(1, None, True)]
