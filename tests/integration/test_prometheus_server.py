"""A real Prometheus server scrapes the exporter of a real ``evtrain launch`` run, and that
of a data-parallel fake run, on which every query of the Grafana dashboard is evaluated;
with deploy/rules.yml loaded, a run that hangs fires the stall and the hang alerts.

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
from helpers.hook_helpers import fake_args, wait_for_text
from helpers.launch_helpers import kill_marked, launch_cmd, launch_env, new_marker, write_spec

from evtrain.bus.address import BusAddress
from evtrain.bus.publisher import Publisher
from evtrain.events import StopRun

PROMETHEUS = shutil.which("prometheus")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana/dashboards/evtrain.json"

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
  evaluation_interval: 1s
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


def _start_prometheus(
    procs: Any, workdir: Path, exporter_port: int, rules: str | None = None
) -> int:
    """A Prometheus server scraping the exporter every second, evaluating ``rules`` (a
    rules file's text) every second; its own port."""
    assert PROMETHEUS is not None
    port = _free_port()
    config = workdir / "prometheus.yml"
    text = CONFIG.format(port=exporter_port)
    if rules is not None:
        (workdir / "rules.yml").write_text(rules)
        text += "rule_files: [rules.yml]\n"
    config.write_text(text)
    procs.start(
        PROMETHEUS,
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        stdout=subprocess.DEVNULL,
        stderr=(workdir / "prometheus.log").open("w"),
    )
    return port


def test_prometheus_sees_the_steps_counter_rise(procs: Any, workdir: Path) -> None:
    exporter_port = _free_port()
    # ~50 steps/s (a 5 ms sleep in each microbatch forward); stopped once seen rising.
    spec = write_spec(
        workdir,
        steps=3000,
        delay=0.005,
        hooks=[dict(type="prometheus", port=exporter_port)],
    )
    marker = new_marker()
    logs = workdir / "logs"
    logs.mkdir()
    try:
        prometheus_port = _start_prometheus(procs, workdir, exporter_port)
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


def _series(result: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(stage, replica) of each series of a query result (empty for a missing label)."""
    return sorted((r["metric"].get("stage", ""), r["metric"].get("replica", "")) for r in result)


def test_dashboard_queries_on_a_data_parallel_run(
    bus: BusAddress, procs: Any, workdir: Path
) -> None:
    """2 stages x 2 replicas: the per-replica panels draw four lines, the others one per stage,
    and the run's figures count each step once."""
    exporter_port = _free_port()
    err = workdir / "exporter.err"
    with err.open("w") as stream:
        procs.evtrain(
            "hook", "prometheus", "--bus", str(bus), "-o", f"port={exporter_port}", stderr=stream
        )
        wait_for_text(err, "hooks attached", timeout=30)
    prometheus_port = _start_prometheus(procs, workdir, exporter_port)
    procs.start(*fake_args(bus, steps=3000, step_time=0.01, stages=2, dp=2))
    # Rates need a few scrapes of the run going on.
    deadline = time.monotonic() + 60
    while not _query(prometheus_port, "count_over_time(evtrain_steps_total[1m]) >= 5"):
        assert time.monotonic() < deadline, (workdir / "prometheus.log").read_text()[-3000:]
        time.sleep(0.3)

    places = [(str(s), str(d)) for s in (0, 1) for d in (0, 1)]
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "10s")
            result = _query(prometheus_port, expr)
            legend = target.get("legendFormat", "")
            where = f"panel {panel['title']!r}: {expr}"
            if "{{replica}}" in legend:
                assert _series(result) == places, where
            elif "{{stage}}" in legend:  # one line per stage
                assert [stage for stage, _ in _series(result)] == ["0", "1"], where

    def value(promql: str) -> list[float]:
        return [float(r["value"][1]) for r in _query(prometheus_port, promql)]

    assert value("sum(min by (stage) (evtrain_stage_up))") == [2.0]
    assert value("sum(evtrain_stage_up)") == [4.0]
    # Four processes report every step of 32 samples: 32 samples a step, counted once.
    per_step = value("increase(evtrain_samples_total[10s]) / increase(evtrain_steps_total[10s])")
    assert per_step == [pytest.approx(32)]
    # Replica 1 steps 10% slower in the fake run: the straggler panel shows it per stage.
    ratio = (
        "max by (stage) (rate(evtrain_step_duration_seconds_sum[10s]) / "
        "rate(evtrain_step_duration_seconds_count[10s])) / "
        "min by (stage) (rate(evtrain_step_duration_seconds_sum[10s]) / "
        "rate(evtrain_step_duration_seconds_count[10s]))"
    )
    assert value(ratio) == [pytest.approx(1.1, rel=0.05)] * 2


HANGING_SPEC = """\
import functools
import time

import torch
from torch import nn

from evtrain.job import Job, layer


class Stall(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            while self.calls > 4 * 20:  # training step 21 never ends
                time.sleep(0.05)
        return x


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)


job = Job(
    name="hangs",
    layers=[layer(nn.Linear, 8, 8), layer(Stall), layer(nn.Linear, 8, 1)],
    balance=[1, 2],
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.SGD, lr=0.01),
    train_data=data,
    batch_size=16,
    num_microbatches=4,
    max_steps=1000,
    stages=2,
    run_dir={run_dir!r},
    hooks=[dict(type="prometheus", port={port})],
    microbatch_spans="off",
    threads=1,
)
"""


def _firing(port: int) -> set[str]:
    url = f"http://127.0.0.1:{port}/api/v1/alerts"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            alerts = json.load(response)["data"]["alerts"]
    except OSError:
        return set()
    return {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}


def test_a_hung_run_fires_the_stall_alert_and_then_the_hang_alert(
    procs: Any, workdir: Path
) -> None:
    """deploy/rules.yml with its windows shortened (minutes to seconds): the stall alert
    fires while the run hangs, the hang alert once the launcher reported it."""
    rules = (DEPLOY / "rules.yml").read_text()
    for long, short in (("[5m]", "[6s]"), ("for: 5m", "for: 2s")):
        assert long in rules
        rules = rules.replace(long, short)
    exporter_port = _free_port()
    spec = workdir / "spec.py"
    spec.write_text(HANGING_SPEC.format(run_dir=str(workdir / "run"), port=exporter_port))
    marker = new_marker()
    logs = workdir / "logs"
    logs.mkdir()
    try:
        prometheus_port = _start_prometheus(procs, workdir, exporter_port, rules)
        launch = procs.start(
            *launch_cmd(spec, "--quiet", "--hang-timeout", "20"),
            env=launch_env(marker),
            stdout=(logs / "launch.out").open("w"),
            stderr=(logs / "launch.err").open("w"),
        )
        seen: list[set[str]] = []
        deadline = time.monotonic() + 300
        while "EvtrainHangReported" not in (firing := _firing(prometheus_port)):
            assert time.monotonic() < deadline, (
                seen,
                (logs / "launch.err").read_text()[-3000:],
                (workdir / "prometheus.log").read_text()[-3000:],
                _query(prometheus_port, "evtrain_steps_total"),
            )
            if firing and (not seen or firing != seen[-1]):
                seen.append(firing)
            time.sleep(0.3)
        # The stall alert fired while the launcher waited out its hang timeout.
        assert any("EvtrainRunStalled" in f for f in seen), seen
        assert launch.wait(timeout=60) == 4, (logs / "launch.err").read_text()[-3000:]
    finally:
        kill_marked(marker)
