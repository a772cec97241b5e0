"""Bus throughput: Publisher -> Broker -> Hook against raw pyzmq, in one run.

    python bench/bus_throughput.py [--count 200000] [--repeats 3] [--transport ipc|tcp]

Each repeat measures both paths, one right after the other, with the same
~240-byte `StepEnded` payload and every endpoint in its own process:

* raw: a pyzmq XPUB with ``XPUB_NODROP`` and blocking sends (lossless) -> a SUB
  that receives with ``recv_multipart`` (two processes, no decoding). Its rate is
  its lossless maximum: the blocking send paces the publisher to the receiver.
* bus: `Publisher` (non-blocking publish) -> ``evtrain bus`` (a broker process)
  -> ``HookRunner`` with one ``@on(StepEnded)`` handler that counts (three
  processes; the hook decodes, tracks sequences, folds run state, dispatches).
  The bus never blocks a publisher, so a burst faster than the hook is dropped
  at the broker by design. The comparable figure is therefore the highest
  *lossless* rate: a publisher paces itself at fractions of the raw rate (one
  second each) and the best trial the hook received completely counts. An
  unpaced burst is reported too, with its losses.

Rates are measured at the receiver, first to last event; "pub/brk/hook cpu" are
the CPU microseconds each process spent per event (publisher loop, broker
process, hook process). Publish-call latency (median, p99) is timed around
every non-blocking `Publisher.publish` of all bus trials. The machine may be
shared: repeat, and read the per-repeat ratios.

Prints a table, then one JSON object as the last line; besides the rates it
holds the CPU per event of each process in the fastest lossless trial
(``pub_cpu_us``, ``broker_cpu_us``, ``hook_cpu_us``, medians over the repeats)
and the 1-minute load average before and after (``load_average``): on a shared
machine the CPU figures move less than the rates.

Figures: docs/benchmarks.md (Bus throughput).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import zmq

from evtrain.events import RunEnded, StepEnded, encode

HERE = os.path.abspath(__file__)


def sample_event(seq: int = 0) -> StepEnded:
    """The benchmark's event: a full step report (~240 bytes encoded)."""
    return StepEnded(
        step=seq,
        stage=1,
        loss=2.3456789,
        lr=3.0e-4,
        grad_norm=0.987654,
        samples=256,
        epoch=3,
        duration_s=0.0456,
        forward_s=0.0123,
        backward_s=0.0234,
        comm_wait_s=0.0012,
        peak_memory_bytes=123_456_789,
        metrics={"accuracy": 0.91},
        run_id="bench-run-0001",
        source="stage/1",
        seq=seq,
        ts=time.time(),
    )


# --- roles run in child processes ---------------------------------------------------


