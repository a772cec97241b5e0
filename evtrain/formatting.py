"""Human-readable values for log lines (sizes, durations, short floats) and safe text.

Every string that comes from an event (a run name, an error, a metric name)
was written by whoever published it. `safe_text` is the one way such text
reaches a terminal: control characters and other invisible code points
(escape sequences, carriage returns, bidirectional overrides) are shown as
visible escapes (``\\x1b``, ``\\r``, ``\\u202e``), so an event cannot move
the cursor, recolour, retitle or clear the terminal that shows it.
The number formatters accept any float (NaN and infinities print as such).
"""

from __future__ import annotations

import datetime
import math

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    named = _NAMED_ESCAPES.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def safe_text(value: object, limit: int | None = None) -> str:
    """``value`` as text a terminal shows literally, cut to ``limit`` characters.

    Printable text passes unchanged (spaces included); everything else
    Unicode does not call printable becomes a visible escape.
    """
    text = value if isinstance(value, str) else str(value)
    if limit is not None and len(text) > limit:
        text = text[: max(0, limit - 3)] + "..."
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def safe_lines(text: str, limit: int | None = None) -> str:
    """Like `safe_text` line by line: newlines stay newlines (for tracebacks)."""
    return "\n".join(safe_text(line, limit) for line in text.splitlines())


def fmt_bytes(size: float | None) -> str:
    """``1536`` -> ``"1.5KiB"``; None -> ``"-"``."""
    if size is None:
        return "-"
    value = float(size)
    if not math.isfinite(value):
        return str(value)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


_MAX_TIMEDELTA_S = datetime.timedelta.max.total_seconds()


def fmt_duration(seconds: float | None) -> str:
    """``83.2`` -> ``"0:01:23"`` (detectron2's ETA format); None -> ``"-"``."""
    if seconds is None:
        return "-"
    if not math.isfinite(seconds):
        return str(float(seconds))
    if abs(seconds) >= _MAX_TIMEDELTA_S:  # past what timedelta holds (2.7 million years)
        return f"{seconds:.3g}s"
    return str(datetime.timedelta(seconds=round(seconds)))


def short(value: float | None, digits: int = 4) -> float | None:
    """A float rounded to ``digits`` significant digits (still a number, for JSON logs)."""
    if value is None:
        return None
    return float(f"{value:.{digits}g}")


def per_stage(values: dict[int, str]) -> str:
    """``{0: "1.0MiB", 1: "2.0MiB"}`` -> ``"s0=1.0MiB s1=2.0MiB"``."""
    return " ".join(f"s{stage}={values[stage]}" for stage in sorted(values))
