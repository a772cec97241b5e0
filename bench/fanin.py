"""Fan-in: many stage publishers -> one evtrain broker -> one subscriber, in one run.

    python bench/fanin.py [--publishers 1,8,64] [--events 192000] [--loads 0.5,0.7,0.9]

With P x D stage processes every one of them publishes to the same broker, so
the broker has to keep up with the sum. Each trial here starts a fresh broker
(``evtrain bus``, the broker of ``--external-bus`` and docker compose: the same
`Broker` the launcher runs in-process, in a process of its own so its CPU and
memory can be read), N publisher processes (forked; each one evtrain
`Publisher` with its own ``stage/i`` source, default queue) and one evtrain
`Subscriber` in this process, which counts what it receives per source and
counts gaps in the per-(source, topic) sequence numbers.

Each publisher plays a middle pipeline stage with microbatch spans on for every
step ("all"), M = 8: per step ``step.started``, per microbatch a receive wait,
a forward, a backward and a gradient wait, then the send-drain and control
waits and ``step.ended`` (4M + 4 = 36 events, 108-275 bytes each), and a
heartbeat once a second. Two kinds of trial, each with the same total number
of events split evenly over the publishers:

* burst: every publisher publishes its share as fast as it can. What the
  subscriber receives per second is the ceiling of one broker and one
  subscriber on this machine; what does not fit a queue is dropped (a
  publisher's own full queue counts a drop, a full queue from the broker to
  the subscriber shows as a sequence gap) by design: publishing never blocks.
* paced: the publishers publish whole steps at a fixed step rate, the way
  stages publish (a burst per step, then nothing), offering a fraction of the
  burst rate measured at the largest fan-in. Every publisher count runs at the
  first of ``--loads`` (the same load at 1, 8 and 64 publishers: the
  differences are what the fan-in itself costs); the largest count then climbs
  the other loads until a trial loses events. The fastest paced trial without
  a loss is the rate the bus keeps up with.

Figures per trial: events sent, dropped by publishers, received, lost between
publisher and subscriber (sent - received) and the gaps the subscriber saw in
the sequence numbers; the received rate (first to last event at the
subscriber); the broker's CPU seconds over the trial (all its threads, from
/proc) and per event; its resident memory before any publisher connected,
with N publishers connected and idle, and its peak (VmHWM) during the trial,
hence KiB per connected publisher. Every process started here ends with the
trial, also on Ctrl-C or an error. The last line printed is one JSON object.

`measure_fanin` (one trial) and `fanin_capacity` (a burst and the paced
ladder at one fan-in) are the entry points for other benchmarks
(bench/dp_scaling.py). The machine may be shared: the figures move with
what else runs; repeat and compare.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import queue
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from multiprocessing.synchronize import Event as EventType
from typing import Any

MICROBATCHES = 8
PUBLISHER_COUNTS = (1, 8, 64)
TOTAL_EVENTS = 192_000
"""Events per trial, over all publishers: about a second of the bus's burst rate."""
RUN_ID = "20261201-000000-fan1n0"  # as long as a real run id, so the envelopes are real-sized
START_TIMEOUT_S = 60.0
TRIAL_TIMEOUT_S = 90.0
LOADS = (0.5, 0.7, 0.9)
"""Paced loads, as fractions of the burst rate at the largest fan-in."""
QUIET_S = 1.0
"""After the last publisher reported: seconds without an event that end a trial."""


# --- /proc ---------------------------------------------------------------------


