"""The import layering contract (``.ci/layers``) holds, and fails on each kind of violation."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / ".ci" / "layers"
PACKAGES = ("evtrain", "bus", "stages", "hooks", "exporters")


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECK), str(root)], capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    return tmp_path


def append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_the_package_keeps_its_layers() -> None:
    result = check(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_import_from_a_higher_layer_fails(tree: Path) -> None:
    append(tree / "evtrain" / "events.py", "\nfrom evtrain.launcher import Launcher\n")
    result = check(tree)
    assert result.returncode == 1
    assert "evtrain/events.py" in result.stdout
    assert "imports evtrain.launcher" in result.stdout and "(control plane)" in result.stdout


def test_independent_components_do_not_import_each_other(tree: Path) -> None:
    append(tree / "hooks" / "timer.py", "\nimport evtrain.stages.schedules\n")
    result = check(tree)
    assert result.returncode == 1
    assert "evtrain.hooks imports evtrain.stages" in result.stdout


def test_an_import_inside_a_function_needs_a_reason(tree: Path) -> None:
    body = "\n\ndef _later() -> None:\n    from evtrain.errors import SpecError\n"
    append(tree / "evtrain" / "data.py", body)
    assert "without a 'lazy:' reason" in check(tree).stdout
    append(tree / "evtrain" / "data.py", body.replace("    from", "    # lazy: why\n    from"))
    lines = check(tree).stdout.splitlines()
    assert len([line for line in lines if "without a 'lazy:' reason" in line]) == 1


def test_an_import_cycle_fails(tree: Path) -> None:
    append(tree / "evtrain" / "errors.py", "\nimport evtrain.ratelimit\n")
    append(tree / "evtrain" / "ratelimit.py", "\nimport evtrain.errors\n")
    result = check(tree)
    assert result.returncode == 1
    assert "import cycle: evtrain.errors -> evtrain.ratelimit -> evtrain.errors" in result.stdout


@pytest.mark.parametrize(
    "module",
    [
        "evtrain",  # the public names load lazily
        "evtrain.cli",  # --help, and every hook process's start
        "evtrain.launcher",  # the agent process starts before the launcher imports torch
        "evtrain.bus.broker",  # evtrain bus
        "evtrain.tools.top",
        "evtrain.stages",  # schedules as data
        "evtrain.checkpoint",  # evtrain ckpt list
    ],
)
def test_fast_paths_import_no_torch(module: str) -> None:
    code = f"import sys, {module}\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
