"""Helper processes and hooks for the bus tests.

Run as a script, it plays one side of a bus test in its own process::

    python tests/bus_procs.py publish --bus ADDR --source stage/0 --count 3000
    python tests/bus_procs.py stage --bus ADDR --stage 0

Imported (``helpers.bus_procs:Recorder`` with ``tests/`` on PYTHONPATH), it provides
hooks for ``evtrain hook``. Every role prints JSON lines on stdout; logs go to
stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from evtrain.bus.address import BusAddress
from evtrain.bus.commands import CommandLedger, CommandReceiver
from evtrain.bus.publisher import Publisher
from evtrain.bus.security import CurveConfig
from evtrain.bus.subscriber import Subscriber
from evtrain.events import Heartbeat, RunEnded, StepEnded
from evtrain.hooks.hook import Hook, on

TESTS_DIR = Path(__file__).resolve().parents[1]
SCRIPT = str(Path(__file__).resolve())


def env_with_tests() -> dict[str, str]:
    """The environment of a child process that imports modules from tests/."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    return env


async def probe_until_seen(
    sub: Subscriber, send: Callable[[Heartbeat], object], source: str, timeout: float
) -> None:
    """Send probe heartbeats through ``send`` until ``sub`` receives one from ``source``."""
    with anyio.fail_after(timeout):
        while True:
            send(Heartbeat(state="probe"))
            if any(m.source == source for m in await sub.receive(timeout=0.05)):
                return


async def connect(
    sub: Subscriber, address: BusAddress, *, curve: CurveConfig | None = None
) -> None:
    """Publish probes until ``sub`` receives one: its subscription is then live."""
    sub.subscribe("heartbeat")
    with Publisher(address.endpoint("events_in"), source="test/probe", curve=curve) as probe:
        await probe_until_seen(sub, probe.publish, "test/probe", timeout=10)


