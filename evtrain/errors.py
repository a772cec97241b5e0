"""Error types shared across evtrain.

`UsageError` marks a mistake the user can fix (bad option, bad spec, unknown hook
path). The CLI prints it as one line and exits with status 2 instead of showing a
traceback.
"""

from __future__ import annotations


class UsageError(Exception):
    """A mistake the user can fix; the CLI prints it as one line and exits 2."""


class SpecError(UsageError):
    """A bad field in a job spec or a command-line override of it."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"job spec field '{field}': {message}")
