"""Hostile frames at every endpoint of a real ``evtrain bus`` while real traffic flows.

A seeded generator sends thousands of frames the bus must survive: random frame
counts and sizes up to 10 MB, garbage msgpack, msgpack that declares huge
lengths, well-formed events with absurd or non-finite values and escape
sequences, long and malformed subscriptions and other upstream garbage,
subscribers that come and go, subscribers and state clients that never read,
snapshot floods, and bytes that are not even ZMTP. Meanwhile a real `Publisher`
sends step events to a real hook process and commands to a real
`CommandReceiver`, at a modest rate: every one must arrive, in order.

Bounds: the broker idles at ~35 MiB and stays under `BROKER_RSS_LIMIT` (~90 MiB
measured); the hook idles at ~35 MiB and stays under `HOOK_RSS_LIMIT`. Both
processes are alive at the end, and the broker's counters show it dropped the
garbage rather than passing it on.
"""

from __future__ import annotations

import json
import math
import random
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
from helpers.bus_procs import Buses, env_with_tests, rss_bytes

from evtrain.bus.address import ROLES, BusAddress
from evtrain.bus.broker import fetch_stats
from evtrain.bus.commands import CommandReceiver
from evtrain.bus.limits import MAX_FRAME_BYTES, SUBSCRIPTION_PREFIXES, TOPICS
from evtrain.bus.publisher import Publisher
from evtrain.bus.state_service import fetch_snapshot
from evtrain.events import (
    EvaluateNow,
    Heartbeat,
    HookError,
    HookStarted,
    MicrobatchForward,
    RunEnded,
    StageStarted,
    StepEnded,
    encode,
)
from evtrain.run_state import MAX_HOOKS

BROKER_RSS_LIMIT = 200 * 2**20
"""The broker's resident memory, whatever the fuzz does."""
HOOK_RSS_LIMIT = 200 * 2**20
"""The hook process's resident memory."""

ACTIONS = 100_000  # hostile actions, most of them several frames
LEGIT_RATE = 400.0  # legitimate step events per second, during the whole fuzz
LEGIT_SOURCE = "stage/legit"  # no hostile message uses it
SEED = 20_261_201
LONG_SUBSCRIBER = (
    "import zmq,os,time,sys;s=zmq.Context().socket(zmq.SUB);s.connect(sys.argv[1]);"
    "s.setsockopt(zmq.SUBSCRIBE,os.urandom(200000));time.sleep(0.5);os._exit(0)"
)
"""A subscriber of a 200 KB topic that leaves; in its own process, which it would crash."""


