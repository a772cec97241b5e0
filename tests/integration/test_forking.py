"""One torch import per launch: the agent and fork server are forks (`evtrain.launcher.forking`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.launch_helpers import (
    start_launch,
    steps_recorded,
    wait_for_records,
    wait_no_marked,
    write_spec,
)

FORK_SERVER_SCRIPT = """
import json, multiprocessing, os, sys
from evtrain.launcher.forking import start_fork_server

STATE = "as imported"


def report(conn):
    with open(f"/proc/{os.getppid()}/stat") as f:
        server_parent = int(f.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        server_cmdline = f.read().decode()
    conn.send({
        "state": STATE,
        "server": os.getppid(),
        "server_parent": server_parent,
        "server_cmdline": server_cmdline,
        "preloaded": "xml.dom.minidom" in sys.modules,
    })


if __name__ == "__main__":
    STATE = "set by the caller before the fork"
    start_fork_server(["xml.dom.minidom"])
    context = multiprocessing.get_context("forkserver")
    results = []
    for _ in range(2):
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=report, args=(send,))
        process.start()
        results.append(receive.recv())
        process.join()
        results[-1]["exitcode"] = process.exitcode
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().decode()
    print(json.dumps({
        "pid": os.getpid(),
        "cmdline": cmdline,
        "caller_imported_preload": "xml.dom.minidom" in sys.modules,
        "workers": results,
    }), flush=True)
"""

FORK_AGENT_SCRIPT = """
import json, os, sys
from evtrain.launcher.forking import fork_agent

# Open in the parent: the child must not keep it.
stray = os.dup2(os.open(os.devnull, os.O_RDONLY), 50)


def run():
    line = sys.stdin.readline().strip()
    print(json.dumps({
        "line": line,
        "env": dict(os.environ),
        "own_session": os.getsid(0) == os.getpid(),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "stray": stray,
    }), flush=True)
    return 7


child = fork_agent(run, env={"ONLY": "this"}, output_fd=None)
child.stdin.write(b"hello\\n")
child.stdin.flush()
status = child.wait(timeout=60)
print(json.dumps({"status": status, "poll": child.poll()}), flush=True)
"""


def _run_script(tmp_path: Path, source: str) -> list[dict[str, object]]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_fork_server_is_a_fork_of_its_caller_and_ends_with_it(tmp_path: Path) -> None:
    (result,) = _run_script(tmp_path, FORK_SERVER_SCRIPT)
    workers = result["workers"]
    assert isinstance(workers, list) and len(workers) == 2
    for worker in workers:
        # The caller's state at the fork, not a fresh import of its module.
        assert worker["state"] == "set by the caller before the fork"
        assert worker["server_parent"] == result["pid"]
        assert worker["server_cmdline"] == result["cmdline"]
        assert worker["preloaded"] and worker["exitcode"] == 0
    # The preload ran in the server, beside the caller.
    assert not result["caller_imported_preload"]
    assert workers[0]["server"] == workers[1]["server"]
    # Its last client gone, the server ends.
    assert _gone(int(workers[0]["server"]), timeout=30)


def test_a_forked_agent_reads_its_pipe_in_its_own_session_with_only_its_env(
    tmp_path: Path,
) -> None:
    child, parent = _run_script(tmp_path, FORK_AGENT_SCRIPT)
    assert child["line"] == "hello"
    assert child["env"] == {"ONLY": "this"}
    assert child["own_session"]
    fds = child["fds"]
    assert isinstance(fds, list)
    # stdin, stdout, stderr and the listing's own descriptor: nothing inherited.
    assert fds[:3] == [0, 1, 2] and len(fds) <= 4 and child["stray"] not in fds
    assert parent == {"status": 7, "poll": 7}


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode()


@pytest.mark.slow
def test_evtrain_launch_forks_its_agent_fork_server_and_workers(
    tmp_path: Path, marker: str
) -> None:
    steps_file = tmp_path / "steps.jsonl"
    spec = write_spec(
        tmp_path,
        steps=100_000,
        delay=0.025,
        hooks=[{"type": "helpers.launch_hooks:StepRecorder", "path": str(steps_file)}],
    )
    proc = start_launch(spec, "--quiet", marker=marker)
    try:
        # A bound against a hang, not a timing: a loaded machine starts a launch slowly.
        wait_for_records(steps_file, lambda records: steps_recorded(records) > 0, proc, 240)
        launcher = _cmdline(proc.pid)
        forks = [pid for pid in _children(proc.pid) if _cmdline(pid) == launcher]
        assert len(forks) == 1, "the agent is a fork of the launcher"
        servers = [pid for pid in _children(forks[0]) if _cmdline(pid) == launcher]
        assert len(servers) == 1, "the fork server is a fork of the agent"
        workers = _children(servers[0])
        assert len(workers) == 2 and all(_cmdline(pid) == launcher for pid in workers)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stdout + stderr
    assert not wait_no_marked(marker)
