"""Where a bus lives: one user-facing address that expands to the broker's sockets.

``ipc:///tmp/evt-abc`` names a run directory (mode 0700) holding the socket files;
``tcp://HOST:PORT`` names five consecutive ports starting at PORT. Users pass the one
string (``--bus``); components ask it for the endpoint of the role they play.
"""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from evtrain.errors import UsageError

Role = Literal["events_in", "events_out", "commands_in", "commands_out", "state"]
ROLES: tuple[Role, ...] = ("events_in", "events_out", "commands_in", "commands_out", "state")
_IPC_NAMES: dict[Role, str] = {
    "events_in": "ev-in",
    "events_out": "ev-out",
    "commands_in": "cmd-in",
    "commands_out": "cmd-out",
    "state": "state",
}
# Linux's sun_path holds 108 bytes; libzmq fails the bind past ~107.
_MAX_IPC_PATH = 100


@dataclass(frozen=True)
class BusAddress:
    """The address of one bus: ``ipc://DIR`` or ``tcp://HOST:PORT``."""

    scheme: Literal["ipc", "tcp"]
    location: str
    port: int = 0

    @classmethod
    def parse(cls, text: str) -> BusAddress:
        """Parse ``ipc://DIR`` or ``tcp://HOST:PORT``; raise `UsageError` if malformed."""
        if text.startswith("ipc://"):
            directory = text[len("ipc://") :]
            if not directory.startswith("/"):
                raise UsageError(f"bad bus address {text!r}: ipc needs an absolute directory")
            address = cls("ipc", directory.rstrip("/") or "/")
            address._check_ipc_length()
            return address
        if text.startswith("tcp://"):
            host, sep, port = text[len("tcp://") :].rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535 - 4:
                raise UsageError(f"bad bus address {text!r}: expected tcp://HOST:PORT")
            return cls("tcp", host.strip("[]"), int(port))
        raise UsageError(f"bad bus address {text!r}: expected ipc://DIR or tcp://HOST:PORT")

    @classmethod
    def new_ipc(cls, parent: str | Path = "/tmp") -> BusAddress:
        """A fresh private run directory (mode 0700) for ipc sockets."""
        directory = tempfile.mkdtemp(prefix="evt-", dir=str(parent))
        os.chmod(directory, stat.S_IRWXU)
        address = cls("ipc", directory)
        address._check_ipc_length()
        return address

    @classmethod
    def new_tcp(cls, host: str = "127.0.0.1") -> BusAddress:
        """A tcp address on free ports of ``host`` (five consecutive ones)."""
        return cls("tcp", host, free_port_block(host, len(ROLES)))

    def endpoint(self, role: Role, *, bind: bool = False) -> str:
        """The ZeroMQ endpoint of ``role``; ``bind`` gives the broker's side."""
        if self.scheme == "ipc":
            return f"ipc://{self.location}/{_IPC_NAMES[role]}"
        host = self.location
        if ":" in host:
            host = f"[{host}]"
        if bind and host in ("localhost",):
            host = "127.0.0.1"
        return f"tcp://{host}:{self.port + ROLES.index(role)}"

    def prepare(self) -> None:
        """Create the ipc directory (mode 0700) if needed, before binding."""
        if self.scheme == "ipc":
            path = Path(self.location)
            path.mkdir(mode=stat.S_IRWXU, parents=True, exist_ok=True)

    def _check_ipc_length(self) -> None:
        longest = max(len(self.endpoint(role)) - len("ipc://") for role in ROLES)
        if longest > _MAX_IPC_PATH:
            raise UsageError(
                f"ipc directory {self.location!r} is too long for socket paths "
                f"({longest} > {_MAX_IPC_PATH} characters); use a shorter directory"
            )

    def __str__(self) -> str:
        if self.scheme == "ipc":
            return f"ipc://{self.location}"
        host = f"[{self.location}]" if ":" in self.location else self.location
        return f"tcp://{host}:{self.port}"


def free_port_block(host: str = "127.0.0.1", count: int = 1, attempts: int = 200) -> int:
    """The first of ``count`` consecutive ports that are free on ``host`` right now."""
    for _ in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        if all(_port_free(host, base + i) for i in range(count)):
            return base
    raise OSError(f"no block of {count} free ports found on {host}")


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
