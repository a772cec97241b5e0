"""Shared by the built-in hook and exporter tests: a broker, the fake run, hook processes."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from evtrain.bus.address import BusAddress
from evtrain.hooks.hook import Hook
from evtrain.hooks.runner import HookRunner

FAKE_RUN = Path(__file__).resolve().with_name("fake_run.py")


def fake_args(bus: BusAddress, **options: Any) -> list[str]:
    """Command line of tests/fake_run.py: ``steps=20`` -> ``--steps 20``, ``spans=True`` ->
    ``--spans``."""
    args = [sys.executable, str(FAKE_RUN), "--bus", str(bus)]
    for key, value in options.items():
        flag = f"--{key.replace('_', '-')}"
        args += [flag] if value is True else [flag, str(value)]
    return args


def loss_at(step: int) -> float:
    """The training loss the fake run reports at ``step`` (see fake_run.py)."""
    import math

    return 2.0 * math.exp(-step / 50) + 0.1 * math.sin(step)


@dataclass
class HookRun:
    """What `run_hooks` returns: the runner (its state) and the fake run's summary."""

    runner: HookRunner
    summary: dict[str, Any]
    stderr: str


async def run_hooks(
    hooks: Sequence[Hook], bus: BusAddress, procs: Any, timeout: float = 30.0, **fake: Any
) -> HookRun:
    """Attach ``hooks`` in this process, run the fake run against them, wait for the end.

    The runner exits on run end; ``procs`` (the conftest fixture) kills the fake
    run if anything goes wrong.
    """
    runner = HookRunner(hooks, bus, exit_on_run_end=True)
    result: dict[str, Any] = {}
    with anyio.fail_after(timeout):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner.run)
            await runner.ready.wait()
            proc = procs.start(*fake_args(bus, **fake))
            out, err = await anyio.to_thread.run_sync(proc.communicate)
            assert proc.returncode == 0, err
            result["summary"] = json.loads(out.strip().splitlines()[-1])
            result["stderr"] = err
            # The runner stops by itself once it dispatched run.ended.
            with anyio.move_on_after(10):
                while runner.state.ended is None:
                    await anyio.sleep(0.05)
            await anyio.sleep(0.1)
            runner.stop()
    return HookRun(runner, result["summary"], result["stderr"])


def wait_for_text(path: Path, text: str, timeout: float = 20.0) -> str:
    """Wait until file ``path`` contains ``text``; returns the file's content."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            content = path.read_text(errors="replace")
            if text in content:
                return content
        time.sleep(0.05)
    content = path.read_text(errors="replace") if path.exists() else "<no file>"
    raise AssertionError(f"{text!r} not in {path} within {timeout} s:\n{content[-3000:]}")


def hosted_hooks(args: Sequence[str]) -> list[str]:
    """The hook references an ``evtrain hook`` command line runs (none for another command).

    ``evtrain hook REF ...`` runs REF; ``evtrain hook --hooks JSON`` the entries'
    types (the launcher's host of a spec's built-in hooks).
    """
    if "evtrain" not in args or "hook" not in args:
        return []
    rest = list(args[list(args).index("hook") + 1 :])
    if "--hooks" in rest:
        return [str(entry["type"]) for entry in json.loads(rest[rest.index("--hooks") + 1])]
    return rest[:1]


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects among ``text``'s lines (other lines are skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
