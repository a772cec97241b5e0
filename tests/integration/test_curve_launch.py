"""`evtrain launch --curve-dir`: a run on a CURVE bus serves its own processes and nobody else.

A real launch (broker, hooks, elastic agent, stage workers) with CURVE keys,
watched from outside by three clients at once: one with the run's client keys,
one with a keypair the broker never authorized, one without CURVE. While the
authorized one receives every step, the others receive nothing and never
complete a handshake, and the stop commands they keep sending are never
applied: the run completes all its steps. The hooks (metrics log, Prometheus
exporter) and ``evtrain events`` with the same keys see the run.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import zmq
from helpers.launch_helpers import start_launch, write_spec

from evtrain.bus.address import BusAddress
from evtrain.bus.security import CURVE_DIR_ENV, CurveConfig, ensure_curve_dir, load_client
from evtrain.cli import main
from evtrain.errors import UsageError
from evtrain.events import Message, RunEnded, StepEnded, StopRun, decode, encode
from evtrain.launcher import Launcher, LaunchOptions

pytestmark = pytest.mark.slow

STEPS = 24
RUN_TIMEOUT_S = 90.0


class Client:
    """What any process that reaches the bus can try: raw ZeroMQ sockets with some keys.

    ``events`` subscribes to every event; ``commands`` publishes to the
    command input and hears the broker's subscription (``linked``) only once
    a handshake completed.
    """

    def __init__(self, context: zmq.Context, address: BusAddress, curve: CurveConfig | None):
        self.received: list[Message] = []
        self.linked = False
        self.events = context.socket(zmq.SUB)
        self.commands = context.socket(zmq.XPUB)
        for sock, role in ((self.events, "events_out"), (self.commands, "commands_in")):
            sock.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                curve.apply(sock)
            sock.connect(address.endpoint(role))  # type: ignore[arg-type]
        self.events.setsockopt(zmq.SUBSCRIBE, b"")

    def poll(self) -> None:
        while self.events.poll(0):
            topic, payload = self.events.recv_multipart()
            self.received.append(decode(payload, topic))
        while self.commands.poll(0):
            self.commands.recv()
            self.linked = True

    def send_stop(self, run_id: str) -> None:
        stop = StopRun(command_id=secrets.token_hex(8), reason="an intruder", run_id=run_id)
        stop.source, stop.ts = "hook/intruder", time.time()
        # Without a subscriber (no handshake) an XPUB drops this, as it must.
        self.commands.send_multipart([stop.topic, encode(stop)], zmq.NOBLOCK)


def _rogue(server: CurveConfig) -> CurveConfig:
    """Valid CURVE keys for the server, of a keypair it never authorized."""
    public, secret = zmq.curve_keypair()
    return CurveConfig(server_public=server.server_public, public=public, secret=secret)


@pytest.mark.parametrize("scheme", ["tcp", "ipc"])
def test_a_curve_run_serves_its_processes_and_nobody_else(
    scheme: str, tmp_path: Path, procs: object, marker: str
) -> None:
    keys = tmp_path / "keys"  # the launch creates it
    if scheme == "tcp":
        address = BusAddress.new_tcp("127.0.0.1")
    else:
        address = BusAddress.parse(f"ipc:///tmp/evt-c{secrets.token_hex(5)}")
    hooks = [{"type": "metrics"}, {"type": "prometheus", "port": 0, "linger": 0}]
    spec = write_spec(tmp_path, steps=STEPS, delay=0.01, hooks=hooks)
    run_id = f"curve-{secrets.token_hex(4)}"
    args = ["--bus", str(address), "--run-id", run_id]
    # tcp names the keys on the command line, ipc through the environment.
    env = {CURVE_DIR_ENV: str(keys)} if scheme == "ipc" else {}
    if scheme == "tcp":
        args += ["--curve-dir", str(keys)]
    launch = start_launch(spec, *args, marker=marker, **env)
    context = zmq.Context()
    try:
        _run_watched(launch, keys, address, run_id, tmp_path, procs, context)
    finally:
        context.destroy(linger=0)
        if scheme == "ipc":
            shutil.rmtree(address.location, ignore_errors=True)


def _run_watched(
    launch: subprocess.Popen[str],
    keys: Path,
    address: BusAddress,
    run_id: str,
    tmp_path: Path,
    procs: object,
    context: zmq.Context,
) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (keys / "client.key_secret").exists() or not (keys / "server.key").exists():
        assert launch.poll() is None, launch.communicate()
        assert time.monotonic() < deadline, "the launch made no curve keys"
        time.sleep(0.02)
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    ours = load_client(keys)
    clients = {
        "authorized": Client(context, address, ours),
        "rogue": Client(context, address, _rogue(ours)),
        "plain": Client(context, address, None),
    }
    # `evtrain events` with the run's keys from the environment.
    tail = procs.evtrain(  # type: ignore[attr-defined]
        "events",
        "--bus",
        str(address),
        "--topic",
        "step.",
        "--count",
        "3",
        "--json",
        "--connect-timeout",
        "60",
        env={**os.environ, CURVE_DIR_ENV: str(keys)},
    )
    port_file = tmp_path / "run" / "prometheus.port"
    scrape = ""
    while launch.poll() is None:
        assert time.monotonic() < deadline, "the launch did not end in time"
        for client in clients.values():
            client.poll()
        for name in ("rogue", "plain"):
            clients[name].send_stop(run_id)
        if not scrape and any(isinstance(m, StepEnded) for m in clients["authorized"].received):
            url = f"http://127.0.0.1:{port_file.read_text().strip()}/metrics"
            scrape = urllib.request.urlopen(url, timeout=5).read().decode()
        time.sleep(0.05)
    out, err = launch.communicate()
    for client in clients.values():
        client.poll()

    assert launch.returncode == 0, out + err
    assert f"run completed: {STEPS}/{STEPS} steps" in out  # never stopped by an intruder
    assert f"with CURVE  (attach: evtrain hook MODULE:CLASS --bus {address} --curve-dir" in out
    authorized = clients["authorized"]
    steps = {m.step for m in authorized.received if isinstance(m, StepEnded) and m.stage == 1}
    assert steps == set(range(1, STEPS + 1))
    assert [m.status for m in authorized.received if isinstance(m, RunEnded)] == ["completed"]
    assert authorized.linked
    for name in ("rogue", "plain"):  # at the same time, on the same endpoints
        assert clients[name].received == [], name
        assert not clients[name].linked, name

    # The hooks got the events: the metrics log has every step, the exporter counted them.
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum(json.loads(line)["type"] == "step" for line in lines) == STEPS
    assert "\nevtrain_steps_total " in scrape
    tailed = tail.communicate(timeout=30)
    assert tail.returncode == 0, tailed
    kinds = [json.loads(line)["type"] for line in tailed[0].splitlines()]
    assert len(kinds) == 3 and all(kind.startswith("step.") for kind in kinds), kinds


def _options(spec: Path, curve_dir: Path, **fields: object) -> LaunchOptions:
    return LaunchOptions(spec=str(spec), curve_dir=str(curve_dir), **fields)  # type: ignore[arg-type]


def test_bad_curve_directories_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write_spec(tmp_path)
    shared = tmp_path / "shared"
    ensure_curve_dir(shared)
    os.chmod(shared, 0o750)
    capsys.readouterr()  # what making the keys logged (it depends on earlier tests' logging)
    assert main(["launch", str(spec), "--curve-dir", str(shared)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "accessible by other users (mode 0750)" in err, err

    node1 = dict(
        nnodes=2,
        node_rank=1,
        run_id="r",
        rdzv_endpoint="127.0.0.1:29400",
        bus="tcp://127.0.0.1:29500",
    )
    with pytest.raises(UsageError, match="does not exist: copy node 0's there"):
        Launcher(_options(spec, tmp_path / "none", **node1)).prepare()
    with pytest.raises(UsageError, match="does not exist: copy the broker's there"):
        external = dict(bus="tcp://127.0.0.1:29500", external_bus=True)
        Launcher(_options(spec, tmp_path / "none", **external)).prepare()
    partial = tmp_path / "partial"
    partial.mkdir(mode=0o700)
    shutil.copy(ensure_curve_dir(tmp_path / "keys") / "server.key", partial)
    with pytest.raises(UsageError, match=r"client\.key_secret' is missing"):
        Launcher(_options(spec, partial, **node1)).prepare()
    assert not (tmp_path / "none").exists()  # only the broker's side creates keys
