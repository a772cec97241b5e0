"""Two machines, for real: `evtrain launch --nnodes 2` in two network namespaces.

Each "node" is a network namespace of its own with only a loopback and one
end of a veth pair on a private /30, so the two launches, their elastic
agents and stage workers reach each other only over that link, by the
addresses node 0 and node 1 have there: the c10d rendezvous on node 0, the
bus on node 0, gloo between the stages. The file system is shared, as a run
directory on a shared file system is between machines (checkpoints need one).

* a two-node run completes with the weights of a one-node run of the spec;
  the broker, the hooks and the Prometheus exporter live on node 0 only (a
  scrape from node 1 at node 0's address shows both stages);
* a stage on node 1 killed with SIGKILL after a checkpoint committed makes
  the run restart from that commit on both nodes and end with the same weights;
* a stage that fails on node 1 ends the run on node 0 too, whose stage was
  left waiting for it.

Needs root, iproute2 and network namespaces; skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest
import torch
from helpers.hook_helpers import hosted_hooks
from helpers.launch_helpers import kill_marked, launch_cmd, launch_env, new_marker, write_spec
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from evtrain.checkpoint import latest_committed, list_checkpoints
from evtrain.launcher import FAILED_WORKERS_GRACE_S
from evtrain.launcher.elastic_agent import AgentReport
from evtrain.stages.worker import read_stage_reports

pytestmark = pytest.mark.slow

STEPS = 16
SUBNET = "10.213.7.{}/30"
ADDRESSES = ("10.213.7.1", "10.213.7.2")
"""Node 0's and node 1's; they exist only inside the namespaces, whose ports are their own."""
RDZV_PORT = 29400
BUS_PORT = 29500
BUS_PORTS = range(BUS_PORT, BUS_PORT + 5)
PROMETHEUS_PORT = 9431
UNREACHABLE = "10.213.6.1/30"
"""An address of node 0 on a network node 1 has no route to."""
RUN_TIMEOUT_S = 120.0

SCRAPER = """\
import sys, time, urllib.request
url, out, deadline = sys.argv[1], sys.argv[2], time.monotonic() + float(sys.argv[3])
# As Prometheus: the exporter holds the run's final state for Prometheus's scrape only.
scrape = urllib.request.Request(url, headers={"User-Agent": "Prometheus/2.42.0"})
body = ""
while time.monotonic() < deadline:
    try:
        body = urllib.request.urlopen(scrape, timeout=1).read().decode()
    except OSError:
        body = ""
    if 'evtrain_runs_ended_total{status="completed"} 1.0' in body:
        break
    time.sleep(0.1)
open(out, "w").write(body)
"""
"""Scrapes a URL as Prometheus until the run it serves has completed; writes the last body
it got."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _netns_unavailable() -> str | None:
    """Why this machine cannot make network namespaces, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip`"
    probe = f"evtpr{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    made = _ip("link", "add", f"{probe}a", "type", "veth", "peer", "name", f"{probe}b", check=False)
    if made.returncode != 0:
        return f"cannot create a veth pair: {made.stderr.strip()}"
    _ip("link", "del", f"{probe}a", check=False)
    return None


@dataclass
class Node:
    """One machine: a network namespace with one end of the veth link."""

    rank: int
    netns: str
    ifname: str
    address: str
    marker: str = field(default_factory=new_marker)
    log: Path | None = None

    def inode(self) -> int:
        """The namespace's identity, as /proc/PID/ns/net shows it for its processes."""
        return os.stat(f"/run/netns/{self.netns}").st_ino

    def holds(self, pid: int) -> bool:
        """Whether process ``pid`` lives in this namespace."""
        try:
            return os.stat(f"/proc/{pid}/ns/net").st_ino == self.inode()
        except OSError:
            return False

    def output(self) -> str:
        return self.log.read_text() if self.log is not None and self.log.exists() else ""


