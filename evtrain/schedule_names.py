"""The pipeline schedules a job can name, and the shapes (P, M, V) each accepts.

The job spec validates against these rules before anything starts;
`evtrain.stages.schedules` builds each schedule's instruction lists.
"""

from __future__ import annotations

from enum import StrEnum

from evtrain.errors import UsageError

__all__ = [
    "Schedule",
    "check_positive",
    "check_virtual_stages",
    "interleaved_rounds",
    "parse_schedule",
]


class Schedule(StrEnum):
    """The pipeline schedules evtrain knows; the value is the spec/CLI name."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    ZERO_BUBBLE = "zb"
    INTERLEAVED = "interleaved"
    ZBV = "zbv"

    @property
    def splits_backward(self) -> bool:
        """Whether the backward runs as `BackwardInput` + `BackwardWeight`."""
        return self in (Schedule.ZERO_BUBBLE, Schedule.ZBV)


def parse_schedule(schedule: str | Schedule) -> Schedule:
    """Turn a name (case-insensitive) into a `Schedule`; `UsageError` if unknown."""
    try:
        return Schedule(str(schedule).lower())
    except ValueError:
        names = ", ".join(s.value for s in Schedule)
        raise UsageError(f"unknown schedule {schedule!r}; choose one of: {names}") from None


def check_positive(name: str, value: int) -> None:
    """`UsageError` unless ``value`` is an integer >= 1."""
    # bool is an int subclass; True stages would be a bug, not a count.
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"{name} must be an integer >= 1, got {value!r}")


def interleaved_rounds(P: int, M: int) -> int:
    """Interleaved 1F1B's rounds of microbatches: ``max(1, M // P)``."""
    return max(1, M // P)


def check_virtual_stages(
    schedule: str | Schedule, num_stages: int, num_microbatches: int, virtual_stages: int
) -> None:
    """`UsageError` unless ``virtual_stages`` fits the schedule and shape.

    Interleaved needs V >= 2 chunks per stage and P >= 2 stages, and M a
    multiple of its rounds, ``max(1, M // P)`` (as torch's
    ScheduleInterleaved1F1B); zbv exactly V = 2 and P >= 2 (any M); the other
    schedules hold one chunk per stage.
    """
    kind = parse_schedule(schedule)
    check_positive("virtual_stages", virtual_stages)
    if kind is Schedule.ZBV:
        if virtual_stages != 2 or num_stages < 2:
            raise UsageError(
                "the zbv schedule places two model chunks on each of at least 2 stages: it "
                f"needs virtual_stages=2 and stages >= 2, got virtual_stages={virtual_stages} "
                f"and stages={num_stages}"
            )
        return
    if kind is not Schedule.INTERLEAVED:
        if virtual_stages != 1:
            raise UsageError(
                f"virtual_stages={virtual_stages} needs schedule 'interleaved' or 'zbv' "
                f"({kind.value} holds one model chunk per stage)"
            )
        return
    if virtual_stages < 2 or num_stages < 2:
        raise UsageError(
            "the interleaved schedule needs virtual_stages >= 2 and stages >= 2, got "
            f"virtual_stages={virtual_stages} and stages={num_stages} (with one chunk "
            "per stage, use 1f1b)"
        )
    rounds = interleaved_rounds(num_stages, num_microbatches)
    if num_microbatches % rounds:
        raise UsageError(
            f"the interleaved schedule runs microbatches in rounds of "
            f"{num_microbatches // rounds}: num_microbatches ({num_microbatches}) must be a "
            f"multiple of {rounds}, e.g. a multiple of the {num_stages} stages"
        )
