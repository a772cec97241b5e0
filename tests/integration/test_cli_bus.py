"""``evtrain bus``, ``evtrain events`` and ``evtrain hook`` as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers.bus_procs import Buses, env_with_tests, step_event

from evtrain.bus.address import BusAddress
from evtrain.bus.publisher import Publisher
from evtrain.bus.security import load_client
from evtrain.cli import COMMANDS, main
from evtrain.events import StepEnded


def start_bus(buses: Buses, *args: str, **kwargs: object) -> tuple[subprocess.Popen[str], str]:
    return buses.start(*args, **kwargs)


def publish_until_exit(
    proc: subprocess.Popen[str], address: str, *, curve_dir: Path | None = None
) -> None:
    """Publish steps until ``proc`` exits (a subscriber misses what came before it joined)."""
    curve = load_client(curve_dir) if curve_dir else None
    bus = BusAddress.parse(address)
    with Publisher(bus.endpoint("events_in"), source="stage/0", curve=curve) as pub:
        deadline = time.monotonic() + 120  # the subscriber is a process still starting
        step = 0
        while proc.poll() is None and time.monotonic() < deadline:
            pub.publish(step_event(step))
            step += 1
            time.sleep(0.01)
    assert proc.wait(timeout=10) == 0, proc.stderr.read() if proc.stderr else ""


def test_bus_prints_its_address_first_and_cleans_up(buses: Buses, procs: object) -> None:
    proc, first_line = start_bus(buses)
    address = BusAddress.parse(first_line)
    assert address.scheme == "ipc"
    directory = Path(address.location)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert sorted(os.listdir(directory)) == ["cmd-in", "cmd-out", "ev-in", "ev-out", "state"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert not directory.exists()  # it made the directory, so it removes it


def test_bus_refuses_a_running_address(buses: Buses, procs: object) -> None:
    _, address = start_bus(buses)
    second = procs.evtrain("bus", "--bus", address)  # type: ignore[attr-defined]
    assert second.wait(timeout=20) == 2
    err = second.stderr.read()
    assert err.count("\n") == 1 and "already running" in err
    assert Path(BusAddress.parse(address).location).is_dir()  # not removed by the loser


def test_events_json_count(buses: Buses, procs: object) -> None:
    _, address = start_bus(buses)
    tail = procs.evtrain(  # type: ignore[attr-defined]
        "events", "--bus", address, "--json", "--count", "5", "--topic", "step."
    )
    publish_until_exit(tail, address)
    lines = tail.stdout.read().splitlines()
    assert len(lines) == 5
    records = [json.loads(line) for line in lines]
    assert all(r["type"] == "step.ended" and r["source"] == "stage/0" for r in records)
    assert [r["seq"] for r in records] == list(range(records[0]["seq"], records[0]["seq"] + 5))


def test_events_human_lines(buses: Buses, procs: object) -> None:
    _, address = start_bus(buses)
    tail = procs.evtrain("events", "--count", "2", env={**os.environ, "EVTRAIN_BUS": address})  # type: ignore[attr-defined]
    publish_until_exit(tail, address)
    lines = tail.stdout.read().splitlines()
    assert len(lines) == 2
    assert all("stage/0" in line and "step.ended" in line and "loss=" in line for line in lines)


def test_curve_bus_from_the_command_line(buses: Buses, procs: object, tmp_path: Path) -> None:
    keys = tmp_path / "curve"
    _, address = start_bus(buses, "--tcp", "127.0.0.1", "--curve-dir", str(keys))
    assert address.startswith("tcp://127.0.0.1:")
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert (keys / "server.key_secret").is_file() and (keys / "client.key_secret").is_file()
    # Keys from the environment, like the launcher passes them to its children.
    env = {**os.environ, "EVTRAIN_CURVE_DIR": str(keys)}
    tail = procs.evtrain("events", "--bus", address, "--json", "--count", "3", env=env)  # type: ignore[attr-defined]
    publish_until_exit(tail, address, curve_dir=keys)
    assert len(tail.stdout.read().splitlines()) == 3
    # A hook process with --curve-dir: records three steps, then exits cleanly.
    out = tmp_path / "seen.json"
    hook = procs.evtrain(  # type: ignore[attr-defined]
        "hook",
        "helpers.bus_procs:Recorder",
        "--bus",
        address,
        "--curve-dir",
        str(keys),
        "-o",
        f"path={out}",
        "-o",
        "expect=3",
        env=env_with_tests(),
    )
    publish_until_exit(hook, address, curve_dir=keys)
    assert len(json.loads(out.read_text())) == 3
    # Without the keys nobody gets in: one line, exit 2, in a few seconds.
    bare = {k: v for k, v in os.environ.items() if k != "EVTRAIN_CURVE_DIR"}
    refused = procs.evtrain(
        "events", "--bus", address, "--count", "1", "--connect-timeout", "1", env=bare
    )  # type: ignore[attr-defined]
    assert refused.wait(timeout=20) == 2
    err = refused.stderr.read()
    assert err.count("\n") == 1 and "no evtrain broker answered" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["hook", "no_such_module_xyz:Hook", "--bus", "ipc:///tmp/x"], "cannot import"),
        (["hook", "bus_procs", "--bus", "ipc:///tmp/x"], "unknown hook"),
        (["hook", "helpers.bus_procs:step_event", "--bus", "ipc:///tmp/x"], "not an evtrain"),
        (
            ["hook", "helpers.bus_procs:Recorder", "--bus", "ipc:///tmp/x", "-o", "nope"],
            "key=value",
        ),
        (
            [
                "hook",
                "helpers.bus_procs:Recorder",
                "--bus",
                "ipc:///tmp/x",
                "-o",
                "path=/p",
                "-o",
                "colour=1",
            ],
            "colour",
        ),
        (
            ["hook", "helpers.bus_procs:Recorder", "-o", "path=/tmp/p", "--bus", "tcp://nohost"],
            "bad bus",
        ),
        (
            ["hook", "helpers.bus_procs:Recorder", "-o", "path=/tmp/p", "--bus", "relative"],
            "bad bus",
        ),
        (
            [
                "hook",
                "helpers.bus_procs:Recorder",
                "-o",
                "path=/tmp/p",
                "--bus",
                "ipc:///tmp/evt-nix-9",
            ],
            "does not exist",
        ),
        (["events", "--bus", "udp://x:1"], "bad bus"),
        (["events", "--bus", "ipc:///tmp/evt-nix-9", "--count", "0"], "--count"),
        (["bus", "--bus", "tcp://127.0.0.1:99999"], "bad bus"),
        (["bus", "--hwm", "0"], "--hwm"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(
    procs: object, args: list[str], message: str
) -> None:
    proc = procs.evtrain(*args, env=env_with_tests())  # type: ignore[attr-defined]
    assert proc.wait(timeout=30) == 2
    err = proc.stderr.read()
    assert err.count("\n") == 1, err
    assert message in err and "Traceback" not in err
    assert proc.stdout.read() == ""


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: evtrain {command}" in capsys.readouterr().out


def test_help_from_the_command_line(procs: object) -> None:
    proc = procs.evtrain("--help")  # type: ignore[attr-defined]
    assert proc.wait(timeout=30) == 0
    out = proc.stdout.read()
    for command in COMMANDS:
        assert command in out


def test_events_stops_quietly_when_its_reader_goes_away(buses: Buses, procs: object) -> None:
    _, address = start_bus(buses)
    tail = procs.evtrain("events", "--bus", address, "--json")  # type: ignore[attr-defined]
    bus = BusAddress.parse(address)
    done = threading.Event()

    def publish() -> None:
        with Publisher(bus.endpoint("events_in"), source="stage/0") as pub:
            while not done.is_set():
                pub.publish(StepEnded(step=0, stage=0))
                time.sleep(0.01)

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    try:
        assert tail.stdout is not None
        assert json.loads(tail.stdout.readline())["type"] == "step.ended"
        tail.stdout.close()  # like `| head -1` exiting
        assert tail.wait(timeout=20) == 0
    finally:
        done.set()
        thread.join(timeout=10)
    assert "Traceback" not in tail.stderr.read()
