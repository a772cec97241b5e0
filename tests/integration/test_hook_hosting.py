"""Hook hosting: a spec's built-in hooks share one supervised process, user hooks get their own.

The hook processes are the real ones (`HookSupervisor` starting ``evtrain hook``
processes against a real broker), driven by tests/fake_run.py as the stages;
the test reads the bus as the launcher does (every `HookStarted` says which
process attached, with its pid and hooks) and the hooks' own output files.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers.hook_helpers import fake_args, json_lines
from helpers.launch_helpers import launch_env, run_launch, write_spec

from evtrain.bus.address import BusAddress
from evtrain.bus.publisher import Publisher
from evtrain.bus.subscriber import Subscriber
from evtrain.events import HookError, HookStarted, StepEnded, StopRun
from evtrain.hooks.registry import build_hook_from_spec, is_builtin
from evtrain.launcher.hook_supervisor import HookSupervisor, hook_groups, host_command

PROBE = "test/probe"


class Hosting:
    """A `HookSupervisor` of ``specs`` on ``bus`` and what the bus says of its processes."""

    def __init__(
        self, specs: Sequence[Mapping[str, Any]], bus: BusAddress, env: dict[str, str], log: Path
    ) -> None:
        topics = [t.topic.decode() for t in (HookStarted, HookError, StepEnded)]
        self.bus = bus
        self.sub = Subscriber(bus.endpoint("events_out"), topics)
        self.log = log.open("wb")
        self.log_path = log
        self.supervisor = HookSupervisor(
            specs, bus, env=env, backoff=0.05, output=self.log.fileno()
        )
        self.started: list[HookStarted] = []
        self.errors: list[HookError] = []
        self.last_step = 0
        self._prove_subscription()
        self.supervisor.start_all()

    def _prove_subscription(self) -> None:
        """Publish a probe until it comes back: from then on no `HookStarted` is missed."""
        with Publisher(self.bus.endpoint("events_in"), source=PROBE) as pub:
            deadline = time.monotonic() + 20
            while not any(m.source == PROBE for m in self.sub.drain()):
                assert time.monotonic() < deadline, "the bus never echoed the probe"
                pub.publish(HookStarted(hooks=[], topics=[]))
                time.sleep(0.02)

    def pump(self) -> None:
        """Take what the bus brought, as the launcher's reader does; supervise."""
        for msg in self.sub.drain():
            if isinstance(msg, HookStarted) and msg.source != PROBE:
                self.started.append(msg)
                self.supervisor.attached(msg.pid)
            elif isinstance(msg, HookError):
                self.errors.append(msg)
            elif isinstance(msg, StepEnded):
                self.last_step = max(self.last_step, msg.step)
        self.supervisor.poll()

    def wait(self, done: Callable[[], object], what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            self.pump()
            if time.monotonic() > deadline:
                self.log.flush()
                output = self.log_path.read_text(errors="replace")[-3000:]
                raise AssertionError(f"timed out waiting for {what}; hook output:\n{output}")
            time.sleep(0.02)

    def attached(self) -> None:
        self.wait(self.supervisor.all_attached, "every hook process to attach")

    def ended(self) -> None:
        processes = self.supervisor.hooks
        self.wait(lambda: all(p.done for p in processes), "the hook processes to exit")

    def by_hooks(self) -> dict[tuple[str, ...], list[int]]:
        """The processes that announced each set of hooks, in order.

        A process announces itself once per start; a restarted one again, under a new pid.
        """
        out: dict[tuple[str, ...], list[int]] = {}
        for started in self.started:
            pids = out.setdefault(tuple(started.hooks), [])
            if started.pid not in pids:
                pids.append(started.pid)
        return out

    def close(self) -> None:
        self.supervisor.kill()
        self.sub.close()
        self.log.close()


@contextmanager
def hosting(
    specs: Sequence[Mapping[str, Any]], bus: BusAddress, marker: str, tmp_path: Path
) -> Iterator[Hosting]:
    """Start and supervise ``specs``' processes until the block ends (then all are killed)."""
    host = Hosting(specs, bus, launch_env(marker), tmp_path / "hooks.log")
    try:
        yield host
    finally:
        host.close()


def run_fake(host: Hosting, procs: Any, **fake: Any) -> dict[str, Any]:
    """Run tests/fake_run.py against the attached hooks until it and they are done."""
    proc = procs.start(*fake_args(host.bus, **fake))
    host.wait(lambda: proc.poll() is not None, "the fake run to end")
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    host.ended()
    return dict(json.loads(out.strip().splitlines()[-1]))


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_ends(path: Path) -> set[tuple[int, int]]:
    """(stage, step) of every step.ended an event recording holds."""
    return {(r["stage"], r["step"]) for r in records(path) if r["type"] == "step.ended"}


def metric_steps(path: Path) -> list[int]:
    return [r["step"] for r in records(path) if r["type"] == "step"]


# ---------------------------------------------------------------- which process runs what


def test_builtins_are_grouped_into_one_host_and_every_other_hook_runs_alone() -> None:
    specs = [
        {"type": "logging"},
        {"type": "mymod:Mine"},
        {"type": "evtrain.exporters.metrics_log:MetricsLog"},
        {"type": "recorder", "isolate": True},
        {"type": "timer", "isolate": False},
    ]
    assert [is_builtin(str(s["type"])) for s in specs] == [True, False, True, True, True]
    assert hook_groups(specs) == [[0, 2, 4], [1], [3]]
    bus = BusAddress.parse("ipc:///tmp/evt-x")
    host = host_command([specs[0], specs[4]], bus, python="py")
    entries = json.loads(host[host.index("--hooks") + 1])
    assert entries == [{"type": "logging"}, {"type": "timer"}]  # isolate is the launcher's
    assert host[-3:] == ["--bus", "ipc:///tmp/evt-x", "--exit-on-run-end"]
    # A process of one hook is the single-hook command line, as it always was.
    alone = host_command([specs[3]], bus, python="py")
    assert alone == [
        "py",
        "-m",
        "evtrain",
        "hook",
        "recorder",
        "--bus",
        str(bus),
        "--exit-on-run-end",
    ]


def test_builtins_share_one_process_where_each_sees_every_step_and_a_user_hook_has_its_own(
    bus: BusAddress, procs: Any, marker: str, tmp_path: Path
) -> None:
    steps, run_dir = 12, tmp_path / "run"
    user_file = tmp_path / "user.jsonl"
    specs = [
        {"type": "logging", "every": 1, "log_format": "json", "path": str(tmp_path / "log")},
        {"type": "metrics"},
        {"type": "helpers.launch_hooks:StepRecorder", "path": str(user_file)},
        {"type": "recorder", "flush_interval": 0},
    ]
    with hosting(specs, bus, marker, tmp_path) as host:
        assert len(host.supervisor.hooks) == 2
        host.attached()
        supervised = {process.pid for process in host.supervisor.hooks}
        run_fake(host, procs, steps=steps, stages=2, run_dir=run_dir)
    # One HookStarted per process: the built-ins' host in priority order (the
    # recorder's default priority is 10, the others' 100), the user hook alone.
    pids = host.by_hooks()
    assert set(pids) == {("recorder", "logging", "metrics"), ("step_recorder",)}
    host_pid, user_pid = pids[("recorder", "logging", "metrics")], pids[("step_recorder",)]
    assert len(host_pid) == len(user_pid) == 1 and host_pid != user_pid
    assert supervised == set(host_pid + user_pid)
    every = {(stage, step) for stage in (0, 1) for step in range(1, steps + 1)}
    assert step_ends(run_dir / "events.jsonl") == every
    assert metric_steps(run_dir / "metrics.jsonl") == list(range(1, steps + 1))
    progress = [r for r in json_lines((tmp_path / "log").read_text()) if r["event"] == "progress"]
    assert [line["step"] for line in progress] == [f"{i}/{steps}" for i in range(1, steps + 1)]
    assert [r["step"] for r in records(user_file) if "step" in r] == list(range(1, steps + 1))
    assert all(p.exit_codes == [0] for p in host.supervisor.hooks)


@pytest.mark.parametrize(("recorder", "metrics"), [(1, 2), (2, 1)])
def test_priority_is_the_order_the_host_dispatches_in(
    recorder: int, metrics: int, bus: BusAddress, procs: Any, marker: str, tmp_path: Path
) -> None:
    """The recorder and the metrics log append to one file: its lines are the dispatch order.

    With one stage each step.ended completes a step, so the metrics log writes
    the step's line in the same dispatch as the recorder writes the event's.
    """
    shared = tmp_path / "both.jsonl"
    specs = [
        {"type": "recorder", "path": str(shared), "flush_interval": 0, "priority": recorder},
        {"type": "metrics", "path": str(shared), "priority": metrics},
    ]
    with hosting(specs, bus, marker, tmp_path) as host:
        host.attached()
        run_fake(host, procs, steps=6, stages=1)
    in_order = ("recorder", "metrics") if recorder < metrics else ("metrics", "recorder")
    assert list(host.by_hooks()) == [in_order]  # one process, its hooks in priority order
    lines = records(shared)
    kinds = [(r["type"], r["step"]) for r in lines if r["type"] in ("step", "step.ended")]
    pairs = [kinds[i : i + 2] for i in range(0, len(kinds), 2)]
    first = "step.ended" if recorder < metrics else "step"
    second = "step" if first == "step.ended" else "step.ended"
    assert pairs == [[(first, step), (second, step)] for step in range(1, 7)]


def test_isolate_gives_a_builtin_its_own_process(
    bus: BusAddress, marker: str, tmp_path: Path
) -> None:
    specs = [{"type": "metrics"}, {"type": "logging", "isolate": True}, {"type": "lr_monitor"}]
    with hosting(specs, bus, marker, tmp_path) as host:
        host.attached()
        pids = host.by_hooks()
    assert set(pids) == {("metrics", "lr_monitor"), ("logging",)}
    assert pids[("metrics", "lr_monitor")] != pids[("logging",)]
    assert [p.label for p in host.supervisor.hooks] == ["metrics+lr_monitor", "logging"]


def test_a_host_subscribes_to_what_its_hooks_handle(
    bus: BusAddress, marker: str, tmp_path: Path
) -> None:
    specs = [{"type": "metrics"}, {"type": "lr_monitor"}]
    with hosting(specs, bus, marker, tmp_path) as host:
        host.attached()
    started = host.started[0]
    wanted = {
        event_type.topic.decode()
        for spec in specs
        for event_type, _, _ in build_hook_from_spec(spec).handlers()
    }
    assert sorted(started.topics) == sorted(wanted | {"run.ended"})
    assert "heartbeat" not in started.topics
    assert not any(topic.startswith("microbatch.") for topic in started.topics)


# ---------------------------------------------------------------- failures in the host


def test_a_builtin_raising_on_every_event_leaves_its_sibling_every_step(
    bus: BusAddress, procs: Any, marker: str, tmp_path: Path
) -> None:
    """The recorder writes to a full disk (/dev/full): each of its handler calls raises."""
    steps, run_dir = 10, tmp_path / "run"
    specs = [
        {"type": "recorder", "path": "/dev/full", "flush_interval": 0, "priority": 1},
        {"type": "metrics", "priority": 2},
    ]
    with hosting(specs, bus, marker, tmp_path) as host:
        host.attached()
        run_fake(host, procs, steps=steps, stages=2, run_dir=run_dir)
        host.wait(lambda: host.errors, "the recorder's HookError")
    assert [len(pids) for pids in host.by_hooks().values()] == [1]  # one process, never restarted
    assert {(e.hook, e.handler) for e in host.errors} == {("recorder", "record")}
    assert "No space left" in host.errors[0].error
    assert metric_steps(run_dir / "metrics.jsonl") == list(range(1, steps + 1))
    assert host.supervisor.hooks[0].exit_codes == [0]


def test_a_builtin_whose_setup_fails_is_left_out_and_its_siblings_run(
    bus: BusAddress, procs: Any, marker: str, tmp_path: Path
) -> None:
    steps, run_dir = 8, tmp_path / "run"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        specs = [
            {"type": "prometheus", "addr": "127.0.0.1", "port": port},
            {"type": "metrics"},
            {"type": "recorder", "flush_interval": 0},
        ]
        with hosting(specs, bus, marker, tmp_path) as host:
            host.attached()
            host.wait(lambda: host.errors, "the prometheus exporter's HookError")
            run_fake(host, procs, steps=steps, stages=2, run_dir=run_dir)
    (error,) = host.errors
    assert (error.hook, error.handler) == ("prometheus", "setup")
    assert f"cannot serve on 127.0.0.1:{port}" in error.error
    assert host.supervisor.hooks[0].exit_codes == [0]
    assert metric_steps(run_dir / "metrics.jsonl") == list(range(1, steps + 1))
    every = {(stage, step) for stage in (0, 1) for step in range(1, steps + 1)}
    assert step_ends(run_dir / "events.jsonl") == every
    # One line, no traceback: a port in use is a usage mistake.
    assert "Traceback" not in (tmp_path / "hooks.log").read_text()


def test_a_host_killed_mid_run_restarts_with_all_its_hooks(
    bus: BusAddress, procs: Any, marker: str, tmp_path: Path
) -> None:
    run_dir, user_file = tmp_path / "run", tmp_path / "user.jsonl"
    specs = [
        {"type": "metrics"},
        {"type": "helpers.launch_hooks:StepRecorder", "path": str(user_file)},
        {"type": "recorder", "flush_interval": 0},
    ]
    names = ("recorder", "metrics")
    with hosting(specs, bus, marker, tmp_path) as host:
        host.attached()
        fake = procs.start(
            *fake_args(bus, steps=100_000, step_time=0.01, stages=2, run_dir=run_dir)
        )
        events = run_dir / "events.jsonl"
        host.wait(lambda: events.exists() and len(step_ends(events)) >= 10, "recorded steps")
        (victim,) = host.by_hooks()[names]
        os.kill(victim, signal.SIGKILL)
        host.wait(lambda: len(host.by_hooks()[names]) == 2, "the restarted host's HookStarted")
        back_at = host.last_step
        host.wait(lambda: max(s for _, s in step_ends(events)) > back_at + 10, "later steps")
        # End the run as a hook would: every stage stops at a step boundary.
        with Publisher(bus.endpoint("commands_in"), source="hook/test") as commands:
            stop = StopRun(command_id=uuid.uuid4().hex, reason="enough")

            def stopped() -> bool:
                commands.publish(stop)
                return fake.poll() is not None

            host.wait(stopped, "the fake run to stop")
        host.ended()
    summary = json.loads(fake.communicate()[0].strip().splitlines()[-1])
    last = summary["steps"]
    restarted, user = host.supervisor.hooks
    assert restarted.label == "metrics+recorder" and restarted.restarts == 1
    assert restarted.exit_codes == [-signal.SIGKILL, 0]
    assert user.restarts == 0 and user.exit_codes == [0]
    assert len(host.by_hooks()[("step_recorder",)]) == 1
    # Both hooks of the host saw every step from shortly after it was back to the end.
    later = set(range(back_at + 2, last + 1))
    assert later <= {s for stage, s in step_ends(events) if stage == 1}
    assert later <= set(metric_steps(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in records(user_file) if "step" in r] == list(range(1, last + 1))


# ---------------------------------------------------------------- the command line and the launcher


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hooks", "[{"], "--hooks is not valid JSON"),
        (["--hooks", "{}"], "--hooks must be a non-empty JSON list"),
        (["--hooks", "[]"], "--hooks must be a non-empty JSON list"),
        (["--hooks", '[{"every": 1}]'], "needs a string 'type'"),
        (["--hooks", '[{"type": "metrics", "every": 3}]'], "accepted options: dir, path"),
        (["logging", "--hooks", '[{"type": "metrics"}]'], "no HOOK or --option with it"),
        ([], "name a HOOK, or give --hooks JSON"),
    ],
)
def test_hook_command_mistakes_are_one_line(args: list[str], message: str) -> None:
    cmd = [sys.executable, "-m", "evtrain", "hook", *args, "--bus", "ipc:///nonexistent/x"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr


@pytest.mark.slow
def test_a_launch_runs_its_builtins_in_one_process_and_a_user_hook_in_another(
    tmp_path: Path, marker: str
) -> None:
    steps_file = tmp_path / "steps.jsonl"
    hooks = [
        {"type": "metrics"},
        {"type": "helpers.launch_hooks:StepRecorder", "path": str(steps_file)},
        {"type": "recorder"},
    ]
    spec = write_spec(tmp_path, steps=6, hooks=hooks)
    proc, leftovers = run_launch(spec, "-v", "--log-format", "json", marker=marker)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not leftovers
    started = [line for line in json_lines(proc.stderr) if line.get("event") == "hook started"]
    assert sorted(line["hook"] for line in started) == ["StepRecorder", "metrics+recorder"]
    assert len({line["pid"] for line in started}) == 2
    run_dir = tmp_path / "run"
    assert metric_steps(run_dir / "metrics.jsonl") == list(range(1, 7))
    assert step_ends(run_dir / "events.jsonl") >= {(1, step) for step in range(1, 7)}
    assert [r["step"] for r in records(steps_file) if "step" in r] == list(range(1, 7))