class Lines:
    """A process's stdout, read by a thread, so tests can wait for a line with a timeout."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self.proc = proc
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def get(self, timeout: float = 120.0) -> str:
        """The next line; AssertionError (with stderr) on timeout or end of output.

        The default timeout is a bound for a failure, generous for a busy machine.
        """
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line from {self.proc.args!r} within {timeout:g} s") from None
        if line is None:
            self._lines.put(None)  # the end stays the end
            raise AssertionError(f"{self.proc.args!r} ended its output: {self._stderr()}")
        return line

    def json(self, timeout: float = 120.0) -> Any:
        """The next line, parsed as JSON."""
        return json.loads(self.get(timeout))

    def _stderr(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return "(still running)"
        return f"exit {self.proc.returncode}, stderr: {self.proc.stderr.read()[-2000:]}"


class Buses:
    """``evtrain bus`` processes of one test; `stop_all` ends them with SIGTERM.

    A broker killed with SIGKILL (the ``procs`` fixture's last resort) cannot
    remove its run directory, so tests stop their brokers gracefully first.
    """

    def __init__(self, procs: Any) -> None:
        self.procs = procs
        self.started: list[tuple[subprocess.Popen[str], str]] = []

    def start(self, *args: str, **kwargs: Any) -> tuple[subprocess.Popen[str], str]:
        """Start a broker; returns the process and the address it printed first."""
        proc = self.procs.evtrain("--log-level", "warning", "bus", *args, **kwargs)
        address = Lines(proc).get()
        self.started.append((proc, address))
        return proc, address

    def stop_all(self) -> None:
        for proc, address in self.started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # in case a test left it stopped
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
            if address.startswith("ipc://"):
                shutil.rmtree(address[len("ipc://") :], ignore_errors=True)


def step_event(step: int, stage: int = 0) -> StepEnded:
    """A realistic step report (~240 bytes on the wire)."""
    return StepEnded(
        step=step,
        stage=stage,
        loss=2.5 / (1 + step),
        lr=3e-4,
        grad_norm=0.75,
        samples=256,
        duration_s=0.045,
        forward_s=0.012,
        backward_s=0.023,
        comm_wait_s=0.001,
        peak_memory_bytes=123_456_789,
    )


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of process ``pid`` (this one by default), from /proc."""
    with open(f"/proc/{pid or os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


class Recorder(Hook):
    """Records every StepEnded as (source, seq, step); writes them as JSON to ``path``.

    It stops once ``expect`` step events arrived, or at RunEnded.
    """

    name = "recorder"

    def __init__(self, *, path: str, expect: int = 0, priority: int | None = None) -> None:
        super().__init__(priority=priority)
        self.path = path
        self.expect = expect
        self.seen: list[tuple[str, int, int]] = []

    @on(StepEnded)
    def record(self, ev: StepEnded) -> None:
        self.seen.append((ev.source, ev.seq, ev.step))
        if self.expect and len(self.seen) >= self.expect:
            self.runner.stop()

    @on(RunEnded)
    def ended(self, ev: RunEnded) -> None:
        self.runner.stop()

    async def teardown(self) -> None:
        Path(self.path).write_text(json.dumps(self.seen))


def _publish(args: argparse.Namespace) -> None:
    """Publish ``count`` step events as fast as possible, timing every call."""
    address = BusAddress.parse(args.bus)
    pub = Publisher(address.endpoint("events_in"), source=args.source, hwm=args.hwm)
    events = [step_event(i, args.stage) for i in range(args.count)]
    if args.wait_start:
        print(json.dumps({"connected": True}), flush=True)
        sys.stdin.readline()
    clock = time.perf_counter
    calls = [0.0] * len(events)
    start = clock()
    for i, event in enumerate(events):
        t0 = clock()
        pub.publish(event)
        calls[i] = clock() - t0
    seconds = clock() - start
    calls.sort()
    stats: dict[str, Any] = {
        "published": args.count,
        "dropped": pub.dropped,
        "max_call_s": calls[-1],
        "p99_call_s": calls[int(len(calls) * 0.99)],
        "seconds": seconds,
    }
    print(json.dumps(stats), flush=True)
    if args.marker:
        # The parent says when: the marker must not be lost to the burst's drops.
        sys.stdin.readline()
        # Same topic as the burst: sequence numbers count per (source, topic).
        marker = step_event(args.count, args.stage)
        sent = pub.publish(marker)
        print(
            json.dumps({"marker_seq": marker.seq, "sent": sent, "dropped": pub.dropped}),
            flush=True,
        )
    if args.hold:
        # Closing starts a linger that a starved broker can outlast: stay
        # connected until the parent has seen everything arrive.
        sys.stdin.readline()
    pub.close(linger=5.0)


def _stage(args: argparse.Namespace) -> None:
    """Acknowledge every command, as a stage does at its step boundaries."""
    address = BusAddress.parse(args.bus)
    pub = Publisher(address.endpoint("events_in"), source=f"stage/{args.stage}")
    receiver = CommandReceiver(address.endpoint("commands_out"))
    ledger = CommandLedger(args.stage, pub)
    print(json.dumps({"ready": True}), flush=True)
    step = 0
    while True:
        for command in receiver.poll():
            if not ledger.admit(command):
                continue  # a retry: the ledger acknowledged it again
            ledger.ack(command, step=step, detail="done")
            print(json.dumps({"command": command.topic.decode(), "id": command.command_id}))
            sys.stdout.flush()
        step += 1
        time.sleep(0.005)


def main() -> None:
    from evtrain.logs import configure_logging

    configure_logging("console", "warning")  # structlog would print to stdout otherwise
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="role", required=True)
    pub = sub.add_parser("publish")
    pub.add_argument("--bus", required=True)
    pub.add_argument("--source", required=True)
    pub.add_argument("--stage", type=int, default=0)
    pub.add_argument("--count", type=int, required=True)
    pub.add_argument("--hwm", type=int, default=10_000)
    pub.add_argument("--marker", action="store_true")
    pub.add_argument("--wait-start", action="store_true")
    pub.add_argument("--hold", action="store_true", help="close after a line on stdin")
    pub.set_defaults(func=_publish)
    stage = sub.add_parser("stage")
    stage.add_argument("--bus", required=True)
    stage.add_argument("--stage", type=int, default=0)
    stage.set_defaults(func=_stage)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
