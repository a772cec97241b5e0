"""The bus with real processes and a real broker: order, loss accounting, hostile frames,
the broker's limits (subscriptions, queues, the state service), CURVE, and the broker's
own lifecycle."""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.auth
from helpers.bus_procs import (
    SCRIPT,
    Buses,
    Lines,
    connect,
    env_with_tests,
    probe_until_seen,
    rss_bytes,
    step_event,
)

from evtrain.bus.address import BusAddress
from evtrain.bus.broker import Broker, fetch_stats
from evtrain.bus.commands import CommandLedger, CommandReceiver, Delivery
from evtrain.bus.limits import MAX_FRAME_BYTES, STATE_REPLIES_QUEUED, TOPICS, socket_limit
from evtrain.bus.publisher import Publisher
from evtrain.bus.security import (
    CurveConfig,
    ensure_curve_dir,
    load_client,
    load_server,
)
from evtrain.bus.state_service import MAX_REPLY_BYTES, fetch_snapshot, ping_broker, request
from evtrain.bus.subscriber import DRAIN_LIMIT, Subscriber
from evtrain.errors import UsageError
from evtrain.events import (
    SCHEMA_VERSION,
    BusDrops,
    CheckpointCommitted,
    CheckpointRequested,
    EvaluateNow,
    Heartbeat,
    HookStarted,
    Message,
    RunEnded,
    RunStarted,
    StageFailed,
    StageStarted,
    StepEnded,
    StepStarted,
    encode,
)
from evtrain.run_state import MAX_HOOKS, RunState

pytestmark = pytest.mark.anyio


def start_bus(buses: Buses, *args: str) -> tuple[subprocess.Popen[str], BusAddress]:
    """``evtrain bus`` in its own process; its first stdout line is the address."""
    proc, address = buses.start(*args)
    return proc, BusAddress.parse(address)


async def collect(
    sub: Subscriber, until: object, timeout: float = 20.0, per_message: float = 0.0
) -> list[Message]:
    """Receive until ``until(msg)`` is true for a message (returned list includes it)."""
    out: list[Message] = []
    with anyio.fail_after(timeout):
        while True:
            for msg in await sub.receive(timeout=0.5):
                if per_message:
                    time.sleep(per_message)  # a slow consumer: blocks like real work
                out.append(msg)
                if until(msg):  # type: ignore[operator]
                    return out


async def raw_live(raw: zmq.Socket, sub: Subscriber) -> None:
    """Send probes through the raw publisher ``raw`` until ``sub`` receives one: the
    subscription has reached it, and what it sends next is not dropped for want of one."""
    seqs = itertools.count()

    def send(probe: Heartbeat) -> None:
        probe.source, probe.seq = "test/raw", next(seqs)
        raw.send_multipart([probe.topic, encode(probe)])

    await probe_until_seen(sub, send, "test/raw", timeout=30)


def broker_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("evtrain-")}


# --- ordering and loss ----------------------------------------------------------------


async def test_two_publisher_processes_and_a_hook_process_lose_nothing(
    buses: Buses, procs: object, tmp_path: Path
) -> None:
    count = 3000
    _, address = start_bus(buses)
    out = tmp_path / "seen.json"
    watch = Subscriber(address.endpoint("events_out"), ["hook.started"])
    await connect(watch, address)
    hook = procs.evtrain(  # type: ignore[attr-defined]
        "--log-level",
        "warning",
        "hook",
        "helpers.bus_procs:Recorder",
        "--bus",
        str(address),
        "-o",
        f"path={out}",
        "-o",
        f"expect={2 * count}",
        env=env_with_tests(),
    )
    await collect(watch, lambda m: m.source == "hook/recorder")  # subscribed and live
    publishers = [
        procs.python(  # type: ignore[attr-defined]
            SCRIPT,
            "publish",
            "--bus",
            str(address),
            "--source",
            f"stage/{i}",
            "--stage",
            str(i),
            "--count",
            str(count),
            "--hold",
            stdin=subprocess.PIPE,
        )
        for i in range(2)
    ]
    # Bounds for a failure, not waits: on a busy machine three interpreters start slowly.
    for pub in publishers:
        stats = Lines(pub).json()
        assert stats["dropped"] == 0
    try:
        assert hook.wait(timeout=120) == 0, hook.stderr.read()
    except subprocess.TimeoutExpired:
        # What arrived where: the broker's count, then the hook's, which a
        # signal makes it write.
        broker = fetch_stats(address)
        hook.send_signal(signal.SIGTERM)
        hook.wait(timeout=30)
        seen = json.loads(out.read_text()) if out.exists() else None
        counts = Counter(source for source, _, _ in seen) if seen is not None else None
        raise AssertionError(
            f"the hook did not end: broker {broker}, hook saw {counts}\n{hook.stderr.read()}"
        ) from None
    for pub in publishers:
        assert pub.stdin is not None
        pub.stdin.close()  # the end of its stdin: close now
        assert pub.wait(timeout=120) == 0
    seen = [tuple(row) for row in json.loads(out.read_text())]
    for i in range(2):
        mine = [(seq, step) for source, seq, step in seen if source == f"stage/{i}"]
        assert [step for _, step in mine] == list(range(count))  # all, in order
        assert [seq for seq, _ in mine] == list(range(count))  # no gap, no duplicate
    watch.close()