def role_raw_sub(endpoint: str, count: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    sock.setsockopt(zmq.SUBSCRIBE, b"step.")
    sock.bind(endpoint)
    print("ready", flush=True)
    recv = sock.recv_multipart
    recv()
    first = time.perf_counter()
    for _ in range(count - 1):
        recv()
    last = time.perf_counter()
    print(json.dumps({"count": count, "seconds": last - first}), flush=True)
    sock.close(linger=0)
    ctx.term()


def role_raw_pub(endpoint: str, count: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.XPUB_NODROP, 1)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.connect(endpoint)
    sock.recv()  # the subscription: the link is up
    event = sample_event()
    topic, payload = event.topic, encode(event)
    send = sock.send_multipart
    for _ in range(count):
        send((topic, payload))  # blocking: lossless
    sock.close(linger=10_000)
    ctx.term()


def role_bus_hook(bus: str, trials: int) -> None:
    import anyio

    from evtrain.hooks import Hook, HookRunner, on

    class Counter(Hook):
        """Counts each trial's events (``epoch`` = trial); its RunEnded ends the trial."""

        name = "bench-counter"

        def __init__(self) -> None:
            super().__init__()
            self.count = 0
            self.first = 0.0
            self.last = 0.0
            self.trial = 0
            self.cpu = time.process_time()

        @on(StepEnded)
        def count_step(self, ev: StepEnded) -> None:
            if ev.epoch != self.trial:
                return
            now = time.perf_counter()
            if self.count == 0:
                self.first = now
            self.count += 1
            self.last = now

        @on(RunEnded)
        def trial_ended(self, ev: RunEnded) -> None:
            if ev.reason != str(self.trial):
                return
            seconds = max(self.last - self.first, 1e-9)
            cpu = time.process_time()
            cpu_us = (cpu - self.cpu) / max(self.count, 1) * 1e6
            print(
                json.dumps({"count": self.count, "seconds": seconds, "cpu_us": cpu_us}),
                flush=True,
            )
            self.cpu = cpu
            self.trial += 1
            self.count = 0
            if self.trial == trials:
                self.runner.stop()

    runner = HookRunner([Counter()], bus)

    async def main() -> None:
        async with anyio.create_task_group() as tg:

            async def announce() -> None:
                await runner.ready.wait()
                print("ready", flush=True)

            tg.start_soon(announce)
            await runner.run()

    anyio.run(main)


def role_bus_pub(bus: str, count: int, rate: float, trial: int) -> None:
    """Publish ``count`` events at ``rate``/s (0: as fast as possible) as trial ``trial``."""
    from evtrain.bus import BusAddress, Publisher

    address = BusAddress.parse(bus)
    pub = Publisher(address.endpoint("events_in"), source=f"stage/{trial}", hwm=count + 10_000)
    events = [sample_event(i) for i in range(count)]
    for event in events:
        event.epoch = trial
    clock = time.perf_counter_ns
    durations = [0] * count
    publish = pub.publish
    sent = 0
    cpu = time.process_time()
    start = time.perf_counter()
    while sent < count:
        # Paced in 0.5 ms slices: publish what is due, then sleep.
        due = count if not rate else min(count, int((time.perf_counter() - start) * rate) + 1)
        while sent < due:
            t0 = clock()
            publish(events[sent])
            durations[sent] = clock() - t0
            sent += 1
        if sent < count:
            time.sleep(0.0005)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    durations.sort()
    print(
        json.dumps(
            {
                "publish_median_us": durations[count // 2] / 1000,
                "publish_p99_us": durations[int(count * 0.99)] / 1000,
                "publish_max_us": durations[-1] / 1000,
                "dropped": pub.dropped,
                "offered_per_s": count / elapsed,
                "cpu_us": cpu / count * 1e6,
            }
        ),
        flush=True,
    )
    # End the trial until the parent stops us: the end marker itself may be lost.
    while True:
        time.sleep(0.2)
        pub.publish(RunEnded(status="completed", reason=str(trial)))


# --- the parent ------------------------------------------------------------------------


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _line(proc: subprocess.Popen[str], timeout: float = 60.0) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        raise RuntimeError(f"process {proc.args} ended without output (rc {proc.wait(timeout)})")
    return line


def _end(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of process ``pid`` so far; 0 where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _endpoint(transport: str, tmp: str) -> str:
    if transport == "ipc":
        return f"ipc://{tmp}/raw"
    from evtrain.bus.address import free_port_block

    return f"tcp://127.0.0.1:{free_port_block()}"


def run_raw(count: int, transport: str) -> float:
    tmp = tempfile.mkdtemp(prefix="evt-bench-", dir="/tmp")
    sub = pub = None
    try:
        endpoint = _endpoint(transport, tmp)
        sub = _spawn(HERE, "raw-sub", endpoint, str(count))
        assert _line(sub) == "ready"
        pub = _spawn(HERE, "raw-pub", endpoint, str(count))
        result = json.loads(_line(sub))
        return (result["count"] - 1) / result["seconds"]
    finally:
        _end(*(p for p in (pub, sub) if p is not None))
        shutil.rmtree(tmp, ignore_errors=True)


def run_bus(
    raw_rate: float, burst: int, transport: str, fractions: list[float], seconds: float
) -> dict[str, Any]:
    """One broker and hook; an unpaced burst, then paced trials at ``fractions`` of raw."""
    bus_args = ["--tcp", "127.0.0.1"] if transport == "tcp" else []
    broker = _spawn("-m", "evtrain", "--log-level", "warning", "bus", *bus_args)
    hook = None
    trials: list[dict[str, Any]] = []
    try:
        address = _line(broker)
        hook = _spawn(HERE, "bus-hook", address, "1000000")
        assert _line(hook) == "ready"
        plan = [(0.0, burst), *((f * raw_rate, int(f * raw_rate * seconds)) for f in fractions)]
        for trial, (rate, count) in enumerate(plan):
            broker_cpu = _cpu_seconds(broker.pid)
            pub = _spawn(HERE, "bus-pub", address, str(count), str(rate), str(trial))
            try:
                published = json.loads(_line(pub))
                received = json.loads(_line(hook))
                broker_cpu = _cpu_seconds(broker.pid) - broker_cpu
            finally:
                _end(pub)
            trials.append(
                {
                    **published,
                    "rate": rate,
                    "count": count,
                    "received": received["count"],
                    "events_per_s": (received["count"] - 1) / received["seconds"],
                    "hook_cpu_us": received["cpu_us"],
                    "broker_cpu_us": broker_cpu / count * 1e6,
                }
            )
            lossy = [t["received"] < t["count"] for t in trials[1:]]
            if lossy[-2:] == [True, True]:
                break  # two lossy trials in a row end the ladder (one may be a hiccup)
    finally:
        _end(*(p for p in (hook,) if p is not None))
        broker.terminate()
        broker.wait(timeout=10)
    lossless = [t for t in trials[1:] if t["received"] == t["count"]]
    best = max(lossless, key=lambda t: t["events_per_s"], default=None)
    return {
        "burst": trials[0],
        "trials": trials[1:],
        "best": best,
        "lossless_events_per_s": best["events_per_s"] if best is not None else 0.0,
        "publish_median_us": statistics.median(t["publish_median_us"] for t in trials),
        "publish_p99_us": statistics.median(t["publish_p99_us"] for t in trials),
    }


def _median_of_best(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r["best"][key] for r in rows if r["best"] is not None]
    return round(statistics.median(values), 2) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200_000, help="events per raw run/burst")
    parser.add_argument("--repeats", type=int, default=3, help="raw + bus repeats")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of a paced trial")
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    parser.add_argument(
        "--fractions",
        default="0.5,0.6,0.7,0.8,0.9,1.0,1.1",
        help="paced trial rates, as fractions of the raw rate (comma-separated)",
    )
    args = parser.parse_args()
    fractions = [float(f) for f in args.fractions.split(",")]

    print(
        f"{args.count} events per burst, {args.transport}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(
        "raw: lossless XPUB(NODROP, blocking) -> SUB; bus: Publisher -> evtrain bus -> "
        "HookRunner, paced at fractions of the raw rate until two trials in a row lose events"
    )
    load_before = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        raw = run_raw(args.count, args.transport)
        bus = run_bus(raw, args.count, args.transport, fractions, args.seconds)
        row = {"raw": raw, **bus}
        rows.append(row)
        burst = bus["burst"]
        print(
            f"repeat {repeat}: raw {raw:,.0f} ev/s | bus burst {burst['events_per_s']:,.0f} ev/s "
            f"({burst['count'] - burst['received']} of {burst['count']} lost at the broker; "
            f"hook CPU {burst['hook_cpu_us']:.1f} us/event)"
        )
        print(
            f"  {'offered ev/s':>13} {'received ev/s':>14} {'lost':>6} {'pub med us':>10} "
            f"{'pub p99 us':>10} {'pub cpu':>8} {'brk cpu':>8} {'hook cpu':>8}"
        )
        for t in bus["trials"]:
            print(
                f"  {t['offered_per_s']:>13,.0f} {t['events_per_s']:>14,.0f} "
                f"{t['count'] - t['received']:>6} {t['publish_median_us']:>10.2f} "
                f"{t['publish_p99_us']:>10.2f} {t['cpu_us']:>8.1f} {t['broker_cpu_us']:>8.1f} "
                f"{t['hook_cpu_us']:>8.1f}"
            )
        print(
            f"  lossless bus rate {bus['lossless_events_per_s']:,.0f} ev/s = "
            f"{bus['lossless_events_per_s'] / raw:.2f} x raw (load average "
            f"{os.getloadavg()[0]:.2f})",
            flush=True,
        )
    raw_rate = statistics.median(r["raw"] for r in rows)
    bus_rate = statistics.median(r["lossless_events_per_s"] for r in rows)
    ratios = [r["lossless_events_per_s"] / r["raw"] for r in rows]
    summary = {
        "count": args.count,
        "repeats": args.repeats,
        "transport": args.transport,
        "raw_events_per_s": round(raw_rate),
        "bus_events_per_s": round(bus_rate),
        "ratio": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
        "bus_burst_events_per_s": round(
            statistics.median(r["burst"]["events_per_s"] for r in rows)
        ),
        "publish_median_us": round(statistics.median(r["publish_median_us"] for r in rows), 3),
        "publish_p99_us": round(statistics.median(r["publish_p99_us"] for r in rows), 3),
        "publisher_dropped": sum(t["dropped"] for r in rows for t in [r["burst"], *r["trials"]]),
        # CPU per event of the fastest lossless trial: steadier than rates when the
        # machine is shared, which the load averages (1 minute) tell.
        **{
            f"{proc}_cpu_us": _median_of_best(rows, key)
            for proc, key in (
                ("pub", "cpu_us"),
                ("broker", "broker_cpu_us"),
                ("hook", "hook_cpu_us"),
            )
        },
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(
        f"median: raw {raw_rate:,.0f} ev/s, bus lossless {bus_rate:,.0f} ev/s, "
        f"ratio {summary['ratio']} (per repeat {summary['ratios']}), "
        f"publish median {summary['publish_median_us']} us, p99 {summary['publish_p99_us']} us"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("raw-sub", "raw-pub", "bus-hook", "bus-pub"):
        from evtrain.logs import configure_logging

        configure_logging("console", "warning")  # structlog's default would print to stdout
        role, target, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
        if role == "bus-pub":
            role_bus_pub(target, n, float(sys.argv[4]), int(sys.argv[5]))
        else:
            {"raw-sub": role_raw_sub, "raw-pub": role_raw_pub, "bus-hook": role_bus_hook}[role](
                target, n
            )
    else:
        main()
