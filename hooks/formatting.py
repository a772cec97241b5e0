"""Human-readable values for log lines (sizes, durations, short floats)."""

from __future__ import annotations

import datetime

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(size: float | None) -> str:
    """``1536`` -> ``"1.5KiB"``; None -> ``"-"``."""
    if size is None:
        return "-"
    value = float(size)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_duration(seconds: float | None) -> str:
    """``83.2`` -> ``"0:01:23"`` (detectron2's ETA format); None -> ``"-"``."""
    if seconds is None:
        return "-"
    return str(datetime.timedelta(seconds=round(seconds)))


def short(value: float | None, digits: int = 4) -> float | None:
    """A float rounded to ``digits`` significant digits (still a number, for JSON logs)."""
    if value is None:
        return None
    return float(f"{value:.{digits}g}")


def per_stage(values: dict[int, str]) -> str:
    """``{0: "1.0MiB", 1: "2.0MiB"}`` -> ``"s0=1.0MiB s1=2.0MiB"``."""
    return " ".join(f"s{stage}={values[stage]}" for stage in sorted(values))