async def test_slow_subscriber_sees_gaps_and_never_blocks_the_publisher(
    buses: Buses,
    procs: object,
) -> None:
    count = 20_000
    _, address = start_bus(buses, "--hwm", "200")
    sub = Subscriber(address.endpoint("events_out"), [""], hwm=100)
    await connect(sub, address)
    pub = procs.python(  # type: ignore[attr-defined]
        SCRIPT,
        "publish",
        "--bus",
        str(address),
        "--source",
        "stage/0",
        "--count",
        str(count),
        "--marker",
        stdin=subprocess.PIPE,
    )
    lines = Lines(pub)
    received: list[Message] = []
    # Consume slowly (0.2 ms per message) while the burst runs and until it is gone.
    with anyio.fail_after(30):
        stats = None
        while True:
            batch = await sub.receive(timeout=0.5)
            for msg in batch:
                time.sleep(0.0002)
                received.append(msg)
            if stats is None:
                try:
                    stats = lines.json(timeout=0.001)
                except AssertionError:
                    pass
            elif not batch:
                break  # burst over and drained
    assert stats is not None
    # The publishing loop was never blocked by the slow consumer. (The bound on the
    # slowest call is loose: on a loaded 2-core machine the OS may pause any process.)
    assert stats["p99_call_s"] < 0.005, stats
    assert stats["max_call_s"] < 0.5, stats
    assert stats["seconds"] < 5.0, stats
    assert pub.stdin is not None
    pub.stdin.write("go\n")
    pub.stdin.flush()
    marker = lines.json()
    assert marker["sent"]
    received += await collect(
        sub, lambda m: isinstance(m, StepEnded) and m.source == "stage/0" and m.step == count
    )
    mine = [m for m in received if m.source == "stage/0" and isinstance(m, StepEnded)]
    missing = sub.gaps.missing.get("stage/0", 0)
    assert missing > 0  # the slow subscriber lost events, and knows how many
    # Every sequence number up to the marker was either received or counted missing.
    assert len(mine) + missing == marker["marker_seq"] + 1
    assert [m.seq for m in mine] == sorted(m.seq for m in mine)
    assert sub.malformed == 0
    sub.close()


async def test_publisher_queue_overflow_is_counted_reported_and_seen_as_gap(
    buses: Buses,
    procs: object,
) -> None:
    broker, address = start_bus(buses)
    sub = Subscriber(address.endpoint("events_out"), [""])
    await connect(sub, address)
    pub = procs.python(  # type: ignore[attr-defined]
        SCRIPT,
        "publish",
        "--bus",
        str(address),
        "--source",
        "stage/7",
        "--count",
        "30000",
        "--hwm",
        "500",
        "--marker",
        "--wait-start",
        stdin=subprocess.PIPE,
    )
    lines = Lines(pub)
    assert lines.json()["connected"]
    assert pub.stdin is not None
    os.kill(broker.pid, signal.SIGSTOP)  # the broker stops draining the publisher
    try:
        pub.stdin.write("go\n")
        pub.stdin.flush()
        stats = lines.json()
    finally:
        os.kill(broker.pid, signal.SIGCONT)
    # The whole burst finished while the broker was frozen: a full queue drops, it
    # does not block.
    assert stats["dropped"] > 0, stats
    assert stats["p99_call_s"] < 0.005, stats
    assert stats["max_call_s"] < 0.5, stats
    # The marker goes once the broker forwarded all the publisher's queue held.
    held = 30000 - stats["dropped"]
    seen = Counter[str]()

    def drained(m: Message) -> bool:
        seen[m.source] += isinstance(m, StepEnded)
        return seen["stage/7"] == held

    received = await collect(sub, drained, timeout=120) if held else []
    pub.stdin.write("go\n")
    pub.stdin.flush()
    marker = lines.json()
    # The drops are reported once the queue has room again: in one report, or in a
    # few if the queue had room for a moment during the burst.
    received += await collect(
        sub,
        lambda m: isinstance(m, BusDrops) and m.total_dropped == stats["dropped"],
    )
    if not any(isinstance(m, StepEnded) and m.step == 30000 for m in received):
        received += await collect(sub, lambda m: isinstance(m, StepEnded) and m.step == 30000)
    reports = [m for m in received if isinstance(m, BusDrops) and m.source == "stage/7"]
    assert reports[-1].total_dropped == stats["dropped"] == marker["dropped"]
    assert sum(report.dropped for report in reports) == stats["dropped"]
    mine = [m for m in received if m.source == "stage/7" and isinstance(m, StepEnded)]
    # Downstream of the publisher nothing was lost: the subscriber's gap is the drop.
    assert sub.gaps.missing.get("stage/7", 0) == stats["dropped"]
    assert len(mine) + stats["dropped"] == marker["marker_seq"] + 1 == 30000 + 1
    sub.close()


async def test_topic_filtered_subscriber_sees_no_false_gaps(ipc_bus: BusAddress) -> None:
    # Sequence numbers count per (source, topic): events filtered out by the
    # subscriber's prefix must not look like losses.
    with Broker(ipc_bus):
        sub = Subscriber(ipc_bus.endpoint("events_out"), ["step.ended"])
        await connect(sub, ipc_bus)
        with Publisher(ipc_bus.endpoint("events_in"), source="stage/0") as pub:
            for step in range(200):
                pub.publish(StepStarted(step=step, stage=0))
                pub.publish(Heartbeat(step=step))
                pub.publish(StepEnded(step=step, stage=0))
        got = await collect(sub, lambda m: isinstance(m, StepEnded) and m.step == 199)
        steps = [m.step for m in got if isinstance(m, StepEnded)]
        assert steps == list(range(200))
        assert sub.gaps.total_missing == 0
        assert sub.gaps.missing == {}
        sub.close()