class Sampler:
    """Samples the resident memory of some processes until stopped; keeps the peaks."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.peak = dict.fromkeys(pids, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], rss_bytes(pid))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Legit:
    """Real traffic beside the fuzz: step events to the hook, commands to a stage."""

    def __init__(self, address: BusAddress) -> None:
        self.address = address
        self.steps = 0
        self.commands: list[str] = []
        self.received: list[str] = []
        self.dropped = 0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._publish, daemon=True),
            threading.Thread(target=self._receive, daemon=True),
        ]
        self._receiver_ready = threading.Event()
        self.errors: list[BaseException] = []

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _publish(self) -> None:
        try:
            events = Publisher(self.address.endpoint("events_in"), source=LEGIT_SOURCE)
            commands = Publisher(self.address.endpoint("commands_in"), source="hook/legit")
            self._receiver_ready.wait(20)
            start = time.monotonic()
            while not self._stop.is_set():
                due = int((time.monotonic() - start) * LEGIT_RATE)
                while self.steps < due:
                    events.publish(StepEnded(step=self.steps, stage=0, loss=1.0, samples=8))
                    self.steps += 1
                    if self.steps % 20 == 0:
                        command = EvaluateNow(command_id=f"legit-{len(self.commands)}")
                        self.commands.append(command.command_id)
                        commands.publish(command)
                time.sleep(0.005)
            events.publish(RunEnded(status="completed", reason="fuzz over"))
            self.dropped = events.dropped + commands.dropped
            events.close()
            commands.close()
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)

    def _receive(self) -> None:
        try:
            receiver = CommandReceiver(self.address.endpoint("commands_out"))
            # Commands are retried until acknowledged in real use; here the first
            # must not be lost to a subscription still on its way.
            probe = Publisher(self.address.endpoint("commands_in"), source="hook/probe")
            deadline = time.monotonic() + 20
            while not receiver.poll():
                assert time.monotonic() < deadline, "commands never reached the receiver"
                probe.publish(EvaluateNow(command_id="probe"))
                time.sleep(0.02)
            probe.close()
            self._receiver_ready.set()
            deadline = math.inf
            while len(self.received) < len(self.commands) or not self._stop.is_set():
                if self._stop.is_set():
                    deadline = min(deadline, time.monotonic() + 20)
                    if time.monotonic() > deadline:
                        break
                self.received += [c.command_id for c in receiver.poll() if c.command_id != "probe"]
                time.sleep(0.01)
            receiver.close()
        except BaseException as exc:
            self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)


class Fuzzer:
    """Hostile clients of one broker; every action is drawn from a seeded generator."""

    def __init__(self, address: BusAddress, rng: random.Random) -> None:
        self.address = address
        self.rng = rng
        self.ctx = zmq.Context()
        self.frames = 0
        self._prefixes = sorted(SUBSCRIPTION_PREFIXES)
        self._topics = sorted(TOPICS)
        self.inputs = [self._socket(zmq.XPUB, "events_in"), self._socket(zmq.PUB, "commands_in")]
        self.inputs.append(self._socket(zmq.XPUB, "commands_in"))
        self.outputs = [
            self._socket(zmq.XSUB, "events_out"),
            self._socket(zmq.XSUB, "commands_out"),
        ]
        self.state = self._socket(zmq.DEALER, "state")  # sends garbage, is disconnected
        self.greedy = self._socket(zmq.DEALER, "state", connect=False)  # never reads answers
        self.greedy.setsockopt(zmq.RCVHWM, 1)
        self.greedy.setsockopt(zmq.RCVBUF, 4096)
        self.greedy.connect(address.endpoint("state"))
        # Subscribers that never read, for the whole run.
        self.stuck = []
        for topic in (b"", b"step.", b"cmd."):
            role = "commands_out" if topic == b"cmd." else "events_out"
            sub = self._socket(zmq.SUB, role, connect=False)
            sub.setsockopt(zmq.RCVHWM, 1)
            sub.setsockopt(zmq.RCVBUF, 4096)
            sub.setsockopt(zmq.SUBSCRIBE, topic)
            sub.connect(address.endpoint(role))
            self.stuck.append(sub)
        self.actions: list[Callable[[], None]] = [
            self.garbage_in,
            self.garbage_in,
            self.garbage_in,
            self.absurd_event,
            self.absurd_event,
            self.huge_frame,
            self.upstream,
            self.upstream,
            self.subscriber_churn,
            self.state_flood,
            self.state_garbage,
            self.not_zmtp,
        ]

    def _socket(self, kind: int, role: str, *, connect: bool = True) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 2000)
        if connect:
            sock.connect(self.address.endpoint(role))  # type: ignore[arg-type]
        return sock

    def send(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            self.frames += len(frames)
        except zmq.Again:
            pass  # a full queue (or a peer that disconnected us): try the next one

    def step(self) -> None:
        self.rng.choice(self.actions)()

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    # --- payloads -------------------------------------------------------------------

    def blob(self, limit: int = 512) -> bytes:
        return self.rng.randbytes(self.rng.randrange(limit))

    def bad_msgpack(self) -> bytes:
        rng = self.rng
        kind = rng.randrange(6)
        valid = encode(StepEnded(step=1, stage=0))
        if kind == 0:
            return valid[: rng.randrange(len(valid))]  # truncated
        if kind == 1:
            return b"\xdb\xff\xff\xff\xff" + self.blob(64)  # a 4 GiB string, declared
        if kind == 2:
            return b"\xdf\xff\xff\xff\xff" + self.blob(64)  # a map of 4 billion entries
        if kind == 3:
            return b"\xdd\x7f\xff\xff\xff" + b"\xc0" * rng.randrange(64)  # a huge array
        if kind == 4:
            return b"\x91" * rng.randrange(1, 5000)  # nesting deeper than any decoder likes
        return self.blob()

    def absurd_values(self) -> dict[str, Any]:
        rng = self.rng
        big = rng.choice([2**63 - 1, -(2**63), 2**64, 10**30, -1])
        number = rng.choice([math.nan, math.inf, -math.inf, 1e308, -0.0])
        text = rng.choice(["\x1b[2J\x1b[31mred", "\x00\x07\r\n", "é" * 300, "\u202e" * 10])
        return {"big": big, "number": number, "text": text}

    # --- actions --------------------------------------------------------------------

    def garbage_in(self) -> None:
        """Frames of every shape at an input: random counts, topics, payloads."""
        rng = self.rng
        count = rng.choice([1, 1, 2, 2, 2, 3, 5, rng.randrange(1, 200)])
        frames: list[bytes] = []
        for i in range(count):
            if i == 0 and rng.random() < 0.7:
                frames.append(rng.choice(self._topics))
            elif rng.random() < 0.5:
                frames.append(self.bad_msgpack())
            else:
                frames.append(self.blob(rng.choice([16, 512, 4096, 2 * MAX_FRAME_BYTES])))
        self.send(rng.choice(self.inputs), frames)

    def absurd_event(self) -> None:
        """Events that decode as msgpack but hold values no consumer should trust."""
        rng = self.rng
        values = self.absurd_values()
        source = f"fuzz/{rng.randrange(8)}"
        kind = rng.randrange(6)
        msg: Any
        if kind == 0:
            msg = StepEnded(step=values["big"], stage=rng.choice([0, 1, 7, 2000, -3]))
            msg.loss = values["number"]
            msg.duration_s = values["number"]
            msg.samples = values["big"]
            msg.metrics = {values["text"]: values["number"]}
        elif kind == 1:
            msg = StageStarted(
                stage=rng.randrange(-5, 5000),
                num_stages=rng.choice([0, 2, 10**9]),
                rank=values["big"],
                host=values["text"],
                pid=values["big"],
                device=values["text"],
                layers=list(range(rng.randrange(100))),
                num_params=values["big"],
            )
        elif kind == 2:
            msg = HookError(
                hook=values["text"],
                handler=values["text"],
                event_type="step.ended",
                error=values["text"] * rng.randrange(1, 40),
            )
        elif kind == 3:
            msg = MicrobatchForward(
                step=values["big"],
                stage=0,
                microbatch=values["big"],
                start=values["number"],
                end=values["number"],
            )
        elif kind == 4:
            msg = HookStarted(hooks=[values["text"]] * rng.randrange(50), topics=[])
        else:
            msg = Heartbeat(stage=values["big"], step=values["big"], state=values["text"])
        msg.source, msg.seq, msg.ts = source, rng.randrange(2**31), values["number"]
        try:
            payload = encode(msg)
        except (OverflowError, msgspec.EncodeError):  # 2**64 does not encode: raw then
            payload = self.bad_msgpack()
        topic = msg.topic if rng.random() < 0.9 else rng.choice(self._topics)
        self.send(self.inputs[0], [topic, payload])

    def huge_frame(self) -> None:
        """A frame far beyond the limit (up to 10 MB): its sender is disconnected."""
        size = self.rng.choice([MAX_FRAME_BYTES + 2000, 100_000, 1_000_000, 10_000_000])
        kind = self.rng.randrange(3)
        if kind == 0:
            self.send(self.rng.choice(self.inputs), [b"step.ended", bytes(size)])
        elif kind == 1:
            self.send(self.state, [bytes(size)])
        else:
            self.throwaway_upstream([bytes(size)])

    def upstream(self) -> None:
        """What a subscriber sends: long, malformed and valid (un)subscriptions, garbage."""
        rng = self.rng
        kind = rng.randrange(7)
        if kind == 0:
            # Beyond the frame limit: a subscriber that is disconnected at once.
            # (200 KB ones would crash the sending socket itself, whose own trie
            # recurses like the broker's did: see LONG_SUBSCRIBER.)
            size = rng.choice([100, 500, 5000, 50_000])
            self.throwaway_upstream([b"\x01" + self.rng.randbytes(size)])
            return
        if kind == 1:
            frames = [rng.choice([b"\x00", b"\x01"]) + rng.choice(self._prefixes)]
        elif kind == 2:
            frames = [b"\x01" + rng.choice(self._prefixes) + b"x" * rng.randrange(1, 30)]
        elif kind == 3:
            frames = [self.blob(50) for _ in range(rng.randrange(1, 6))]
        elif kind == 4:
            frames = [b""]
        elif kind == 5:
            frames = [b"\x01" + self.blob(50)]  # distinct: libzmq keeps each until we leave
        else:
            frames = [bytes([rng.randrange(2, 256)]) + self.blob(50)]
        self.send(rng.choice(self.outputs), frames)
        if rng.random() < 1 / 300:
            # Leave and come back: libzmq walks its whole trie of distinct
            # subscriptions whenever any subscriber leaves, so a peer that piles
            # them up for ever slows every departure (see evtrain.bus.limits).
            for sock in self.outputs:
                sock.close(linger=0)
            self.outputs = [self._socket(zmq.XSUB, role) for role in ("events_out", "commands_out")]

    def throwaway_upstream(self, frames: list[bytes]) -> None:
        """``frames`` upstream from a subscriber of its own, which then leaves."""
        sock = self._socket(zmq.XSUB, self.rng.choice(["events_out", "commands_out"]))
        self.send(sock, frames)
        sock.close(linger=200)

    def subscriber_churn(self) -> None:
        """A subscriber that connects, subscribes (well or badly) and leaves at once."""
        rng = self.rng
        role = rng.choice(["events_out", "commands_out"])
        sub = self._socket(zmq.SUB, role, connect=False)
        for _ in range(rng.randrange(1, 4)):
            topic = rng.choice(
                [rng.choice(self._prefixes), self.blob(40), b"step.ended.more", b"\x01" * 20]
            )
            sub.setsockopt(zmq.SUBSCRIBE, topic)
        sub.connect(self.address.endpoint(role))  # type: ignore[arg-type]
        if rng.random() < 0.5:
            sub.poll(rng.choice([0, 1, 5]))  # sometimes long enough to be attached
        sub.close(linger=0)

    def state_flood(self) -> None:
        """Requests from a client that never reads what it asked for."""
        for _ in range(self.rng.randrange(1, 40)):
            self.send(self.greedy, [b"", self.rng.choice([b"snapshot", b"snapshot", b"stats"])])

    def state_garbage(self) -> None:
        rng = self.rng
        frames = [self.blob(rng.choice([8, 300, 2000])) for _ in range(rng.randrange(1, 8))]
        self.send(self.state, frames)

    def not_zmtp(self) -> None:
        """Bytes straight into a socket file, without a ZeroMQ handshake."""
        role = self.rng.choice(ROLES)
        path = self.address.endpoint(role)[len("ipc://") :]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(1.0)
            try:
                raw.connect(path)
                raw.sendall(self.rng.choice([b"\xff" + bytes(8) + b"\x7f", b""]) + self.blob(4096))
            except OSError:
                pass  # the broker may close on us mid-send: that is the point


def test_the_broker_survives_hostile_frames_at_every_endpoint_and_loses_no_legit_event(
    buses: Buses, procs: Any, tmp_path: Path
) -> None:
    proc, bus = buses.start()
    address = BusAddress.parse(bus)
    out = tmp_path / "seen.json"
    hook = procs.evtrain(
        "--log-level",
        "error",
        "hook",
        "helpers.bus_procs:Recorder",
        "--bus",
        bus,
        "-o",
        f"path={out}",
        env=env_with_tests(),
    )
    attached(address, "hook/recorder")
    sampler = Sampler({"broker": proc.pid, "hook": hook.pid})
    legit = Legit(address)
    fuzzer = Fuzzer(address, random.Random(SEED))
    started = time.monotonic()
    long_subscribers = []
    try:
        legit.start()
        for action in range(ACTIONS):
            fuzzer.step()
            if action % (ACTIONS // 4) == 0:
                endpoint = address.endpoint(fuzzer.rng.choice(["events_out", "commands_out"]))
                long_subscribers.append(procs.python("-c", LONG_SUBSCRIBER, endpoint))
            assert proc.poll() is None, "the broker died"
        for client in long_subscribers:
            assert client.wait(timeout=30) == 0
        fuzz_seconds = time.monotonic() - started
    finally:
        sampler.stop()  # before the hook ends: the bounds hold while both run
        fuzzer.close()
        legit.stop()
    assert not legit.errors, legit.errors
    assert hook.wait(timeout=60) == 0, hook.stderr.read()[-3000:]
    assert "Traceback" not in hook.stderr.read()
    assert proc.poll() is None, "the broker died"

    # Every legitimate event and command arrived, in order.
    seen = json.loads(out.read_text())
    mine = [(seq, step) for source, seq, step in seen if source == LEGIT_SOURCE]
    assert legit.dropped == 0
    assert [step for _, step in mine] == list(range(legit.steps))
    assert [seq for seq, _ in mine] == list(range(legit.steps))
    assert legit.received == legit.commands

    # The broker is still whole: it answers, and it dropped the garbage.
    stats = fetch_stats(address, 10)
    assert stats is not None
    assert stats.events.malformed > 0 and stats.commands.malformed > 0
    assert stats.events.rejected_subscriptions > 0 and stats.events.upstream_garbage > 0
    assert stats.state.malformed_requests > 0 and stats.state.unanswered > 0
    # Its state is the legitimate stage's step and the hook processes, nothing more.
    snapshot = fetch_snapshot(address, 10)
    assert [m.source for m in snapshot if isinstance(m, StepEnded)] == [LEGIT_SOURCE]
    assert len(snapshot) <= 1 + MAX_HOOKS

    assert sampler.peak["broker"] < BROKER_RSS_LIMIT, sampler.peak
    assert sampler.peak["hook"] < HOOK_RSS_LIMIT, sampler.peak
    report = {
        "actions": ACTIONS,
        "frames": fuzzer.frames,
        "fuzz_s": round(fuzz_seconds, 1),
        "legit_steps": legit.steps,
        "broker_peak_mib": round(sampler.peak["broker"] / 2**20, 1),
        "hook_peak_mib": round(sampler.peak["hook"] / 2**20, 1),
    }
    print(json.dumps(report))  # shown with pytest -s: the figures of this run
    assert fuzzer.frames >= ACTIONS


def attached(address: BusAddress, source: str) -> None:
    """Wait until the hook process of ``source`` is attached: the broker's state says so."""
    deadline = time.monotonic() + 60
    while not any(
        isinstance(m, HookStarted) and m.source == source for m in fetch_snapshot(address, 1)
    ):
        assert time.monotonic() < deadline, f"{source} never attached"
        time.sleep(0.05)
