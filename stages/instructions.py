"""Pipeline instructions: what one stage does, step by step, as plain data.

A schedule (see `evtrain.stages.schedules`) turns (schedule, stage, P, M) into a
list of these; the stage executor runs the list and the simulator
(`evtrain.stages.simulator`) checks it without any process. Every instruction
is a frozen, hashable msgspec Struct, tagged by class name so a list can be
msgpack-encoded (e.g. into an event) and decoded back as `Instruction`.

They print compactly for debugging — `L3 RA3 F3 SA3 RG3 B3 SG3 RED OPT`, with
a split backward `RG3 I3 SG3 ... W3`, on a process's second model chunk
`RA3@1 F3@1 SA3@1` — see `format_instructions`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import msgspec

__all__ = [
    "Backward",
    "BackwardInput",
    "BackwardWeight",
    "Forward",
    "Instruction",
    "LoadMicrobatch",
    "MicrobatchInstruction",
    "OptimizerStep",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "SendActivation",
    "SendGrad",
    "format_instructions",
]


class _Base(msgspec.Struct, frozen=True, tag=True):
    """Shared base: a short `code` used by `str()`/`repr()`."""

    code: ClassVar[str] = "?"

    def __repr__(self) -> str:
        return self.code

    __str__ = __repr__


class _MicrobatchInstruction(_Base, frozen=True):
    """An instruction about one microbatch, numbered 0..M-1 within the step.

    ``chunk`` is the model chunk it applies to, 0..V-1 among the process's
    virtual stages (interleaved and zbv; always 0 otherwise). It prints as
    ``F3@1`` (forward of microbatch 3 on chunk 1).
    """

    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        where = f"@{self.chunk}" if self.chunk else ""
        return f"{self.code}{self.microbatch}{where}"

    __str__ = __repr__


class LoadMicrobatch(_MicrobatchInstruction, frozen=True):
    """Take microbatch `microbatch` from the data: inputs on the first stage,
    targets on the last (both when P=1)."""

    code: ClassVar[str] = "L"


class RecvActivation(_MicrobatchInstruction, frozen=True):
    """Receive the previous stage's output for the microbatch (blocking)."""

    code: ClassVar[str] = "RA"


class Forward(_MicrobatchInstruction, frozen=True):
    """Run this stage's layers forward; the last stage also computes the loss."""

    code: ClassVar[str] = "F"


class SendActivation(_MicrobatchInstruction, frozen=True):
    """Send this stage's output for the microbatch to the next stage (non-blocking)."""

    code: ClassVar[str] = "SA"


class RecvGrad(_MicrobatchInstruction, frozen=True):
    """Receive the gradient of this stage's output from the next stage (blocking)."""

    code: ClassVar[str] = "RG"


class Backward(_MicrobatchInstruction, frozen=True):
    """Back-propagate the microbatch through this stage, accumulating gradients."""

    code: ClassVar[str] = "B"


class BackwardInput(_MicrobatchInstruction, frozen=True):
    """The first half of a split backward: the gradient of this stage's input
    only (what `SendGrad` sends upstream); the weight gradients wait for
    `BackwardWeight`. Zero-bubble schedules run it where 1F1B runs `Backward`."""

    code: ClassVar[str] = "I"


class BackwardWeight(_MicrobatchInstruction, frozen=True):
    """The second half of a split backward: the microbatch's weight gradients,
    from what its `BackwardInput` kept. Not on the critical path, so a
    schedule places it in what would otherwise be a bubble."""

    code: ClassVar[str] = "W"


class SendGrad(_MicrobatchInstruction, frozen=True):
    """Send the gradient of this stage's input to the previous stage (non-blocking)."""

    code: ClassVar[str] = "SG"


class ReduceGrads(_Base, frozen=True):
    """Make this step's gradients final: averaged over the stage's data-parallel
    replicas, summed over the stages holding a tied weight. Comes after the
    stage's last backward, before `OptimizerStep`."""

    code: ClassVar[str] = "RED"


class OptimizerStep(_Base, frozen=True):
    """Apply the accumulated gradients: the step boundary."""

    code: ClassVar[str] = "OPT"


MicrobatchInstruction = (
    LoadMicrobatch
    | RecvActivation
    | Forward
    | SendActivation
    | RecvGrad
    | Backward
    | BackwardInput
    | BackwardWeight
    | SendGrad
)
"""The instructions about one microbatch (they have ``microbatch``)."""

Instruction = MicrobatchInstruction | ReduceGrads | OptimizerStep
"""Any pipeline instruction (a tagged union, decodable with msgspec)."""


def format_instructions(instructions: Iterable[Instruction]) -> str:
    """Render a program compactly, e.g. ``"L0 F0 SA0 RG0 B0 OPT"``."""
    return " ".join(map(str, instructions))