async def test_prefix_filters_through_the_broker(ipc_bus: BusAddress) -> None:
    with Broker(ipc_bus):
        subs = {
            prefix: Subscriber(ipc_bus.endpoint("events_out"), [prefix])
            for prefix in ("step.", "checkpoint.", "step.ended", "")
        }
        for sub in subs.values():
            sub.subscribe("heartbeat")
            await connect(sub, ipc_bus)
        sent: list[Message] = [
            StepStarted(step=1, stage=0),
            StepEnded(step=1, stage=0),
            CheckpointRequested(checkpoint_id="c", step=1, path="/x"),
            CheckpointCommitted(checkpoint_id="c", step=1, path="/x"),
            RunEnded(status="completed"),
        ]
        with Publisher(ipc_bus.endpoint("events_in"), source="stage/0") as pub:
            for msg in sent:
                pub.publish(msg)
            pub.publish(Heartbeat(state="end"))
        got = {
            prefix: [
                m.topic.decode()
                for m in await collect(sub, lambda m: getattr(m, "state", "") == "end")
                if m.source == "stage/0" and not isinstance(m, Heartbeat)
            ]
            for prefix, sub in subs.items()
        }
        assert got["step."] == ["step.started", "step.ended"]
        assert got["step.ended"] == ["step.ended"]
        assert got["checkpoint."] == ["checkpoint.requested", "checkpoint.committed"]
        assert got[""] == [m.topic.decode() for m in sent]
        for sub in subs.values():
            sub.close()


# --- hostile frames -------------------------------------------------------------------


def garbage(rng: random.Random, count: int) -> Iterable[list[bytes]]:
    """Messages that are not ``[topic, valid payload]``, in every shape."""
    valid = encode(step_event(3))
    for i in range(count):
        kind = i % 9
        if kind == 0:
            yield [rng.randbytes(rng.randrange(0, 300))]
        elif kind == 1:
            yield [b"step.ended", rng.randbytes(rng.randrange(0, 300))]
        elif kind == 2:
            yield [b"step.ended", valid[: rng.randrange(len(valid))]]  # truncated
        elif kind == 3:
            yield [b"step.started", valid]  # topic does not match the payload
        elif kind == 4:
            yield [b"step.ended"]  # a topic alone
        elif kind == 5:
            yield [b"step.ended", b"step.ended"]
        elif kind == 6:
            yield [b"step.ended", valid[:-1], b"extra"]
        elif kind == 7:
            yield [b"", b""]
        else:
            yield [rng.randbytes(8), valid]


def send_raw(sock: zmq.Socket, messages: Iterable[list[bytes]]) -> int:
    sent = 0
    for frames in messages:
        sock.send_multipart(frames)
        sent += 1
    return sent


async def test_garbage_crashes_neither_broker_nor_subscriber(buses: Buses, procs: object) -> None:
    broker, address = start_bus(buses)
    sub = Subscriber(address.endpoint("events_out"), [""])
    await connect(sub, address)
    rng = random.Random(11)
    ctx = zmq.Context()
    # The broker passes on only [topic, payload] with an evtrain topic: those reach
    # the subscriber, which finds the payload bad; the broker drops the rest.
    well_framed = 0
    try:
        # Publishers of garbage on the broker's input: a PUB and an XPUB.
        for kind in (zmq.PUB, zmq.XPUB):
            raw = ctx.socket(kind)
            raw.setsockopt(zmq.LINGER, 1000)
            raw.setsockopt(zmq.SNDHWM, 100_000)
            raw.connect(address.endpoint("events_in"))
            await raw_live(raw, sub)
            batch = list(garbage(rng, 1500))
            well_framed += sum(len(frames) == 2 and frames[0] in TOPICS for frames in batch)
            send_raw(raw, batch)
            raw.close()
        # Upstream garbage at the broker's output, and at the state endpoint.
        upstream = ctx.socket(zmq.XSUB)
        upstream.connect(address.endpoint("events_out"))
        send_raw(upstream, ([rng.randbytes(rng.randrange(1, 50))] for _ in range(1000)))
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(address.endpoint("state"))
        send_raw(dealer, garbage(rng, 500))
        commands = ctx.socket(zmq.PUB)
        commands.connect(address.endpoint("commands_in"))
        await anyio.sleep(0.3)
        send_raw(commands, garbage(rng, 500))
        # Bytes that are not even ZMTP, straight into every socket file.
        for role in ("events_in", "events_out", "commands_in", "commands_out", "state"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(address.endpoint(role)[len("ipc://") :])
                s.sendall(rng.randbytes(4096))
        for sock in (upstream, dealer, commands):
            sock.close(linger=0)
        # Valid events afterwards still arrive, all of them, in order.
        with Publisher(address.endpoint("events_in"), source="stage/1") as pub:
            for i in range(200):
                pub.publish(step_event(i, 1))
            pub.publish(
                RunStarted(
                    name="after",
                    num_stages=1,
                    num_microbatches=1,
                    schedule="1f1b",
                    max_steps=1,
                    batch_size=1,
                )
            )
        got = await collect(sub, lambda m: isinstance(m, RunStarted))
        steps = [m.step for m in got if isinstance(m, StepEnded) and m.source == "stage/1"]
        assert steps == list(range(200))
        assert sub.malformed == well_framed  # counted, not delivered
        assert broker.poll() is None  # the broker is alive...
        snapshot = fetch_snapshot(address, timeout=5)  # ...and its state service answers
        assert any(isinstance(m, RunStarted) and m.name == "after" for m in snapshot)
    finally:
        ctx.destroy(linger=0)
        sub.close()


async def test_raw_frames_straight_to_a_subscriber() -> None:
    directory = Path(tempfile.mkdtemp(prefix="evt-", dir="/tmp"))
    endpoint = f"ipc://{directory}/raw"
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.SNDHWM, 0)
    raw.bind(endpoint)
    sub = Subscriber(endpoint, [""], hwm=0)
    try:
        await raw_live(raw, sub)
        rng = random.Random(5)
        honest = 0
        malformed = 0
        for i, frames in enumerate(garbage(rng, 3000)):
            raw.send_multipart(frames)
            malformed += 1
            if i % 30 == 0:  # honest messages between the garbage: none may be lost
                ev = step_event(honest)
                ev.source, ev.seq = "stage/0", honest
                raw.send_multipart([ev.topic, encode(ev)])
                honest += 1
        got: list[Message] = []
        with anyio.fail_after(20):
            while len(got) < honest:
                got += [m for m in await sub.receive(timeout=1) if m.source == "stage/0"]
        assert [m.seq for m in got] == list(range(honest))
        assert sub.gaps.total_missing == 0
        # Most garbage is counted one by one; a topic-only message may merge with
        # the garbage after it into one malformed count, never with a good message.
        assert malformed * 0.75 <= sub.malformed <= malformed
        assert await sub.receive(timeout=0.2) == []
    finally:
        sub.close()
        ctx.destroy(linger=0)
        shutil.rmtree(directory, ignore_errors=True)