def _remove(nodes: list[Node], veth: str) -> None:
    """Kill every process of the nodes, then remove their namespaces and link."""
    for node in nodes:
        kill_marked(node.marker)
        pids = _ip("netns", "pids", node.netns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        _ip("-n", node.netns, "link", "del", node.ifname, check=False)
        _ip("netns", "del", node.netns, check=False)
    _ip("link", "del", veth, check=False)  # if it never moved into a namespace


@pytest.fixture(scope="module")
def netns() -> None:
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def nodes(netns: None) -> Iterator[list[Node]]:
    """Two nodes joined by a veth pair; every process in them and both are gone afterwards."""
    token = secrets.token_hex(3)
    made = [
        Node(rank=r, netns=f"evt{token}n{r}", ifname=f"ev{token}v{r}", address=ADDRESSES[r])
        for r in range(2)
    ]
    try:
        _ip("link", "add", made[0].ifname, "type", "veth", "peer", "name", made[1].ifname)
        for node in made:
            _ip("netns", "add", node.netns)
            _ip("link", "set", node.ifname, "netns", node.netns)
            _ip("-n", node.netns, "addr", "add", SUBNET.format(node.rank + 1), "dev", node.ifname)
            _ip("-n", node.netns, "link", "set", "lo", "up")
            _ip("-n", node.netns, "link", "set", node.ifname, "up")
        yield made
    finally:
        _remove(made, made[0].ifname)


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job both tests run: metrics, Prometheus on every address, a checkpoint every 2 steps.

    Its steps sleep 4 x 20 ms (one layer on stage 1): a run long enough to be
    killed between a commit and its end.
    """
    hooks = [
        {"type": "metrics"},
        {"type": "prometheus", "addr": "0.0.0.0", "port": PROMETHEUS_PORT, "linger": 10},
        {"type": "checkpoint", "every_steps": 2},
    ]
    return write_spec(tmp_path_factory.mktemp("multinode"), steps=STEPS, delay=0.02, hooks=hooks)


class OneNode:
    """The spec launched on one node, in the background while the first test starts its own.

    No hooks: they change nothing in the weights.
    """

    def __init__(self, spec: Path) -> None:
        self.marker = new_marker()
        out = spec.parent / "one-node"
        self.weights_dir = out / "weights"
        args = [
            "--no-hooks",
            "--run-dir",
            str(out / "run"),
            "--dump-weights",
            str(self.weights_dir),
        ]
        out.mkdir()
        self.log = out / "launch.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                launch_cmd(spec, *args),
                env=launch_env(self.marker),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._weights: dict[str, torch.Tensor] | None = None

    def weights(self) -> dict[str, torch.Tensor]:
        """Its final weights, once it completed."""
        if self._weights is None:
            assert self.proc.wait(timeout=RUN_TIMEOUT_S) == 0, self.log.read_text()
            self._weights = _weights(self.weights_dir)
        return self._weights


@pytest.fixture(scope="module")
def one_node(spec: Path, netns: None) -> Iterator[OneNode]:
    run = OneNode(spec)
    try:
        yield run
    finally:
        kill_marked(run.marker)
        run.proc.kill()
        run.proc.wait()


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("stage-*.safetensors")):
        tensors.update(load_file(path))
    assert tensors, f"no weights in {directory}"
    return tensors


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=0, msg=key)


def _start(
    node: Node, spec: Path, run_dir: Path, run_id: str, *extra: str
) -> tuple[subprocess.Popen[str], IO[str]]:
    """``evtrain launch --nnodes 2 --node-rank R`` inside the node's namespace.

    The host name resolves to a loopback address here, as on many machines:
    gloo is told its interface.
    """
    node0 = ADDRESSES[0]
    args = ["--nnodes", "2", "--node-rank", str(node.rank), "--run-id", run_id]
    args += ["--rdzv-endpoint", f"{node0}:{RDZV_PORT}", "--bus", f"tcp://{node0}:{BUS_PORT}"]
    args += ["--run-dir", str(run_dir), *extra]
    node.log = run_dir.parent / f"node{node.rank}.log"
    log = node.log.open("w")
    env = launch_env(node.marker)
    proc = subprocess.Popen(
        ["ip", "netns", "exec", node.netns, *launch_cmd(spec, *args)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return proc, log


def _listening_ports(pid: int) -> set[int]:
    """TCP ports listening in the network namespace of process ``pid``."""
    try:
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return set()
    fields = (line.split() for line in lines)
    return {int(f[1].rsplit(":", 1)[1], 16) for f in fields if f[3] == "0A"}


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


@dataclass
class Seen:
    """What ran where, sampled while both launches ran."""

    hooks: dict[int, set[str]] = field(default_factory=lambda: {0: set(), 1: set()})
    """Hook names per node, of processes that carry the node's marker and live in its namespace."""
    stray_hooks: list[str] = field(default_factory=list)
    """Hook processes of a node found outside its namespace."""
    bus_listening: dict[int, bool] = field(default_factory=lambda: {0: False, 1: False})

    def sample(self, nodes: list[Node], launchers: list[subprocess.Popen[str]]) -> None:
        from helpers.launch_helpers import marked_pids

        for node, launcher in zip(nodes, launchers, strict=True):
            if launcher.poll() is None and _listening_ports(launcher.pid) & set(BUS_PORTS):
                self.bus_listening[node.rank] = True
            for pid in marked_pids(node.marker):
                names = hosted_hooks(_cmdline(pid))
                if not names:
                    continue
                if node.holds(pid):
                    self.hooks[node.rank].update(names)
                else:
                    self.stray_hooks.append(f"node {node.rank}: {'+'.join(names)} (pid {pid})")


def _wait(
    nodes: list[Node],
    launchers: list[subprocess.Popen[str]],
    seen: Seen | None = None,
    timeout: float = RUN_TIMEOUT_S,
) -> None:
    """Until both launches ended (sampling what runs where); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in launchers):
        if seen is not None:
            seen.sample(nodes, launchers)
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- node {n.rank}:\n{n.output()[-3000:]}" for n in nodes)
            raise AssertionError(f"the two-node run did not end within {timeout:g} s\n{logs}")
        time.sleep(0.1)


def _check_ended(nodes: list[Node], launchers: list[subprocess.Popen[str]]) -> None:
    for node, launcher in zip(nodes, launchers, strict=True):
        assert launcher.returncode == 0, f"node {node.rank}:\n{node.output()[-4000:]}"
    assert f"run completed: {STEPS}/{STEPS} steps" in nodes[0].output()


def _samples(body: str, name: str) -> dict[str, float]:
    """The values of metric family ``name`` in an exposition, by their ``stage`` label."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name:
                values[sample.labels.get("stage", "")] = sample.value
    return values


def test_two_nodes_train_as_one_with_bus_hooks_and_exporter_on_node_0(
    nodes: list[Node], spec: Path, one_node: OneNode, tmp_path: Path
) -> None:
    run_dir, run_id = tmp_path / "run", f"mn-{secrets.token_hex(4)}"
    scrape = tmp_path / "scrape.txt"
    url = f"http://{ADDRESSES[0]}:{PROMETHEUS_PORT}/metrics"
    scrape_args = [url, str(scrape), str(RUN_TIMEOUT_S)]
    scraper = subprocess.Popen(
        ["ip", "netns", "exec", nodes[1].netns, sys.executable, "-c", SCRAPER, *scrape_args],
        env=launch_env(nodes[1].marker),
        start_new_session=True,
    )
    started = [
        _start(node, spec, run_dir, run_id, "--dump-weights", str(tmp_path / "w")) for node in nodes
    ]
    launchers = [proc for proc, _ in started]
    seen = Seen()
    try:
        _wait(nodes, launchers, seen)
        scraper.wait(timeout=30)
    finally:
        for _, log in started:
            log.close()
    _check_ended(nodes, launchers)
    _assert_same_weights(_weights(tmp_path / "w"), one_node.weights())

    # Each node ran one stage worker, and together they ran both ranks.
    ranks = []
    for node in (0, 1):
        report = AgentReport.read(run_dir / "launches" / run_id / f"agent-node{node}.json")
        assert report is not None
        ranks += [worker.rank for worker in report.attempts[-1].workers]
    assert sorted(ranks) == [0, 1], ranks

    # Bus and hooks: node 0 only. The broker is in node 0's launcher, so only
    # node 0's namespace ever listened on the bus ports.
    assert seen.bus_listening == {0: True, 1: False}
    assert seen.hooks[0] == {"metrics", "prometheus", "checkpoint"}
    assert not seen.hooks[1] and not seen.stray_hooks

    # The exporter on node 0, scraped from node 1 over the link: both stages, every step.
    body = scrape.read_text()
    assert _samples(body, "evtrain_steps_total") == {"": STEPS}, body[:2000]
    durations = _samples(body, "evtrain_step_duration_seconds_count")
    assert durations == {"0": STEPS, "1": STEPS}, durations
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert sum(json.loads(line)["type"] == "step" for line in lines) == STEPS


def test_a_stage_killed_on_node_1_restarts_both_nodes_from_the_last_commit(
    nodes: list[Node], spec: Path, one_node: OneNode, tmp_path: Path
) -> None:
    run_dir, run_id = tmp_path / "run", f"mn-{secrets.token_hex(4)}"
    extra = ("--max-restarts", "1", "--dump-weights", str(tmp_path / "w"))
    started = [_start(node, spec, run_dir, run_id, *extra) for node in nodes]
    launchers = [proc for proc, _ in started]
    try:
        victim = _kill_after_a_commit(nodes, launchers, run_dir / "launches" / run_id)
        _wait(nodes, launchers)
    finally:
        for _, log in started:
            log.close()
    _check_ended(nodes, launchers)
    _assert_same_weights(_weights(tmp_path / "w"), one_node.weights())

    report = AgentReport.read(run_dir / "launches" / run_id / "agent-node1.json")
    assert report is not None and len(report.attempts) == 2, report
    killed = {w.rank: w.exit_code for w in report.attempts[0].workers}
    assert killed == {victim.rank: -signal.SIGKILL}, killed
    assert f"stage {victim.stage} was killed by SIGKILL" in nodes[1].output()
    # Every stage of the second attempt resumed from a committed checkpoint.
    committed = {info.step for info in list_checkpoints(run_dir) if info.committed}
    resumed = [int(step) for step in re.findall(r"resumed .*?step=(\d+)", _both(nodes))]
    assert len(resumed) == 2 and set(resumed) <= committed and min(resumed) > 0, resumed


def _both(nodes: list[Node]) -> str:
    return "".join(node.output() for node in nodes)


def _kill_after_a_commit(
    nodes: list[Node],
    launchers: list[subprocess.Popen[str]],
    reports: Path,
    stop: subprocess.Popen[str] | None = None,
) -> Any:
    """Once a checkpoint is committed, SIGKILL node 1's stage worker; its stage report.

    ``stop``: a launcher to SIGSTOP just before the kill (SIGCONT it yourself).
    """
    run_dir = reports.parent.parent
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        if any(p.poll() is not None for p in launchers):
            raise AssertionError(f"a launch ended before the kill:\n{_both(nodes)[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no checkpoint committed in time:\n{_both(nodes)[-4000:]}")
        if run_dir.is_dir() and latest_committed(run_dir) is not None:
            on_node_1 = [
                r for r in read_stage_reports(reports, 0).values() if nodes[1].holds(r.pid)
            ]
            if on_node_1:
                victim = on_node_1[0]
                if stop is not None:
                    os.kill(stop.pid, signal.SIGSTOP)
                os.kill(victim.pid, signal.SIGKILL)
                return victim
        time.sleep(0.02)


def test_a_failure_on_node_1_ends_node_0_whose_stage_waits_for_it(
    nodes: list[Node], spec: Path, tmp_path: Path
) -> None:
    """Node 0's gloo offers an address node 1 has no route to (its interface's first one).

    Node 1's stage fails to connect at once; node 0's waits for a connection
    that never comes, for gloo's half-hour timeout, unless node 0's launcher,
    which hears of the failure on the bus, kills it.
    """
    node0 = nodes[0]
    _ip("-n", node0.netns, "addr", "flush", "dev", node0.ifname)
    for address in (UNREACHABLE, SUBNET.format(1)):
        _ip("-n", node0.netns, "addr", "add", address, "dev", node0.ifname)
    run_dir, run_id = tmp_path / "run", f"mn-{secrets.token_hex(4)}"
    started = [_start(node, spec, run_dir, run_id) for node in nodes]
    launchers = [proc for proc, _ in started]
    try:
        _wait(nodes, launchers[1:], timeout=RUN_TIMEOUT_S)
        _wait(nodes, launchers, timeout=FAILED_WORKERS_GRACE_S + 20)
    finally:
        for _, log in started:
            log.close()
    for node, launcher in zip(nodes, launchers, strict=True):
        output = node.output()
        assert launcher.returncode == 1, f"node {node.rank}:\n{output[-4000:]}"
        assert "evtrain launch: error: stage 1 failed: RuntimeError: " in output
        assert "connect: Network is unreachable" in output
    assert "killing the stage workers of this node that wait on it" in node0.output()


def test_a_stage_killed_on_node_1_is_the_root_cause_node_0_names(
    nodes: list[Node], spec: Path, tmp_path: Path
) -> None:
    """A killed process says nothing on the bus itself: node 1's launcher, which sees
    it die, tells node 0 as that stage's failure (not as a RunEnded of its own), and
    node 0, which ends the run for the hooks, names it as the root cause.

    Node 1's launcher is held stopped until node 0's agent has ended (its stage
    failed for want of node 1's): node 0 must still wait for node 1's word rather
    than name its own stage's symptom, as on a loaded machine; node 1, whose agent
    ended meanwhile too, must still tell it.
    """
    run_dir, run_id = tmp_path / "run", f"mn-{secrets.token_hex(4)}"
    started = [_start(node, spec, run_dir, run_id) for node in nodes]
    launchers = [proc for proc, _ in started]
    try:
        try:
            victim = _kill_after_a_commit(
                nodes, launchers, run_dir / "launches" / run_id, stop=launchers[1]
            )
            agent_0 = run_dir / "launches" / run_id / "agent-node0.json"
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while not ((report := AgentReport.read(agent_0)) and report.finished):
                assert launchers[0].poll() is None, f"node 0 ended first:\n{_both(nodes)}"
                assert time.monotonic() < deadline, f"node 0's agent runs on:\n{_both(nodes)}"
                time.sleep(0.02)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(launchers[1].pid, signal.SIGCONT)
        _wait(nodes, launchers, timeout=RUN_TIMEOUT_S)
    finally:
        for _, log in started:
            log.close()
    # Node 1 saw the death; node 0 heard of it as that stage's failure.
    headline = (
        rf"evtrain launch: error: stage {victim.stage} (failed at step \d+: )?"
        "was killed by SIGKILL"
    )
    for node, launcher in zip(nodes, launchers, strict=True):
        output = node.output()
        assert launcher.returncode == 1, f"node {node.rank}:\n{output[-4000:]}"
        assert re.search(headline, output), f"node {node.rank}:\n{output[-4000:]}"
