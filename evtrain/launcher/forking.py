"""One import of torch per launch: the agent and the fork server are forks, not fresh interpreters.

Importing torch, ``torch._dynamo`` (every optimizer's first use imports it)
and the stage runtime costs several CPU seconds per process, more than a
small job's whole training. A launch needs torch in three processes: the
launcher (the spec builds modules), the elastic agent and the fork server
that elastic's ``forkserver`` start method forks every worker from. Each
used to be a fresh interpreter importing it again; now:

* `fork_agent`: the ``evtrain`` command forks the agent from itself once it
  has imported torch, instead of starting ``python -m evtrain.launcher.elastic_agent``.
  Only when the launcher's process is its own (the CLI): inside an
  application (`evtrain.tools.api`) that may have threads or may have computed with
  torch, the agent is a fresh interpreter as before.
* `start_fork_server`: multiprocessing's fork server is a fork of the agent
  instead of an interpreter the stdlib starts with exec. The protocol it
  serves is the stdlib's own (``multiprocessing.forkserver.main``); only its
  registration is done here, where the stdlib would have done it. Where a
  Python version lays the server out otherwise, the stdlib's own start is
  used.

Forking is safe from a process that has no lock another thread could hold
and no compute thread pool a child would inherit half-built: both forks
happen before the process computed anything with torch. The launcher's only
other thread then is its output relay, blocked reading a pipe the agent
never touches (the child closes every inherited descriptor it does not use).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

__all__ = ["ForkedChild", "can_fork_here", "fork_agent", "start_fork_server"]


def start_fork_server(preload: Sequence[str]) -> None:
    """Make multiprocessing's fork server a fork of this process, importing ``preload`` there.

    Call it before this process starts any thread: the server forks every
    worker from the state it inherits. The imports run in the server, beside
    whatever this process does next.
    """
    import multiprocessing
    from multiprocessing import connection, forkserver, resource_tracker, util

    server = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", ...) is not None:
        multiprocessing.set_forkserver_preload(list(preload))
        forkserver.ensure_running()
        return
    # Started before the fork, so that the workers share this process's tracker.
    resource_tracker.ensure_running()
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    listener.bind(address)
    if not util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)
    listener.listen()
    # Every client holds the write end; the server ends when the last one closes it.
    alive_r, alive_w = os.pipe()
    pid = _fork()
    if pid == 0:
        status = 0
        try:
            os.close(alive_w)
            # As in a fresh interpreter: the workers install their own handlers.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            forkserver.main(listener.fileno(), alive_r, list(preload))
        except SystemExit:
            pass  # the last client is gone
        except BaseException:
            status = 1
        finally:
            os._exit(status)
    os.close(alive_r)
    listener.close()
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


def can_fork_here() -> bool:
    """Whether this process may fork the agent: it has not imported torch nor started a thread.

    Not yet imported means nothing was computed with it; no thread means no
    lock held elsewhere. True in the ``evtrain`` command (`fork_agent`).
    """
    return "torch" not in sys.modules and threading.active_count() == 1 and hasattr(os, "fork")


class ForkedChild:
    """A forked child, seen as much like ``subprocess.Popen`` as the launcher uses it."""

    def __init__(self, pid: int, stdin: IO[bytes]) -> None:
        self.pid = pid
        self.stdin: IO[bytes] | None = stdin
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit status (negative: the signal that ended it), or None while it runs."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid != 0:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        """Its exit status; ``subprocess.TimeoutExpired`` when it runs ``timeout`` s longer."""
        deadline = time.monotonic() + timeout
        while (status := self.poll()) is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return status


def fork_agent(
    run: Callable[[], int], *, env: Mapping[str, str], output_fd: int | None
) -> ForkedChild:
    """Fork a child that runs ``run`` and exits with its status.

    The child leads a session of its own (as ``start_new_session``), reads
    the returned `ForkedChild`'s ``stdin`` pipe as its stdin, writes to
    ``output_fd`` (None: ours), takes ``env`` as its environment and keeps no
    other inherited descriptor (as ``close_fds``).
    """
    stdin_r, stdin_w = os.pipe()
    pid = _fork()
    if pid != 0:
        os.close(stdin_r)
        return ForkedChild(pid, os.fdopen(stdin_w, "wb"))
    status = 1
    try:
        os.setsid()
        os.dup2(stdin_r, 0)
        if output_fd is not None:
            os.dup2(output_fd, 1)
            os.dup2(output_fd, 2)
        _close_inherited(keep=(0, 1, 2))
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin
        os.environ.clear()
        os.environ.update(env)
        status = run()
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    raise AssertionError("unreachable")


def _fork() -> int:
    # Buffered output would be written twice, once by each process.
    sys.stdout.flush()
    sys.stderr.flush()
    return os.fork()


def _close_inherited(keep: Sequence[int]) -> None:
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 4096))
    for fd in fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, already gone