async def test_a_burst_with_bad_messages_inside_arrives_whole_and_in_order(
    buses: Buses,
) -> None:
    broker, address = start_bus(buses)
    sub = Subscriber(address.endpoint("events_out"), [""])
    await connect(sub, address)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.XPUB)  # one socket: the broker keeps its order
    raw.setsockopt(zmq.SNDHWM, 0)
    raw.connect(address.endpoint("events_in"))
    try:
        assert raw.poll(20_000), "the broker's subscription never came"
        raw.recv()
        before = broker_forwarded(address)
        count = 4 * DRAIN_LIMIT + 7
        framing = rejected = 0
        for i in range(count):
            ev = step_event(i, 2)
            ev.source, ev.seq = "stage/2", i
            raw.send_multipart([ev.topic, encode(ev)])
            if i % 40 == 10:  # three frames: the broker drops it
                raw.send_multipart([ev.topic, encode(ev), b"extra"])
                framing += 1
            elif i % 40 == 20:  # a future schema: forwarded, the subscriber refuses it
                ev.v = SCHEMA_VERSION + 1
                raw.send_multipart([ev.topic, encode(ev)])
                rejected += 1
            elif i % 40 == 30:  # valid payload under another topic: refused too
                raw.send_multipart([StepStarted.topic, encode(ev)])
                rejected += 1
        raw.send_multipart([RunEnded.topic, encode(RunEnded(status="completed", source="t"))])
        # All of it waits at the broker or the subscriber before the first receive.
        until(lambda: broker_forwarded(address) >= before + count + rejected + 1)
        received: list[Message] = []
        sizes: list[int] = []
        with anyio.fail_after(20):
            while not received or not isinstance(received[-1], RunEnded):
                batch = await sub.receive()
                sizes.append(len(batch))
                received += batch
        assert max(sizes) <= DRAIN_LIMIT
        steps = [m for m in received if isinstance(m, StepEnded)]
        assert [(m.step, m.seq) for m in steps] == [(i, i) for i in range(count)]
        assert sub.gaps.total_missing == 0
        assert sub.malformed == rejected
        assert set(sub.malformed_log.counts) == {"unsupported schema version", "topic mismatch"}
        stats = fetch_stats(address)
        assert stats is not None and stats.events.malformed == framing
        assert broker.poll() is None
    finally:
        ctx.destroy(linger=0)
        sub.close()


def broker_forwarded(address: BusAddress) -> int:
    stats = fetch_stats(address)
    return stats.events.forwarded if stats is not None else 0


# --- limits: subscriptions, queues, the state service -----------------------------------


def until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll ``condition`` until it holds; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout:g} s: {condition}")
        time.sleep(0.02)


