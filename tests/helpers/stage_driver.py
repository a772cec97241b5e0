"""Stage workers without the launcher: a driver process that runs elastic launches
of the stage entrypoint one after another, and a broker with a subscriber in the
test's process that sees their events (and sends them commands)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evtrain.bus import Broker, BusAddress, Publisher, Subscriber
from evtrain.events import Message
from evtrain.stages.worker import WorkerConfig

# Runs each WorkerConfig of argv[1] (JSON list of [nproc, config_json]) under
# elastic_launch in turn; exits 1 at the first failed launch. Workers fork from
# the agent's fork server, which has torch and the stage runtime imported
# (evtrain.launcher.forking): seconds less per worker on a 2-core machine.
DRIVER = """
import json, sys, uuid
import torch
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from evtrain.bus.address import free_port_block
from evtrain.launcher.elastic_agent import FORK_SERVER_PRELOAD
from evtrain.launcher.forking import start_fork_server
from evtrain.stages.entry import worker_main

if __name__ == "__main__":
    start_fork_server(FORK_SERVER_PRELOAD)
    for nproc, config in json.loads(sys.argv[1]):
        launch = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="c10d",
            rdzv_endpoint=f"127.0.0.1:{free_port_block()}", max_restarts=0,
            monitor_interval=0.05, run_id=uuid.uuid4().hex, start_method="forkserver",
        )
        try:
            elastic_launch(launch, worker_main)(config)
        except Exception as exc:
            print("LAUNCH FAILED:", type(exc).__name__, flush=True)
            sys.exit(1)
        print("LAUNCH OK", flush=True)
"""


class Bus:
    """A broker in this process, a subscriber to every event, a command publisher."""

    def __init__(self) -> None:
        self.address = BusAddress.new_ipc()
        self.broker = Broker(self.address)
        self.broker.start()
        self.sub = Subscriber(self.address.endpoint("events_out"))
        self.events: list[Message] = []
        self._commands: Publisher | None = None

    def pump(self) -> list[Message]:
        batch = self.sub.drain()
        self.events.extend(batch)
        return batch

    def wait_for(self, predicate: Callable[[Message], bool], timeout: float) -> Message:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            self.pump()
            for msg in self.events[seen:]:
                if predicate(msg):
                    return msg
            seen = len(self.events)
            time.sleep(0.005)
        raise AssertionError(f"no matching event within {timeout} s; got {self.summary()}")

    def wait_count(
        self, kind: type[Message], count: int, run_id: str | None = None, timeout: float = 60.0
    ) -> None:
        """Pump until ``count`` events of ``kind`` (of ``run_id``) arrived.

        Waiting for the last events a run publishes, rather than for a quiet
        spell, keeps a test right on a machine too busy to forward promptly."""
        deadline = time.monotonic() + timeout
        while len(self.of(kind, run_id)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{len(self.of(kind, run_id))} of {count} {kind.__name__} ({run_id}) "
                    f"within {timeout} s; got {self.summary()}"
                )
            self.pump()
            time.sleep(0.01)

    def send(self, command: Message) -> None:
        if self._commands is None:
            self._commands = Publisher(self.address.endpoint("commands_in"), source="hook/test")
        self._commands.publish(command)

    def of(self, kind: type[Message], run_id: str | None = None) -> list:  # type: ignore[type-arg]
        return [
            e for e in self.events if isinstance(e, kind) and (run_id is None or e.run_id == run_id)
        ]

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for e in self.events:
            counts[type(e).__name__] = counts.get(type(e).__name__, 0) + 1
        return str(counts)

    def close(self) -> None:
        if self._commands is not None:
            self._commands.close(linger=0)
        self.sub.close()
        self.broker.stop()
        shutil.rmtree(self.address.location, ignore_errors=True)


def start_driver(procs: Any, runs: list[tuple[int, WorkerConfig]]) -> subprocess.Popen:  # type: ignore[type-arg]
    payload = json.dumps([[nproc, cfg.encode()] for nproc, cfg in runs])
    env = {**os.environ, "EVTRAIN_LOG_LEVEL": "warning", "PYTHONUNBUFFERED": "1"}
    return procs.python(
        "-c", DRIVER, payload, env=env, cwd=str(Path(__file__).resolve().parents[2])
    )


def finish(proc: subprocess.Popen, timeout: float, bus: Bus) -> tuple[int, str]:  # type: ignore[type-arg]
    """The driver's exit status and output; ``bus`` is pumped meanwhile, so no
    event waits in the broker's queue for the subscriber."""
    result: list[tuple[str, str]] = []
    reader = threading.Thread(target=lambda: result.append(proc.communicate()), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while reader.is_alive() and time.monotonic() < deadline:
        bus.pump()
        reader.join(0.02)
    if reader.is_alive():
        os.killpg(proc.pid, signal.SIGKILL)
        reader.join()
        out, err = result[0]
        raise AssertionError(f"launch did not finish in {timeout} s:\n{out}\n{err[-4000:]}")
    out, err = result[0]
    return proc.returncode, out + err