def proc_usage(pid: int) -> dict[str, float]:
    """CPU seconds (user + system, every thread) and VmRSS / VmHWM in KiB of ``pid``.

    /proc rather than psutil: the venv does not ship it, and these three
    numbers are all a benchmark needs. Zeros where /proc is missing.
    """
    usage = {"cpu_s": 0.0, "rss_kib": 0.0, "hwm_kib": 0.0}
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name may hold spaces and parentheses: fields start after the last ')'.
            fields = f.read().rsplit(")", 1)[1].split()
        usage["cpu_s"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == "VmRSS":
                    usage["rss_kib"] = float(value.split()[0])
                elif key == "VmHWM":
                    usage["hwm_kib"] = float(value.split()[0])
    except (OSError, IndexError, ValueError):
        pass
    return usage


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, however the parent ends."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


# --- the events a stage publishes -------------------------------------------------


def step_events(stage: int) -> list[Any]:
    """One step of a middle stage with every microbatch span on (4M + 4 events).

    Built once per publisher and published again every step: `Publisher.publish`
    stamps the envelope (source, sequence number, time) on each send.
    """
    from evtrain.events import (
        MicrobatchBackward,
        MicrobatchForward,
        MicrobatchWait,
        StepEnded,
        StepStarted,
    )

    now = time.time()
    events: list[Any] = [StepStarted(step=1, stage=stage)]
    for m in range(MICROBATCHES):
        events.append(
            MicrobatchWait(step=1, stage=stage, microbatch=m, start=now, end=now, op="recv_act")
        )
        events.append(MicrobatchForward(step=1, stage=stage, microbatch=m, start=now, end=now))
    for m in range(MICROBATCHES):
        events.append(
            MicrobatchWait(step=1, stage=stage, microbatch=m, start=now, end=now, op="recv_grad")
        )
        events.append(MicrobatchBackward(step=1, stage=stage, microbatch=m, start=now, end=now))
    events.append(MicrobatchWait(step=1, stage=stage, microbatch=-1, start=now, end=now, op="send"))
    events.append(
        MicrobatchWait(step=1, stage=stage, microbatch=-1, start=now, end=now, op="control")
    )
    events.append(
        StepEnded(
            step=1,
            stage=stage,
            lr=3e-4,
            grad_norm=0.98,
            samples=256,
            duration_s=0.0456,
            forward_s=0.0123,
            backward_s=0.0234,
            comm_wait_s=0.0012,
            peak_memory_bytes=312_456_789,
        )
    )
    return events


def mean_event_bytes() -> float:
    """Mean encoded payload of the benchmark's step (envelope stamped as on the bus)."""
    from evtrain.events import encode

    sizes = []
    for event in step_events(1023):
        event.source, event.run_id, event.seq, event.ts = "stage/1023", RUN_ID, 123_456, time.time()
        sizes.append(len(encode(event)))
    return statistics.fmean(sizes)


# --- one publisher process ---------------------------------------------------------


def _publisher(
    index: int,
    endpoint: str,
    count: int,
    steps_per_s: float,
    ready: mp.Queue[Any],
    start: EventType,
    results: mp.Queue[Any],
) -> None:
    """Connect, wait for the start, publish ``count`` events, flush, report the counters."""
    # Ctrl-C is the parent's to handle: it ends every child itself. A fork inherits the
    # parent's handlers too (torch.distributed.elastic leaves one on SIGTERM): the default.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent()
    import zmq

    from evtrain.bus import Publisher
    from evtrain.events import Heartbeat
    from evtrain.logs import configure_logging

    configure_logging("console", "warning")  # structlog's default would print to stdout
    # A context of its own: the one a fork inherits belongs to the parent.
    context = zmq.Context()
    pub = Publisher(endpoint, source=f"stage/{index}", run_id=RUN_ID, context=context)
    stage = index % 1024
    step = step_events(stage)
    heartbeat = Heartbeat(stage=stage, step=0)
    publish = pub.publish
    ready.put(index)
    if not start.wait(START_TIMEOUT_S):
        pub.close(linger=0)
        context.term()
        return
    cpu = time.process_time()
    begin = time.time()
    next_beat = begin + 1.0
    sent_calls = 0
    steps = 0
    while sent_calls < count:
        now = time.time()
        if now >= next_beat:  # a heartbeat once a second, as a stage's event loop sends
            next_beat += 1.0
            publish(heartbeat)
            sent_calls += 1
            continue
        if steps_per_s:
            due = begin + steps / steps_per_s
            if due > now:
                time.sleep(min(due, next_beat) - now)
                continue
        for event in step[: count - sent_calls]:
            publish(event)
        sent_calls = min(count, sent_calls + len(step))
        steps += 1
    end = time.time()
    cpu = time.process_time() - cpu
    # close() reports outstanding drops (one bus.drops event); term() waits for the flush.
    pub.close(linger=10.0)
    context.term()
    results.put(
        {
            "index": index,
            "sent": pub.sent,
            "dropped": pub.dropped,
            "begin": begin,
            "end": end,
            "cpu_s": cpu,
        }
    )


# --- the broker --------------------------------------------------------------------


@contextlib.contextmanager
def running_broker() -> Iterator[tuple[str, int]]:
    """``evtrain bus`` on a fresh short ipc directory: yields (address, pid), ends it."""
    directory = tempfile.mkdtemp(prefix="evt-fan-", dir="/tmp")
    address = f"ipc://{directory}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "evtrain", "--log-level", "warning", "bus", "--bus", address],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # Ctrl-C reaches us, and we end it in order
        preexec_fn=_die_with_parent,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline().strip() if ready else ""
        if line != address:
            raise RuntimeError(f"evtrain bus did not start (printed {line!r}, rc {proc.poll()})")
        yield address, proc.pid
    finally:
        if proc.poll() is None:
            proc.terminate()  # the broker unbinds and closes its sockets on SIGTERM
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


def _end_children(children: list[mp.process.BaseProcess], grace: float) -> None:
    """Let the children exit by themselves within ``grace`` seconds, then end the rest."""
    deadline = time.monotonic() + grace
    for child in children:
        child.join(timeout=max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            child.terminate()
    deadline = time.monotonic() + 5.0
    for child in children:
        child.join(timeout=max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join(timeout=5.0)


def _get(q: mp.Queue[Any], deadline: float, what: str) -> Any:
    try:
        return q.get(timeout=max(0.01, deadline - time.monotonic()))
    except queue.Empty:
        raise RuntimeError(f"timed out waiting for {what}") from None


# --- one trial ---------------------------------------------------------------------


def measure_fanin(
    publishers: int, events_per_publisher: int, steps_per_s: float = 0.0
) -> dict[str, Any]:
    """One trial: ``publishers`` processes publish ``events_per_publisher`` events each.

    ``steps_per_s`` paces each publisher to that many simulated steps (bursts of
    4M + 4 events) per second; 0 publishes as fast as possible. Returns the
    trial's figures (see the module docstring); raises if it cannot finish.
    """
    import zmq

    from evtrain.bus import Publisher, Subscriber
    from evtrain.bus.address import BusAddress
    from evtrain.events import Heartbeat

    # Forked children: they start in milliseconds, 64 fresh interpreters would take
    # longer than the trial. The parent holds no zmq context at the fork (see below).
    ctx = mp.get_context("fork")
    ready: mp.Queue[Any] = ctx.Queue()
    results: mp.Queue[Any] = ctx.Queue()
    start = ctx.Event()
    children: list[mp.process.BaseProcess] = []
    context: zmq.Context | None = None
    sub: Subscriber | None = None
    grace = 0.0  # seconds the children get to exit by themselves: only after a full trial
    with running_broker() as (address, broker_pid):
        bus = BusAddress.parse(address)
        try:
            base = proc_usage(broker_pid)
            for index in range(publishers):
                child = ctx.Process(
                    target=_publisher,
                    args=(
                        index,
                        bus.endpoint("events_in"),
                        events_per_publisher,
                        steps_per_s,
                        ready,
                        start,
                        results,
                    ),
                    daemon=True,
                )
                child.start()
                children.append(child)
            deadline = time.monotonic() + START_TIMEOUT_S
            for _ in range(publishers):
                _get(ready, deadline, "the publishers to connect")
            time.sleep(0.2)  # let the broker's I/O thread settle the last handshakes
            connected = proc_usage(broker_pid)
            # Only now a zmq context here: the forks above copied no I/O thread.
            context = zmq.Context()
            sub = Subscriber(bus.endpoint("events_out"), context=context, hwm=10_000)
            # The subscription travels to the broker asynchronously: confirm it is in
            # place with a probe before anyone publishes what must be counted.
            probe = Publisher(bus.endpoint("events_in"), source="bench/probe", context=context)
            probe_deadline = time.monotonic() + START_TIMEOUT_S
            while not any(m.source == "bench/probe" for m in sub.drain()):
                if time.monotonic() > probe_deadline:
                    raise RuntimeError("the subscriber never received the probe")
                probe.publish(Heartbeat(step=0))
                time.sleep(0.01)
            probe.close(linger=0)
            time.sleep(0.05)
            sub.drain()  # late probes
            probe_gaps = sub.gaps.total_missing
            per_source: Counter[str] = Counter()
            reports: list[dict[str, Any]] = []
            before = proc_usage(broker_pid)
            sub_cpu = time.process_time()
            start.set()
            first = last = 0.0
            received = 0
            quiet_since = time.monotonic()
            trial_deadline = time.monotonic() + TRIAL_TIMEOUT_S
            drain = sub.drain
            while True:
                batch = drain()
                if batch:
                    now = time.perf_counter()
                    if not first:
                        first = now
                    last = now
                    received += len(batch)
                    per_source.update(m.source for m in batch)
                    quiet_since = time.monotonic()
                    continue
                while len(reports) < publishers:
                    try:
                        reports.append(results.get_nowait())
                    except queue.Empty:
                        break
                if len(reports) == publishers:
                    expected = sum(r["sent"] for r in reports)
                    if received >= expected or time.monotonic() - quiet_since > QUIET_S:
                        break
                if time.monotonic() > trial_deadline:
                    raise RuntimeError(
                        f"trial did not finish in {TRIAL_TIMEOUT_S:g} s "
                        f"({len(reports)}/{publishers} publishers reported, {received} received)"
                    )
                time.sleep(0.001)
            sub_cpu = time.process_time() - sub_cpu
            after = proc_usage(broker_pid)
            gaps = sub.gaps.total_missing - probe_gaps
            grace = 5.0  # every child reported: each is exiting
        finally:
            if sub is not None:
                sub.close()
            if context is not None:
                context.term()  # ends its I/O thread before the next trial forks
            _end_children(children, grace)
    probe_received = per_source.pop("bench/probe", 0)
    received -= probe_received
    sent = sum(r["sent"] for r in reports)
    pub_dropped = sum(r["dropped"] for r in reports)
    lost = max(0, sent - received)
    seconds = max(last - first, 1e-9)
    publish_window = max(r["end"] for r in reports) - min(r["begin"] for r in reports)
    broker_cpu = after["cpu_s"] - before["cpu_s"]
    counts = [per_source.get(f"stage/{i}", 0) for i in range(publishers)]
    return {
        "publishers": publishers,
        "events_per_publisher": events_per_publisher,
        "mode": "paced" if steps_per_s else "burst",
        "target_events_per_s": round(steps_per_s * publishers * (4 * MICROBATCHES + 4))
        if steps_per_s
        else None,
        "sent": sent,
        "publisher_dropped": pub_dropped,
        "received": received,
        "lost_after_publisher": lost,
        "sequence_gaps": gaps,
        "dropped": pub_dropped + lost,
        "events_per_s": round((received - 1) / seconds) if received > 1 else 0,
        "offered_events_per_s": round((sent + pub_dropped) / max(publish_window, 1e-9)),
        "seconds": round(seconds, 3),
        "per_source_min": min(counts),
        "per_source_max": max(counts),
        "broker_cpu_s": round(broker_cpu, 3),
        "broker_cpu_us_per_event": round(broker_cpu / max(received, 1) * 1e6, 3),
        "broker_cpu_share": round(broker_cpu / seconds, 3),
        "broker_rss_base_kib": base["rss_kib"],
        "broker_rss_connected_kib": connected["rss_kib"],
        "broker_rss_peak_kib": after["hwm_kib"],
        "broker_rss_end_kib": after["rss_kib"],
        "broker_kib_per_publisher": round(
            (connected["rss_kib"] - base["rss_kib"]) / max(publishers, 1), 1
        ),
        "subscriber_cpu_us_per_event": round(sub_cpu / max(received, 1) * 1e6, 3),
        "publisher_cpu_us_per_event": round(
            sum(r["cpu_s"] for r in reports) / max(sent, 1) * 1e6, 3
        ),
    }


# --- main --------------------------------------------------------------------------


HEADER = (
    f"{'mode':>6} {'pubs':>4} {'target/s':>9} {'received/s':>10} {'sent':>8} {'received':>8} "
    f"{'pubdrop':>7} {'lost':>7} {'gaps':>7} {'brk cpu':>7} {'us/ev':>6} "
    f"{'rss0':>5} {'rssN':>5} {'peak':>5}"
)


def describe(r: dict[str, Any]) -> str:
    """One table row of a trial (columns: `HEADER`)."""
    target = f"{r['target_events_per_s']:,}" if r["target_events_per_s"] else "max"
    return (
        f"{r['mode']:>6} {r['publishers']:>4} {target:>9} {r['events_per_s']:>10,} "
        f"{r['sent']:>8,} {r['received']:>8,} {r['publisher_dropped']:>7,} "
        f"{r['lost_after_publisher']:>7,} {r['sequence_gaps']:>7,} "
        f"{r['broker_cpu_s']:>7.2f} {r['broker_cpu_us_per_event']:>6.2f} "
        f"{r['broker_rss_base_kib'] / 1024:>5.1f} {r['broker_rss_connected_kib'] / 1024:>5.1f} "
        f"{r['broker_rss_peak_kib'] / 1024:>5.1f}"
    )


def paced_rate(ceiling: float, load: float, publishers: int) -> float:
    """Steps/s per publisher: ``publishers`` of them offer ``load`` x ``ceiling`` events/s."""
    return load * ceiling / publishers / (4 * MICROBATCHES + 4)


def ladder(
    publishers: int,
    total_events: int,
    ceiling: float,
    loads: list[float],
    report: Callable[[dict[str, Any]], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Paced trials at rising fractions of ``ceiling``, until one loses events."""
    trials = []
    for load in loads:
        trial = measure_fanin(
            publishers, total_events // publishers, paced_rate(ceiling, load, publishers)
        )
        trials.append(trial)
        report(trial)
        if trial["dropped"]:
            break
    return trials


def lossless_rate(trials: list[dict[str, Any]]) -> int:
    """The highest received rate of the paced trials that lost nothing (0 if none)."""
    return max(
        (t["events_per_s"] for t in trials if t["mode"] == "paced" and not t["dropped"]), default=0
    )


def fanin_capacity(
    publishers: int = 64,
    total_events: int = TOTAL_EVENTS,
    loads: tuple[float, ...] = LOADS,
    report: Callable[[dict[str, Any]], None] = lambda _: None,
) -> dict[str, Any]:
    """A burst, then paced trials up to the first lossy one, all with ``publishers``.

    ``events_per_s`` / ``dropped`` are those of the fastest paced trial that lost
    nothing (else of the slowest paced trial): the rate one broker and one
    subscriber keep up with; a lower bound only when no paced trial lost events
    (``limit_found`` False). ``burst_*`` are the unpaced ceiling and its losses.
    """
    burst = measure_fanin(publishers, total_events // publishers)
    report(burst)
    paced = ladder(publishers, total_events, burst["events_per_s"], list(loads), report)
    clean = [t for t in paced if not t["dropped"]]
    best = max(clean, key=lambda t: t["events_per_s"]) if clean else paced[0]
    return {
        "publishers": publishers,
        "events_per_s": best["events_per_s"],
        "dropped": best["dropped"],
        "limit_found": any(t["dropped"] for t in paced),
        "sent": best["sent"],
        "received": best["received"],
        "broker_cpu_us_per_event": best["broker_cpu_us_per_event"],
        "broker_rss_peak_kib": best["broker_rss_peak_kib"],
        "burst_events_per_s": burst["events_per_s"],
        "burst_dropped": burst["dropped"],
        "burst_broker_cpu_us_per_event": burst["broker_cpu_us_per_event"],
        "broker_kib_per_publisher": burst["broker_kib_per_publisher"],
        "trials": [burst, *paced],
    }


def exit_on_sigterm() -> None:
    """SIGTERM ends this process like Ctrl-C does: through the cleanup of every trial."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--publishers",
        default=",".join(str(n) for n in PUBLISHER_COUNTS),
        help="publisher counts, comma-separated (default 1,8,64)",
    )
    parser.add_argument(
        "--events", type=int, default=TOTAL_EVENTS, help="events per trial over all publishers"
    )
    parser.add_argument(
        "--loads",
        default=",".join(str(x) for x in LOADS),
        help="paced loads as fractions of the largest count's burst rate: every count at the "
        "first, the largest count up the rest until a trial loses events",
    )
    args = parser.parse_args()
    counts = sorted({int(n) for n in args.publishers.split(",") if n})
    loads = [float(x) for x in args.loads.split(",") if x]
    size = mean_event_bytes()
    print(
        f"{os.cpu_count()} cores; {args.events:,} events per trial; a step is "
        f"{4 * MICROBATCHES + 4} events, mean payload {size:.0f} bytes; one evtrain bus "
        "process, publishers forked, one Subscriber in this process"
    )
    print(
        "columns: publishers' target rate, rate received; events sent, received, dropped by "
        "publishers, lost after them, sequence gaps seen; broker CPU s, us per event "
        "received; broker RSS MiB before publishers, with them connected, peak"
    )
    print(HEADER, flush=True)

    def report(trial: dict[str, Any]) -> None:
        print(describe(trial), flush=True)

    trials: list[dict[str, Any]] = []
    for n in counts:
        trials.append(measure_fanin(n, args.events // n))
        report(trials[-1])
    biggest = counts[-1]
    ceiling = trials[-1]["events_per_s"]
    if loads:
        for n in counts[:-1]:
            trials += ladder(n, args.events, ceiling, loads[:1], report)
        trials += ladder(biggest, args.events, ceiling, loads, report)
    burst = [t for t in trials if t["mode"] == "burst"]
    paced = [t for t in trials if t["mode"] == "paced"]
    same_load = [t for t in paced if t["target_events_per_s"] == paced[0]["target_events_per_s"]]
    # Memory per connection from the slope between the smallest and the largest fan-in:
    # one connection alone is within the allocator's noise.
    low, high = burst[0], burst[-1]
    per_publisher = (
        (high["broker_rss_connected_kib"] - low["broker_rss_connected_kib"])
        / (high["publishers"] - low["publishers"])
        if high["publishers"] > low["publishers"]
        else high["broker_kib_per_publisher"]
    )
    ladder_trials = [t for t in paced if t["publishers"] == biggest]
    lossless = lossless_rate(ladder_trials)
    limit_found = any(t["dropped"] for t in ladder_trials)
    print(
        f"{biggest} publishers: burst ceiling {ceiling:,} events/s received; lossless up to "
        f"{lossless:,} events/s paced{'' if limit_found else ' (no paced trial lost events)'}; "
        f"broker RSS {per_publisher:.1f} KiB per connected "
        "publisher; broker CPU per event "
        + ", ".join(f"{t['publishers']}: {t['broker_cpu_us_per_event']:.2f} us" for t in same_load)
        + " at the same paced load"
    )
    summary: dict[str, Any] = {
        "cores": os.cpu_count(),
        "events_per_trial": args.events,
        "mean_event_bytes": round(size, 1),
        "publishers": biggest,
        "burst_events_per_s": {str(t["publishers"]): t["events_per_s"] for t in burst},
        "burst_dropped": {str(t["publishers"]): t["dropped"] for t in burst},
        "lossless_events_per_s": lossless,
        "lossless_limit_found": limit_found,
        "paced_target_events_per_s": same_load[0]["target_events_per_s"] if same_load else None,
        "paced_events_per_s": {str(t["publishers"]): t["events_per_s"] for t in same_load},
        "paced_dropped": {str(t["publishers"]): t["dropped"] for t in same_load},
        "paced_broker_cpu_us_per_event": {
            str(t["publishers"]): t["broker_cpu_us_per_event"] for t in same_load
        },
        "burst_broker_cpu_us_per_event": {
            str(t["publishers"]): t["broker_cpu_us_per_event"] for t in burst
        },
        "broker_kib_per_publisher": round(per_publisher, 1),
        "broker_rss_peak_kib": {
            f"{t['mode']}_{t['publishers']}": t["broker_rss_peak_kib"] for t in trials
        },
        "trials": trials,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