def stuck_subscriber(ctx: zmq.Context, address: BusAddress, *topics: bytes) -> zmq.Socket:
    """A subscriber that does not read: one message and a few KiB of buffer on its side."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.LINGER, 0)
    for topic in topics:
        sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.connect(address.endpoint("events_out"))
    return sock


def raw_publisher(ctx: zmq.Context, address: BusAddress) -> zmq.Socket:
    """An XPUB on the broker's input, connected once the broker's subscription arrived."""
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.XPUB_NODROP, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address.endpoint("events_in"))
    assert sock.poll(10_000), "the broker's subscription never arrived"
    assert sock.recv() == b"\x01"
    return sock


def received_until(sock: zmq.Socket, last: bytes, timeout: float = 20.0) -> list[bytes]:
    """Payloads ``sock`` receives up to and including the payload ``last``."""
    out: list[bytes] = []
    deadline = time.monotonic() + timeout
    while not out or out[-1] != last:
        assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), "marker missing"
        out.append(sock.recv_multipart()[1])
    return out


async def test_a_200_kb_subscription_and_leaving_leave_the_broker_running(
    buses: Buses, procs: object
) -> None:
    broker, address = start_bus(buses)
    # The repro, verbatim: libzmq 4.3.5 recursed once per topic byte and the
    # broker died with SIGSEGV when this subscriber left.
    repro = (
        "import zmq,os,time;s=zmq.Context().socket(zmq.SUB);"
        f"s.connect('{address.endpoint('events_out')}');"
        "s.setsockopt(zmq.SUBSCRIBE,os.urandom(200000));time.sleep(2);os._exit(0)"
    )
    # Within the frame limit but no evtrain topic: selects nothing, counted.
    near = repro.replace("os.urandom(200000)", "b'z'*30")
    clients = [procs.python("-c", code) for code in (repro, near)]  # type: ignore[attr-defined]
    for client in clients:
        assert client.wait(timeout=30) == 0
    # The broker has handled both departures once traffic after them gets through.
    sub = Subscriber(address.endpoint("events_out"), ["step."])
    try:
        await connect(sub, address)
        with Publisher(address.endpoint("events_in"), source="stage/0") as pub:
            pub.publish(step_event(1))
        got = await collect(sub, lambda m: isinstance(m, StepEnded))
        assert got[-1].step == 1
    finally:
        sub.close()
    assert broker.poll() is None
    stats = fetch_stats(address, 5)
    assert stats is not None
    assert stats.events.rejected_subscriptions >= 1  # the 30-byte one, not the 200 KB one


def test_subscriptions_outside_the_grammar_select_nothing_and_nothing_goes_upstream(
    ipc_bus: BusAddress,
) -> None:
    ctx = zmq.Context()
    with Broker(ipc_bus) as broker:
        try:
            publisher = raw_publisher(ctx, ipc_bus)
            wrong = stuck_subscriber(ctx, ipc_bus, b"xstep", b"step.ended.", b"heartbeat")
            right = stuck_subscriber(ctx, ipc_bus, b"st")
            rogue = ctx.socket(zmq.XSUB)
            rogue.connect(ipc_bus.endpoint("events_out"))
            for frames in (
                [b"\x07not a subscription"],
                [b"\x01step.", b"a second frame"],
                [b""],
                [b"\x01" + b"q" * 40],
                [b"\x00" + b"q" * 40],  # an XSUB passes on cancelling only what it sent
            ):
                rogue.send_multipart(frames)
            # Rejected: xstep, step.ended., q*40 and its cancellation; garbage: the
            # non-subscription, the empty frame and the second frame (libzmq takes
            # the first frame of an upstream message for a subscription on its own).
            until(lambda: broker.stats().events.upstream_garbage == 3)
            until(lambda: broker.stats().events.rejected_subscriptions == 4)
            step = step_event(7)
            beat = Heartbeat(state="marker")
            for msg in (step, beat):
                publisher.send_multipart([msg.topic, encode(msg)])
            # The same step reaches a valid prefix, but not the invalid ones.
            assert received_until(right, encode(step)) == [encode(step)]
            assert received_until(wrong, encode(beat)) == [encode(beat)]
            # Nothing a subscriber sent was passed on to the publisher.
            assert not publisher.poll(0)
        finally:
            ctx.destroy(linger=0)


def test_a_subscriber_that_stops_reading_holds_at_most_the_high_water_mark(
    ipc_bus: BusAddress,
) -> None:
    ctx = zmq.Context()
    hwm = 100
    with Broker(ipc_bus, hwm=hwm) as broker:
        try:
            publisher = raw_publisher(ctx, ipc_bus)
            stuck = stuck_subscriber(ctx, ipc_bus, b"")
            until(lambda: broker.stats().events.subscriptions >= 7)  # the "" prefix is in
            # The largest message the broker forwards, many times its queue.
            failure = StageFailed(stage=0, error="E", traceback="", seq=10**6)
            failure.traceback = "t" * (MAX_FRAME_BYTES - len(encode(failure)) - 2)
            assert MAX_FRAME_BYTES - 8 < len(encode(failure)) <= MAX_FRAME_BYTES
            sent = 20 * hwm
            for seq in range(sent):
                failure.seq = seq
                publisher.send_multipart([failure.topic, encode(failure)])
            # Too large by a byte: dropped; beyond the socket's limit: its sender is
            # disconnected before the frame is queued.
            failure.traceback += "t" * (MAX_FRAME_BYTES + 1 - len(encode(failure)))
            publisher.send_multipart([failure.topic, encode(failure)])
            until(lambda: broker.stats().events.malformed == 1)
            assert broker.stats().events.forwarded == sent
            publisher.send_multipart(
                [failure.topic, b"x" * (socket_limit(MAX_FRAME_BYTES, curve=False) + 1)]
            )
            publisher.close(linger=5000)
            publisher = raw_publisher(ctx, ipc_bus)  # a new connection
            # A full queue takes messages again once half of it is read: send markers
            # until one arrives, after all that was queued.
            marker = encode(Heartbeat(state="marker"))
            got: list[bytes] = []
            markers = 0
            deadline = time.monotonic() + 20
            while marker not in got:
                assert time.monotonic() < deadline, "no marker reached the stuck subscriber"
                publisher.send_multipart([Heartbeat.topic, marker])
                markers += 1
                while stuck.poll(50):
                    got.append(stuck.recv_multipart()[1])
            # Its queue, plus the few the kernel buffers for the connection; and
            # never the frames above the limits.
            assert hwm <= got.index(marker) <= hwm + 32
            assert max(len(payload) for payload in got) <= MAX_FRAME_BYTES
            until(lambda: broker.stats().events.forwarded == sent + markers)
            assert broker.stats().events.malformed == 1
        finally:
            ctx.destroy(linger=0)


def run_started(num_stages: int) -> RunStarted:
    return RunStarted(
        name="shape",
        num_stages=num_stages,
        num_microbatches=1,
        schedule="1f1b",
        max_steps=10,
        batch_size=1,
    )


def stage_started(stage: int, num_stages: int) -> StageStarted:
    return StageStarted(
        stage=stage,
        num_stages=num_stages,
        rank=stage,
        host="h",
        pid=1,
        device="cpu",
        layers=[stage],
        num_params=1,
    )


def test_run_state_holds_one_entry_per_stage_and_hook_of_the_run() -> None:
    state = RunState()
    # Before the run's shape is known: stage numbers within what the stages say.
    state.update(stage_started(0, 2))
    state.update(stage_started(5, 2))  # not a stage of a 2-stage run
    state.update(stage_started(1, 10**9))  # no run has that shape
    state.update(stage_started(2, 3))  # possible, until the run says otherwise
    for stage in (0, 1, 7, -1, 2**62):
        state.update(StepEnded(step=3, stage=stage))
    assert sorted(state.stages) == [0, 2] and sorted(state.last_step) == [0, 1]
    assert state.ignored == 5
    state.update(run_started(0))  # no stages: not a run
    assert state.run is None and state.ignored == 6
    # The run says 2 stages: entries beyond it go, later ones are refused.
    state.update(run_started(2))
    assert sorted(state.stages) == [0] and state.ignored == 7
    state.update(stage_started(1, 3))  # disagrees with the run
    state.update(stage_started(1, 2))
    for stage in range(10_000):
        state.update(StepEnded(step=4, stage=stage))
    assert sorted(state.stages) == [0, 1] and sorted(state.last_step) == [0, 1]
    assert state.ignored == 7 + 1 + 9_998
    # Hooks: the latest of each source, at most MAX_HOOKS of them, newest kept.
    for i in range(MAX_HOOKS + 10):
        hook = HookStarted(hooks=[f"h{i}"], topics=[])
        hook.source = f"hook/{i}"
        state.update(hook)
    again = HookStarted(hooks=["again"], topics=[])
    again.source = "hook/20"
    state.update(again)
    assert len(state.hooks) == MAX_HOOKS
    assert "hook/0" not in state.hooks and list(state.hooks)[-1] == "hook/20"
    kinds = [type(m).__name__ for m in state.snapshot()]
    assert kinds.count("StepEnded") == 2 and kinds.count("HookStarted") == MAX_HOOKS
    assert len(kinds) == 1 + 2 + 2 + MAX_HOOKS


def test_a_step_that_overtook_its_runs_start_stays_in_the_state() -> None:
    state = RunState()
    early, stale = StepEnded(step=5, stage=1), StepEnded(step=9, stage=0)
    early.run_id, stale.run_id = "run-b", "run-a"
    state.update(early)
    state.update(stale)
    start = run_started(2)
    start.run_id = "run-b"
    state.update(start)
    assert state.last_step == {1: early}


def test_the_state_service_is_bounded_whatever_its_clients_do(ipc_bus: BusAddress) -> None:
    ctx = zmq.Context()
    stages = 100
    with Broker(ipc_bus) as broker:
        try:
            with Publisher(ipc_bus.endpoint("events_in"), source="stage/0", hwm=0) as pub:
                pub.publish(run_started(stages))
                # ~8 KB per stage: a reply of ~800 KB, the largest legitimate kind.
                metrics = {f"metric_{i:04d}": float(i) for i in range(500)}
                for stage in range(stages):
                    pub.publish(StepEnded(step=1, stage=stage, metrics=metrics))
                for stage in range(stages, stages + 5000):  # made-up stage numbers
                    pub.publish(StepEnded(step=1, stage=stage))

                def steps() -> int:
                    return sum(isinstance(m, StepEnded) for m in fetch_snapshot(ipc_bus, 5))

                # Waited for in the broker's own counters: polling ~800 KB snapshots
                # in this process would hold the GIL its threads need to get there.
                until(lambda: broker.stats().state.entries == 1 + stages, timeout=60)
                until(lambda: steps() == stages)
                until(lambda: broker.stats().state.ignored_events > 0)
            before = rss_bytes()
            # The repro: 400 requests from a client that never reads.
            greedy = ctx.socket(zmq.DEALER)
            greedy.setsockopt(zmq.RCVHWM, 1)
            greedy.setsockopt(zmq.RCVBUF, 4096)
            greedy.setsockopt(zmq.SNDHWM, 0)
            greedy.connect(ipc_bus.endpoint("state"))
            requests = broker.stats().state.requests
            for _ in range(400):
                greedy.send_multipart([b"", b"snapshot"])
            for frames in ([b"", b"snapshot", b"extra"], [b"x" * 200], [b"", b"stat"]):
                greedy.send_multipart(frames)
            until(lambda: broker.stats().state.requests == requests + 400)
            until(lambda: broker.stats().state.malformed_requests == 3)
            stats = broker.stats().state
            assert stats.unanswered >= 400 - STATE_REPLIES_QUEUED - 8  # a few in buffers
            # 400 queued answers of ~800 KB would be ~320 MB; shared and capped: ~0.
            assert rss_bytes() - before < 40 * 2**20
            # A client that reads is still answered in full, within the bound.
            assert steps() == stages
            reply = request(ipc_bus, b"snapshot", 5)
            assert reply is not None and sum(len(frame) for frame in reply) <= MAX_REPLY_BYTES
            assert broker.stats().state.entries == 1 + stages
        finally:
            ctx.destroy(linger=0)


async def test_a_message_too_long_for_a_frame_is_shortened_or_dropped(ipc_bus: BusAddress) -> None:
    with Broker(ipc_bus):
        sub = Subscriber(ipc_bus.endpoint("events_out"), ["stage.", "step."])
        try:
            await connect(sub, ipc_bus)
            with Publisher(ipc_bus.endpoint("events_in"), source="stage/1") as pub:
                traceback = "Traceback (most recent call last):\n" + "  line\n" * 30_000
                traceback += "RuntimeError: the cause"
                pub.publish(step_event(0, 1))
                failure = StageFailed(stage=1, error="RuntimeError: the cause", traceback=traceback)
                assert pub.publish(failure)
                huge = StepEnded(step=1, stage=1, metrics={f"m{i}": 1.0 for i in range(5000)})
                assert not pub.publish(huge)  # its size is not in text: dropped
                assert pub.publish(step_event(2, 1))
                assert pub.oversized == 1 and pub.dropped == 1
            got = await collect(sub, lambda m: isinstance(m, StepEnded) and m.step == 2)
            failed = next(m for m in got if isinstance(m, StageFailed))
            assert failed.traceback.startswith("Traceback (most recent call last):")
            assert failed.traceback.endswith("RuntimeError: the cause")
            assert "bytes cut ...]" in failed.traceback
            assert len(encode(failed)) <= MAX_FRAME_BYTES
            assert [m.step for m in got if isinstance(m, StepEnded)] == [0, 2]
            assert sub.gaps.total_missing == 1  # the dropped one used its sequence number
        finally:
            sub.close()


# --- commands ---------------------------------------------------------------------------


async def test_ledger_applies_once_and_acknowledges_repeats(ipc_bus: BusAddress) -> None:
    with Broker(ipc_bus):
        stage_pub = Publisher(ipc_bus.endpoint("events_in"), source="stage/0")
        receiver = CommandReceiver(ipc_bus.endpoint("commands_out"))
        ledger = CommandLedger(0, stage_pub)
        acks = Subscriber(ipc_bus.endpoint("events_out"), ["command.acked"])
        await connect(acks, ipc_bus)
        issuer = Publisher(ipc_bus.endpoint("commands_in"), source="hook/test")
        command = EvaluateNow(command_id="c-1")
        got: list = []
        with anyio.fail_after(10):
            while not got:  # retry until the receiver's subscription is live
                issuer.publish(command)
                await anyio.sleep(0.05)
                got = receiver.poll()
        assert [c.command_id for c in got] == ["c-1"]
        assert ledger.admit(got[0])
        ledger.ack(got[0], step=4)
        first = await collect(acks, lambda m: True)
        assert first[0].command_id == "c-1" and first[0].step == 4
        # The issuer did not see it and retries: no second application, the same ack again.
        issuer.publish(command)
        with anyio.fail_after(5):
            while not (repeat := receiver.poll()):
                await anyio.sleep(0.02)
        assert not ledger.admit(repeat[0]) and ledger.repeats == 1
        again = await collect(acks, lambda m: True)
        assert again[0].command_id == "c-1" and again[0].step == 4
        assert again[0].seq > first[0].seq
        for closable in (issuer, acks, receiver, stage_pub):
            closable.close()


# --- CURVE ------------------------------------------------------------------------------


def test_curve_dir_is_private_and_stable(tmp_path: Path) -> None:
    keys = ensure_curve_dir(tmp_path / "keys")
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for name in ("server", "client"):
        assert stat.S_IMODE((keys / f"{name}.key_secret").stat().st_mode) == 0o600
    assert (keys / "authorized" / "client.key").is_file()
    first = load_client(keys)
    ensure_curve_dir(keys)  # reused, not regenerated
    assert load_client(keys) == first
    assert load_server(keys).public == first.server_public
    assert "secret" not in repr(first).replace("secret=", "")
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(UsageError, match="accessible"):
        ensure_curve_dir(open_dir)
    with pytest.raises(UsageError, match="does not exist"):
        load_client(tmp_path / "missing")


async def test_curve_admits_known_keys_only(tmp_path: Path, tcp_bus: BusAddress) -> None:
    keys = ensure_curve_dir(tmp_path / "keys")
    client = load_client(keys)
    rogue_dir = tmp_path / "rogue"
    rogue_dir.mkdir()
    zmq.auth.create_certificates(rogue_dir, "rogue")
    public, secret = zmq.auth.load_certificate(rogue_dir / "rogue.key_secret")
    assert secret is not None
    rogue = CurveConfig(server_public=client.server_public, public=public, secret=secret)
    with Broker(tcp_bus, curve=load_server(keys)):
        good = Subscriber(tcp_bus.endpoint("events_out"), [""], curve=client)
        bad = Subscriber(tcp_bus.endpoint("events_out"), [""], curve=rogue)
        plain = Subscriber(tcp_bus.endpoint("events_out"), [""])
        await connect(good, tcp_bus, curve=client)
        with Publisher(tcp_bus.endpoint("events_in"), source="stage/0", curve=client) as pub:
            for i in range(50):
                pub.publish(step_event(i))
            pub.publish(RunEnded(status="completed"))
        got = await collect(good, lambda m: isinstance(m, RunEnded))
        assert [m.step for m in got if isinstance(m, StepEnded)] == list(range(50))
        await anyio.sleep(0.5)
        assert await bad.receive(timeout=0.2) == []  # an unknown key receives nothing
        assert await plain.receive(timeout=0.2) == []  # and so does a client without CURVE
        with pytest.raises(UsageError, match="no evtrain broker answered"):
            Publisher(tcp_bus.endpoint("events_in"), source="x", curve=rogue, connect_timeout=0.5)
        with pytest.raises(UsageError):
            Publisher(tcp_bus.endpoint("events_in"), source="x", connect_timeout=0.5)
        assert ping_broker(tcp_bus, 5, curve=client)
        assert not ping_broker(tcp_bus, 0.5, curve=rogue)
        assert any(isinstance(m, StepEnded) for m in fetch_snapshot(tcp_bus, 5, curve=client))
        for sub in (good, bad, plain):
            sub.close()


# --- the broker itself ------------------------------------------------------------------


def test_broker_stop_is_idempotent_and_leaves_nothing() -> None:
    before = broker_threads()
    address = BusAddress.parse(f"ipc:///tmp/evt-new-{os.getpid()}-{time.monotonic_ns()}")
    broker = Broker(address)
    broker.start()
    assert Path(address.location).is_dir()
    assert broker_threads() > before
    broker.check()
    broker.stop()
    broker.stop()
    assert broker_threads() == before
    assert not Path(address.location).exists()  # it created the directory: removed

    kept = BusAddress.new_ipc()
    with Broker(kept) as other:
        other.check()
    assert Path(kept.location).is_dir() and not os.listdir(kept.location)
    os.rmdir(kept.location)
    assert broker_threads() == before


def test_binding_a_busy_bus_is_a_usage_error(ipc_bus: BusAddress, tcp_bus: BusAddress) -> None:
    before = broker_threads()
    with Broker(ipc_bus) as first:
        with pytest.raises(UsageError, match="already running"):
            Broker(ipc_bus).start()
        first.check()  # the running broker was not disturbed
        assert ping_broker(ipc_bus, 5)
    # The state port (the fifth) is taken: the state service's bind fails cleanly.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", tcp_bus.port + 4))
        squatter.listen()
        with pytest.raises(UsageError, match="cannot bind"):
            Broker(tcp_bus).start()
    assert broker_threads() == before


def test_ping_a_missing_broker(ipc_bus: BusAddress) -> None:
    assert not ping_broker(ipc_bus, 0.2)
    assert fetch_snapshot(ipc_bus, 0.2) == []


def test_the_state_service_keeps_replica_0s_step_of_each_stage(ipc_bus: BusAddress) -> None:
    with Broker(ipc_bus):
        with Publisher(ipc_bus.endpoint("events_in"), source="stage/1") as pub:
            pub.publish(run_started(2))
            pub.publish(StepEnded(step=5, stage=1, loss=0.5))
            # Later, with another step: the snapshot must still hold replica 0's.
            pub.publish(StepEnded(step=6, stage=1, replica=1, loss=0.25))
            # Steps are folded in before any later state event: once the run's end
            # is in the state, both steps were read.
            pub.publish(RunEnded(status="completed", step=6))

        def snapshot() -> list[Message]:
            return fetch_snapshot(ipc_bus, 5)

        until(lambda: any(isinstance(m, RunEnded) for m in snapshot()))
        steps = [(m.stage, m.replica, m.step) for m in snapshot() if isinstance(m, StepEnded)]
        assert steps == [(1, 0, 5)]


def test_a_delivery_is_due_until_every_stage_acknowledged_once() -> None:
    delivery = Delivery(wanted=2, retry_s=1.0)
    assert delivery.due(0.0)
    delivery.sent(0.0)
    assert not delivery.due(0.5) and delivery.due(1.0)
    assert delivery.acknowledged(1) and not delivery.acknowledged(1)  # a repeat is no news
    delivery.sent(1.0)
    assert delivery.due(2.5) and not delivery.done
    assert delivery.acknowledged(0) and delivery.done
    assert not delivery.due(10.0)


EXITING_PUBLISHER = """
import os, sys
from evtrain.bus import BusAddress, Publisher, flush_process
from helpers.bus_procs import step_event
pub = Publisher(BusAddress.parse(sys.argv[1]).endpoint("events_in"), source="test/exiting")
print("connected", flush=True)
sys.stdin.readline()
for i in range(int(sys.argv[3])):
    pub.publish(step_event(i))
pub.close()
if sys.argv[2] == "flush":
    flush_process()
os._exit(0)  # as a multiprocessing child (an elastic worker) ends
"""


async def test_a_process_that_ends_with_os_exit_flushes_its_last_events_first(
    buses: Buses, procs: object
) -> None:
    count = 3000
    _, address = start_bus(buses)
    watch = Subscriber(address.endpoint("events_out"), ["step.ended"])
    await connect(watch, address)
    proc = procs.python(  # type: ignore[attr-defined]
        "-c", EXITING_PUBLISHER, str(address), "flush", str(count),
        env=env_with_tests(), stdin=subprocess.PIPE,
    )  # fmt: skip
    assert Lines(proc).get() == "connected"
    proc.stdin.write("\n")
    proc.stdin.flush()
    seen = await collect(watch, lambda m: m.source == "test/exiting" and m.step == count - 1)
    assert len([m for m in seen if m.source == "test/exiting"]) == count
    assert proc.wait(timeout=20) == 0
