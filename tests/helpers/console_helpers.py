"""What a terminal shows of a program's output, and running a program on a pseudo-terminal.

`Terminal` replays output the way a terminal would for what the launcher's
console (rich) sends: text, newlines, carriage returns, cursor up (``ESC[nA``)
and erase line (``ESC[2K``); every other escape sequence (colours, cursor
visibility) is stripped. Lines are taken as unbounded (no wrapping), which is
what a wide terminal shows.

`run_in_pty` runs a command with stdin, stdout and stderr on a fresh
pseudo-terminal (python's `pty`) and collects everything it writes.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import termios
import time
from collections.abc import Mapping

from conftest import ProcessGroup

_TOKEN = re.compile(r"\x1b\[([0-?]*)([ -/]*)([@-~])|\x1b[@-Z\\-_]|\r|\n")
"""An escape sequence (CSI with its parameters, or a two-byte one), a CR or a LF."""

LOG_LINE = re.compile(
    r"\d\d:\d\d:\d\d \[(debug|info|warning|error|critical)\s*\]|: (warning|error): |\"level\": ?\""
)
"""Log text: a structlog console or JSON line, a launcher's warning or error line."""
PROGRESS_TEXT = re.compile(r"samples/s|steps/s  ETA|ETA \d|━")
"""Text only a progress line or bar holds (a summary's rate is ``(N steps/s)``)."""


class Terminal:
    """Replays output as a terminal shows it (see the module docstring).

    ``screen`` is what is on the screen at the end; ``finished`` every line as
    it stood when a newline left it (a line later erased or rewritten by the
    live display still counts).
    """

    def __init__(self, raw: str) -> None:
        self.screen = [""]
        self.finished: list[str] = []
        self._row = self._col = 0
        pos = 0
        for match in _TOKEN.finditer(raw):
            self._write(raw[pos : match.start()])
            pos = match.end()
            self._control(match)
        self._write(raw[pos:])

    def _write(self, text: str) -> None:
        line = self.screen[self._row].ljust(self._col)
        self.screen[self._row] = line[: self._col] + text + line[self._col + len(text) :]
        self._col += len(text)

    def _control(self, match: re.Match[str]) -> None:
        if match.group(0) == "\n":
            self.finished.append(self.screen[self._row].rstrip())
            self._row, self._col = self._row + 1, 0  # the terminal's ONLCR made it CR LF
            if self._row == len(self.screen):
                self.screen.append("")
        elif match.group(0) == "\r":
            self._col = 0
        elif match.group(3) == "A":
            self._row = max(0, self._row - int(match.group(1) or "1"))
        elif match.group(3) == "K" and match.group(1) == "2":
            self.screen[self._row] = ""

    def lines(self) -> list[str]:
        """The non-empty lines on the screen."""
        return [line.rstrip() for line in self.screen if line.strip()]


def run_in_pty(
    procs: ProcessGroup,
    cmd: list[str],
    *,
    env: Mapping[str, str],
    timeout: float,
    columns: int = 200,
) -> tuple[int, str]:
    """Run ``cmd`` on a pseudo-terminal ``columns`` wide; its exit status and output."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    try:
        proc = procs.start(*cmd, stdin=slave, stdout=slave, stderr=slave, env=dict(env))
    finally:
        os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal is gone
                break
            if not data:
                break
            chunks.append(data)
        else:
            raise AssertionError(f"{cmd} did not end within {timeout} s")
        status = proc.wait(timeout=30)
    finally:
        os.close(master)
    return status, b"".join(chunks).decode(errors="replace")
