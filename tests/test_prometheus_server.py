"""A real Prometheus server scrapes the exporter of a real ``evtrain launch`` run.

Needs the ``prometheus`` binary (Debian: ``apt-get install -y prometheus``, 2.42);
skipped without it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from launch_helpers import kill_marked, launch_cmd, launch_env, new_marker, write_spec

from evtrain.bus.address import BusAddress
from evtrain.bus.publisher import Publisher
from evtrain.events import StopRun

PROMETHEUS = shutil.which("prometheus")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="prometheus binary not installed (apt-get install -y prometheus)",
    ),
]

CONFIG = """\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: evtrain
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _query(port: int, promql: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            body = json.load(response)
    except OSError:
        return []  # not up yet
    assert body["status"] == "success", body
    return list(body["data"]["result"])


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="evt-prom-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_prometheus_sees_the_steps_counter_rise(procs: Any, workdir: Path) -> None:
    assert PROMETHEUS is not None
    exporter_port, prometheus_port = _free_port(), _free_port()
    # ~50 steps/s (a 5 ms sleep in each microbatch forward); stopped once seen rising.
    spec = write_spec(
        workdir,
        steps=3000,
        delay=0.005,
        hooks=[dict(type="prometheus", port=exporter_port)],
    )
    config = workdir / "prometheus.yml"
    config.write_text(CONFIG.format(port=exporter_port))
    marker = new_marker()
    logs = workdir / "logs"
    logs.mkdir()
    try:
        procs.start(
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}",
            stdout=subprocess.DEVNULL,
            stderr=(logs / "prometheus.log").open("w"),
        )
        launch = procs.start(
            *launch_cmd(spec, "--quiet"),
            env=launch_env(marker),
            stdout=(logs / "launch.out").open("w"),
            stderr=(logs / "launch.err").open("w"),
        )
        seen: list[float] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and launch.poll() is None:
            result = _query(prometheus_port, "evtrain_steps_total")
            if result:
                value = float(result[0]["value"][1])
                if value > 0 and (not seen or value > seen[-1]):
                    seen.append(value)
                if len(seen) >= 3:
                    break
            time.sleep(0.3)
        assert len(seen) >= 3, (
            f"steps counter seen by Prometheus: {seen}; launch:\n"
            + (logs / "launch.err").read_text()[-3000:]
        )

        up = _query(prometheus_port, "evtrain_stage_up")
        assert {r["metric"]["stage"]: r["value"][1] for r in up} == {"0": "1", "1": "1"}
        assert all(r["metric"]["job"] == "evtrain" for r in up)
        durations = _query(prometheus_port, "evtrain_step_duration_seconds_count")
        assert {r["metric"]["stage"] for r in durations} == {"0", "1"}
        assert _query(prometheus_port, "evtrain_loss")

        # End the run with a stop command, as a hook would (SIGTERM works too, but
        # elastic then waits for its shutdown timeout).
        bus = json.loads((workdir / "run" / "run.json").read_text())["bus"]
        stop = StopRun(command_id="prometheus-test-stop", reason="the test saw enough")
        with Publisher(BusAddress.parse(bus).endpoint("commands_in"), source="test") as pub:
            deadline = time.monotonic() + 30
            while launch.poll() is None and time.monotonic() < deadline:
                pub.publish(stop)  # the same id: applied once, however often it arrives
                time.sleep(0.3)
        assert launch.wait(timeout=30) == 0, (logs / "launch.err").read_text()[-3000:]
    finally:
        kill_marked(marker)
