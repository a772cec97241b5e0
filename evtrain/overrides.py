"""Command-line overrides of a job spec's fields: ``--stages 4 --steps 100 ...``.

`OVERRIDES` names each flag, the `evtrain.job.Job` field it sets and how its
string parses; `add_override_arguments` adds them to a parser,
`overrides_from_args` collects what was given, and `apply_overrides` applies
the strings to a loaded Job. Every stage process applies the same strings to
the spec it loads itself (`evtrain.spec`), so only strings travel.

Torch-free: the ``evtrain`` command builds its parser and collects the
overrides before it imports torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from evtrain.errors import SpecError
from evtrain.events import SPAN_MODES
from evtrain.schedule_names import Schedule

if TYPE_CHECKING:
    from evtrain.job import Job

__all__ = [
    "OVERRIDES",
    "add_override_arguments",
    "apply_overrides",
    "overrides_from_args",
]

log = structlog.get_logger()


def _parse_int(text: str) -> int:
    return int(text.strip())


def _parse_optional_int(text: str) -> int | None:
    return None if text.strip().lower() == "none" else _parse_int(text)


def _parse_optional_float(text: str) -> float | None:
    return None if text.strip().lower() == "none" else float(text.strip())


def _parse_balance(text: str) -> tuple[int, ...] | str | None:
    word = text.strip().lower()
    if word in ("auto", "none", ""):
        return None
    if word in ("params", "compute"):
        return word
    return tuple(int(part) for part in text.split(","))


def _parse_str(text: str) -> str:
    return text.strip()


@dataclass(frozen=True)
class Override:
    """One command-line override: ``--flag VALUE`` sets Job field ``field``."""

    flag: str
    field: str
    parse: Callable[[str], Any]
    expect: str
    help: str


OVERRIDES: dict[str, Override] = {
    o.flag.replace("-", "_"): o
    for o in (
        Override("stages", "stages", _parse_int, "an integer", "pipeline stages P"),
        Override(
            "dp",
            "data_parallel",
            _parse_int,
            "an integer",
            "data-parallel replicas D of the pipeline (P x D processes)",
        ),
        Override(
            "tp",
            "tensor_parallel",
            _parse_int,
            "an integer",
            "tensor-parallel ranks T of every stage (P x D x T processes; the layers split "
            "by the job's tp_plan or the model's own)",
        ),
        Override(
            "shard",
            "shard",
            _parse_str,
            "a mode",
            "what a stage's replicas split: none (DDP), optimizer, grads or full",
        ),
        Override(
            "microbatches",
            "num_microbatches",
            _parse_int,
            "an integer",
            "microbatches per batch M (must divide the batch size)",
        ),
        Override("schedule", "schedule", _parse_str, "a name", f"one of {', '.join(Schedule)}"),
        Override(
            "virtual-stages",
            "virtual_stages",
            _parse_int,
            "an integer",
            "model chunks V per stage for --schedule interleaved (P x V chunks; 2 for zbv)",
        ),
        Override(
            "steps",
            "max_steps",
            _parse_optional_int,
            "an integer or 'none'",
            "optimizer steps to train; without --epochs it replaces the spec's epochs",
        ),
        Override(
            "epochs",
            "epochs",
            _parse_optional_int,
            "an integer or 'none'",
            "epochs to train; without --steps it replaces the spec's max_steps",
        ),
        Override("batch-size", "batch_size", _parse_int, "an integer", "samples per batch"),
        Override("seed", "seed", _parse_int, "an integer", "seed for init and shuffling"),
        Override("run-dir", "run_dir", _parse_str, "a path", "run directory"),
        Override("device", "device", _parse_str, "a device", "cpu or cuda"),
        Override(
            "balance",
            "balance",
            _parse_balance,
            "comma-separated integers, 'params' or 'compute'",
            "layers per stage, e.g. 2,3, or 'params' / 'compute' to balance automatically",
        ),
        Override(
            "eval-every",
            "eval_every",
            _parse_optional_int,
            "an integer or 'none'",
            "evaluate every N steps",
        ),
        Override(
            "grad-clip",
            "grad_clip",
            _parse_optional_float,
            "a number or 'none'",
            "max global gradient L2 norm",
        ),
        Override(
            "spans",
            "microbatch_spans",
            _parse_str,
            "a mode",
            f"microbatch span events: {', '.join(SPAN_MODES)}",
        ),
        Override(
            "threads",
            "threads",
            _parse_optional_int,
            "an integer or 'none'",
            "torch threads per stage process",
        ),
    )
}
"""Override keys (the flag with ``_`` for ``-``) -> what they set."""

_BY_FIELD = {o.field: key for key, o in OVERRIDES.items()}


def apply_overrides(job: Job, overrides: Mapping[str, str | None]) -> Job:
    """A validated copy of ``job`` with command-line strings applied.

    Keys are `OVERRIDES` keys (``"stages"``, ``"microbatches"``,
    ``"batch_size"``, ``"spans"``, ...) or the Job field names they set
    (``"num_microbatches"``, ``"max_steps"``, ...); values are the raw
    strings; ``None`` values are ignored. Errors are `SpecError` naming the
    Job field and the flag. Two conveniences, logged when they apply:

    * ``steps`` without ``epochs`` (or the reverse) replaces the spec's whole
      stopping rule: the other one is cleared.
    * ``stages`` without ``balance`` drops a spec ``balance`` (or
      ``split_points``) that no longer fits, so the layers are balanced
      automatically.
    """
    changes: dict[str, Any] = {}
    flags: dict[str, str] = {}
    for key, text in overrides.items():
        if text is None:
            continue
        key_norm = key.replace("-", "_")
        if key_norm in _BY_FIELD:
            key_norm = _BY_FIELD[key_norm]
        override = OVERRIDES.get(key_norm)
        if override is None:
            raise SpecError(key, f"not an override; choose from {', '.join(sorted(OVERRIDES))}")
        try:
            value = override.parse(str(text))
        except ValueError:
            raise SpecError(
                override.field, f"--{override.flag} expects {override.expect}, got {text!r}"
            ) from None
        changes[override.field] = value
        flags[override.field] = f"--{override.flag} {text}"

    if "max_steps" in changes and "epochs" not in changes and job.epochs is not None:
        changes["epochs"] = None
        log.info("override clears the spec's epochs", max_steps=changes["max_steps"])
    if "epochs" in changes and "max_steps" not in changes and job.max_steps is not None:
        changes["max_steps"] = None
        log.info("override clears the spec's max_steps", epochs=changes["epochs"])
    if (
        "stages" in changes
        and "balance" not in changes
        and isinstance(job.balance, tuple)
        and len(job.balance) != changes["stages"]
    ):
        changes["balance"] = None
        log.info("override drops the spec's balance", stages=changes["stages"])
    if (
        "stages" in changes
        and job.split_points is not None
        and len(job.split_points) != changes["stages"] - 1
    ):
        changes["split_points"] = None
        log.info("override drops the spec's split_points", stages=changes["stages"])

    try:
        return job.with_overrides(**changes)
    except SpecError as exc:
        if exc.field in flags:
            raise SpecError(exc.field, f"{exc.message} (from {flags[exc.field]})") from None
        raise


def add_override_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--stages --microbatches --schedule --steps ...`` (see `OVERRIDES`) to ``parser``.

    All default to None (= keep the spec's value) and are kept as strings;
    `overrides_from_args` collects them for `apply_overrides`.
    """
    group = parser.add_argument_group("job spec overrides")
    for key, o in OVERRIDES.items():
        group.add_argument(
            f"--{o.flag}",
            dest=key,
            default=None,
            metavar=o.flag.split("-")[-1].upper(),
            help=f"{o.help} (sets {o.field})",
        )


def overrides_from_args(ns: argparse.Namespace) -> dict[str, str]:
    """The override strings given on the command line, keyed as `apply_overrides` expects."""
    return {key: value for key in OVERRIDES if (value := getattr(ns, key, None)) is not None}
