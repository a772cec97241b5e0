"""Validation of built-in hook options: one clear `UsageError` naming the hook and option.

Options reach a hook as constructor keyword arguments, from ``--option k=v``
(JSON when it parses, else text) or from a job spec dict. These helpers accept
the natural spellings (``"10"`` from a shell is still 10) and reject the rest.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path

from evtrain.errors import UsageError

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def _bad(hook: str, option: str, expected: str, value: object) -> UsageError:
    return UsageError(f"hook {hook}: option '{option}' must be {expected}, got {value!r}")


def int_option(hook: str, option: str, value: object, *, minimum: int = 1) -> int:
    """An integer >= ``minimum`` (bools and fractional numbers are refused)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _bad(hook, option, f"an integer >= {minimum}", value)
    return value


def float_option(
    hook: str, option: str, value: object, *, minimum: float = 0.0, strict: bool = False
) -> float:
    """A finite number >= ``minimum`` (> with ``strict``)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise _bad(hook, option, "a number", value) from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(hook, option, "a number", value)
    if value < minimum or (strict and value == minimum):
        raise _bad(hook, option, f"a number {'>' if strict else '>='} {minimum:g}", value)
    return float(value)


def bool_option(hook: str, option: str, value: object) -> bool:
    """A bool, or one of the strings true/false, 1/0, yes/no (case-insensitive)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise _bad(hook, option, "true or false", value)


def choice_option(hook: str, option: str, value: object, choices: Iterable[str]) -> str:
    """One of ``choices`` (case-insensitive)."""
    allowed = tuple(choices)
    if isinstance(value, str) and value.lower() in allowed:
        return value.lower()
    raise _bad(hook, option, "one of " + ", ".join(allowed), value)


def str_option(hook: str, option: str, value: object) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value.strip():
        raise _bad(hook, option, "a non-empty string", value)
    return value


def path_option(hook: str, option: str, value: object) -> Path | None:
    """An optional filesystem path (None stays None)."""
    if value is None:
        return None
    if isinstance(value, Path):
        return value
    return Path(str_option(hook, option, value))


def size_option(hook: str, option: str, value: object) -> int | None:
    """A size in bytes: an integer, or text like ``"8GiB"``, ``"512MB"``, ``"1.5G"``."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match:
            number, prefix, binary = match.groups()
            base = 1024 if binary or not prefix else 1000
            size = int(float(number) * base ** _SIZE_POWERS[prefix.lower()])
            if size > 0:
                return size
    raise _bad(hook, option, "a size in bytes (e.g. 8000000000 or '8GiB')", value)
