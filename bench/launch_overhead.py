"""Wall time of ``evtrain launch`` against ``torchrun`` on the same small job, with a breakdown.

evtrain: ``evtrain launch examples/mlp.py --steps 10 --quiet --run-dir TMP`` (the
MLP 16-64-64-1 on 2 stages, 1F1B, 4 microbatches of 16, Adam, its logging hook),
plus ``--log-level debug --log-format json`` and ``LOGLEVEL=INFO`` (elastic's own
log lines): those timestamped lines are where most of the breakdown comes from
(about 60 lines a run). It runs as ``python -c`` calling the console script's
``evtrain.cli.run`` with one more line when the command has returned, so that
the exit (``os._exit`` once flushed) shows on its own.

torchrun: ``torchrun --standalone --nproc-per-node 2`` on a plain torch script this
bench writes to a temp dir: the same layers split the same way (layers 0-1 | 2-4),
the same data (``examples/mlp.py``'s generator, its source copied in), 10 steps of
torch.distributed.pipelining's ``Schedule1F1B`` over ``PipelineStage`` (static
shapes) with gloo point-to-point between the 2 processes, Adam and the cosine
schedule, one torch thread per process; the last rank prints the loss, as the
logging hook does. ``--standalone`` is c10d on a free port, as evtrain's single
node launch (plain ``--nproc-per-node 2`` would take the fixed port 29500). The
library schedule is the closest peer: evtrain's engine is its own 1F1B over the
same gloo isend/irecv, and a hand-written loop would import the same modules
(building Adam imports torch._dynamo either way). The script writes wall-clock
marks (start, imports done, process group, set up, trained, destroyed) per rank.

The two alternate (evtrain first on odd repeats, torchrun first on even ones);
medians and ranges over the repeats. ``--budget-s`` stops starting repeats when
the next one would not fit (never before 3).

Breakdown of an evtrain launch, from the launch (Popen) to the launcher's exit,
cut at markers in time order; each phase ends at its marker:

* ``agent spawned`` — the elastic agent's process start (/proc): the launcher
  forks it first thing in ``Launcher.run``, after the CLI's imports and
  torch's (with torch._dynamo, which the split's survey on the meta device
  needs), so that the agent and its fork server import nothing more
  (``evtrain.launcher.forking``);
* ``run dir created`` — ``RUN_DIR/launches`` appears (polled), right after the
  launcher's ``prepare``: spec load and the preflight (split plan on the meta
  device), hook options;
* ``broker started``, ``hooks attached`` — the launcher's debug lines;
* ``elastic operator``, ``rendezvous complete`` — elastic's INFO lines in the
  agent (``Starting elastic_operator``: it has the config);
* ``workers forked`` — the stage processes' start (/proc; children of the fork
  server, a fork of the agent that imports the stage runtime);
* ``StageStarted`` (the logging hook's line when it received the event),
  ``stage running`` (the workers' debug line after RunStarted and boundary 0),
  the logging hook's step-10 line, ``stage finished`` (the workers');
* ``workers exited`` (the agent's report), ``agent exited`` (polled),
  ``hooks exited``, ``broker stopped`` (the launcher's lines), ``main``
  returned, and the exit.

A marker earlier than the one before it (the hook can exit before the agent)
adds nothing and its time goes to the next phase, so the phases of a launch
add up to its wall time. Polls run every ``--poll-s`` (20 ms): markers from
them are that coarse, /proc start times 10 ms. Not separable from outside:
the gloo ``init_process_group`` inside the workers' setup (the torchrun
script's own mark for it is printed as an estimate), and, inside the
launcher, its imports vs torch's vs the spec load vs the split plan (measured
once in a process of their own, without the agent competing, as a
reference). Overlapped work (the agent's and the fork server's imports while
the launcher prepares) is reported beside the path, with the CPU seconds of
each process (/proc utime + stime at the last poll).

2 shared CPU cores with other work on them: load average is printed per run;
expect +-20-30 % between runs.

    python bench/launch_overhead.py [--repeats 5] [--steps 10] [--budget-s 170]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "mlp.py"
CLK_TCK = os.sysconf("SC_CLK_TCK")
BOOT_WALL = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
"""Wall-clock time of boot: /proc start times count clock ticks from it."""

PEER = '''"""examples/mlp.py's MLP as a 2-stage pipeline under torchrun (launch_overhead bench)."""

import json
import os
import sys
import time

T_START = time.time()

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

T_IMPORTS = time.time()
BATCH, MICROBATCHES, SAMPLES = 64, 4, 1024

# examples/mlp.py's constants and data generator


def main():
    steps, marks_dir = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    t_pg = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers = [
        nn.Linear(FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 1),
    ]
    module = nn.Sequential(*(layers[:2] if rank == 0 else layers[2:]))
    mb = BATCH // MICROBATCHES
    d_in, d_out = (FEATURES, HIDDEN) if rank == 0 else (HIDDEN, 1)
    stage = PipelineStage(
        module,
        rank,
        world,
        torch.device("cpu"),
        input_args=(torch.empty(mb, d_in, requires_grad=rank > 0),),
        output_args=torch.empty(mb, d_out, requires_grad=True),
        output_grads=(torch.empty(mb, d_out),),
        input_grads=(torch.empty(mb, d_in),),
    )
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=nn.functional.mse_loss)
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=200)
    x, y = make_regression(SAMPLES, 1)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0))
    t_setup = time.time()
    losses = []
    for step in range(steps):
        start = step * BATCH % SAMPLES
        index = order[start : start + BATCH]
        losses = []
        if rank == 0:
            schedule.step(x[index])
        else:
            schedule.step(target=y[index], losses=losses)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    t_trained = time.time()
    if rank == world - 1:
        loss = float(torch.stack([l.detach() for l in losses]).mean())
        print(f"step {steps}: loss {loss:.6g}", flush=True)
    dist.destroy_process_group()
    marks = dict(
        start=T_START, imports=T_IMPORTS, pg=t_pg, setup=t_setup, trained=t_trained,
        destroyed=time.time(),
    )
    with open(os.path.join(marks_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(marks, f)


main()
'''

ISOLATED = """
import json, sys, time
heavy = lambda: [m for m in ("torch", "torch._dynamo", "sympy") if m in sys.modules]
t0 = time.perf_counter()
import evtrain.cli, evtrain.cli.launch, evtrain.launcher
evtrain.cli.build_parser()
t1 = time.perf_counter()
h1 = heavy()
# What `evtrain launch` imports before it forks the agent (evtrain.launcher.forking).
import torch._dynamo
t2 = time.perf_counter()
h2 = heavy()
import evtrain.overrides, evtrain.spec
job = evtrain.overrides.apply_overrides(evtrain.spec.load_job(sys.argv[1]), {"steps": sys.argv[2]})
t3 = time.perf_counter()
from evtrain.stages.partition import plan_split
plan_split(job)
t4 = time.perf_counter()
h4 = heavy()
print(json.dumps({
    "cli_imports_s": t1 - t0, "torch_import_s": t2 - t1, "spec_load_s": t3 - t2,
    "split_plan_s": t4 - t3, "loaded_after_cli": h1, "loaded_after_torch": h2,
    "loaded_after_split_plan": h4,
}))
"""


CLI = """
import json, sys
from datetime import datetime, timezone
import evtrain.cli as cli
sys.argv[0] = "evtrain"
dispatch = cli._dispatch
def marked(argv):
    result = dispatch(argv)
    now = datetime.now(timezone.utc).isoformat()
    sys.stderr.write(json.dumps({"event": "bench: main returned", "timestamp": now}) + "\\n")
    sys.stderr.flush()
    return result
cli._dispatch = marked
cli.run()
"""
"""The ``evtrain`` console script (``evtrain.cli:run``, its exit included), plus one line
when the command has returned."""


# ------------------------------------------------------------------ /proc watch


@dataclass
class Proc:
    pid: int
    ppid: int
    start: float
    """Wall-clock start (/proc, 10 ms ticks)."""
    cmd: str
    gone_at: float | None = None
    cpu_ticks: int = 0
    cpu_changes: list[float] = field(default_factory=list)
    """Poll times at which its CPU time had grown."""

    @property
    def cpu_s(self) -> float:
        return self.cpu_ticks / CLK_TCK

    def busy_until(self, before: float) -> float | None:
        """The last poll before ``before`` at which it had used CPU."""
        earlier = [t for t in self.cpu_changes if t <= before]
        return earlier[-1] if earlier else None


def peer_script() -> str:
    """`PEER` with examples/mlp.py's constants and ``make_regression`` copied in (as source:
    the script stays plain torch)."""
    text = SPEC.read_text()
    names = {"FEATURES", "HIDDEN", "DATA_SEED", "make_regression"}
    found: dict[str, str] = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        elif isinstance(node, ast.FunctionDef):
            name = node.name
        else:
            continue
        segment = ast.get_source_segment(text, node)
        if name in names and segment is not None:
            found[name] = segment
    if set(found) != names:
        raise RuntimeError(f"{SPEC} no longer defines {', '.join(sorted(names - set(found)))}")
    source = "\n".join(found[n] for n in ("FEATURES", "HIDDEN", "DATA_SEED"))
    source += "\n\n\n" + found["make_regression"] + "\n"
    marker = "# examples/mlp.py's constants and data generator\n"
    return PEER.replace(marker, marker + source)


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, utime + stime ticks, start ticks) of ``pid``; None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19])


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class TreeWatch(threading.Thread):
    """Polls the process tree under ``root`` (and a path to appear) every ``interval``."""

    def __init__(self, root: int, interval: float, appears: Path | None = None) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.interval = interval
        self.appears = appears
        self.appeared_at: float | None = None
        self.procs: dict[int, Proc] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.scan()
            self._halt.wait(self.interval)
        self.scan()

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def scan(self) -> None:
        now = time.time()
        alive: set[int] = set()
        frontier = [self.root]
        while frontier:
            pid = frontier.pop()
            stat = _stat(pid)
            if stat is None or stat[0] in "ZX":
                continue
            alive.add(pid)
            _, ppid, ticks, start = stat
            proc = self.procs.get(pid)
            if proc is None:
                proc = Proc(pid, ppid, BOOT_WALL + start / CLK_TCK, "")
                self.procs[pid] = proc
            # Read again while it lives: a child seen between its fork and its
            # exec still shows its parent's command line.
            proc.cmd = _cmdline(pid) or proc.cmd
            if ticks > proc.cpu_ticks:
                proc.cpu_ticks = ticks
                proc.cpu_changes.append(now)
            frontier += _children(pid)
        for pid, proc in self.procs.items():
            if pid not in alive and proc.gone_at is None:
                proc.gone_at = now
        if self.appears is not None and self.appeared_at is None and self.appears.exists():
            self.appeared_at = now

    def kinds(self) -> dict[str, list[Proc]]:
        """The evtrain launch's processes by role."""
        out: dict[str, list[Proc]] = {
            "launcher": [],
            "agent": [],
            "forkserver": [],
            "worker": [],
            "hook": [],
            "other": [],
        }

        # By place in the tree: the agent and the fork server may be forks that
        # carry the launcher's command line (evtrain.launcher.forking).
        root_cmd = self.procs[self.root].cmd if self.root in self.procs else ""

        def agent(proc: Proc) -> bool:
            if proc.ppid != self.root:
                return False
            return "evtrain.launcher.elastic_agent" in proc.cmd or proc.cmd == root_cmd

        agents = {p.pid for p in self.procs.values() if agent(p)}
        forkservers = {
            p.pid
            for p in self.procs.values()
            if p.ppid in agents and ("multiprocessing.forkserver" in p.cmd or p.cmd == root_cmd)
        }
        for proc in sorted(self.procs.values(), key=lambda p: p.start):
            if proc.pid == self.root:
                kind = "launcher"
            elif proc.pid in agents:
                kind = "agent"
            elif proc.pid in forkservers:
                kind = "forkserver"
            elif proc.ppid in forkservers:
                kind = "worker"
            elif proc.ppid == self.root and "hook" in proc.cmd:
                kind = "hook"
            else:
                kind = "other"
            out[kind].append(proc)
        return out


# ---------------------------------------------------------------- log markers

_ELASTIC = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) +\d+ \S+\] (.*)$")


def _elastic_time(match: re.Match[str]) -> float:
    month, day, hour, minute, second, micro = (int(g) for g in match.groups()[:6])
    year = time.localtime().tm_year
    return datetime(year, month, day, hour, minute, second, micro).timestamp()


def read_logs(text: str) -> tuple[list[dict[str, Any]], list[tuple[float, str]]]:
    """structlog JSON lines (with ``ts``) and elastic's (time, message) lines."""
    events: list[dict[str, Any]] = []
    elastic: list[tuple[float, str]] = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                event = json.loads(line)
                event["ts"] = datetime.fromisoformat(event["timestamp"]).timestamp()
            except (ValueError, KeyError, TypeError):
                continue
            events.append(event)
        elif (match := _ELASTIC.match(line)) is not None:
            elastic.append((_elastic_time(match), match.group(7)))
    return events, elastic


def _first(times: list[float]) -> float | None:
    return min(times) if times else None


def _last(times: list[float]) -> float | None:
    return max(times) if times else None


# ------------------------------------------------------------------ phases

EVTRAIN_PHASES: list[tuple[str, str]] = [
    ("agent_spawned", "launcher: CLI imports, torch and torch._dynamo, fork"),
    ("run_dir_created", "launcher: spec load + preflight split plan"),
    ("broker_started", "launcher: run dir, run.json, broker start"),
    ("hooks_attached", "hook process: start, imports, bus attach"),
    ("elastic_operator", "agent: ready (its imports, if not done)"),
    ("rendezvous_done", "agent: elastic c10d rendezvous"),
    ("workers_forked", "fork server: preload (the stage runtime) + fork"),
    ("stage_started", "workers: spec load, gloo process group, stage build"),
    ("stage_running", "workers: data, shapes, optimizer, RunStarted, boundary 0"),
    ("steps_done", "workers: the 10 training steps"),
    ("stage_finished", "workers: final boundary, StageStopped, barrier"),
    ("workers_exited", "workers: exit (zmq flush, os._exit)"),
    ("agent_exited", "agent: exit"),
    ("hooks_exited", "launcher: sees the agent gone, RunEnded, hooks end"),
    ("broker_stopped", "launcher: summary, run.json, publishers, broker stop"),
    ("main_returned", "launcher: ipc dir removed, console closed"),
    ("exit", "launcher: exit (zmq flushed, os._exit)"),
]

COARSE: dict[str, list[str]] = {
    "launcher_imports": ["agent_spawned"],
    "spec_load_and_preflight": ["run_dir_created"],
    "broker_start": ["broker_started"],
    "hooks_start": ["hooks_attached"],
    "agent_and_worker_processes_start": ["elastic_operator", "rendezvous_done", "workers_forked"],
    "worker_setup_and_process_group": ["stage_started", "stage_running"],
    "training_steps": ["steps_done"],
    "end": [
        "stage_finished",
        "workers_exited",
        "agent_exited",
        "hooks_exited",
        "broker_stopped",
        "main_returned",
        "exit",
    ],
}

TORCHRUN_PHASES: list[tuple[str, str]] = [
    ("elastic_operator", "torchrun: interpreter start, imports (torch)"),
    ("rendezvous_done", "torchrun: elastic c10d rendezvous"),
    ("workers_spawned", "torchrun: start 2 worker processes"),
    ("script_start", "workers: interpreter start"),
    ("imports", "workers: import torch + pipelining (2 at once)"),
    ("pg", "workers: gloo init_process_group"),
    ("setup", "workers: stage, schedule, optimizer, data"),
    ("trained", "workers: the 10 training steps"),
    ("destroyed", "workers: destroy_process_group"),
    ("exit", "workers' teardown, torchrun exit"),
]


def phases_of(start: float, markers: dict[str, float | None], names: list[str]) -> dict[str, float]:
    """Contiguous phases from ``start``: a missing or out-of-order marker adds 0."""
    out: dict[str, float] = {}
    at = start
    for name in names:
        value = markers.get(name)
        if value is None or value < at:
            out[name] = 0.0
            continue
        out[name] = value - at
        at = value
    return out


# ------------------------------------------------------------------ runs


@dataclass
class Run:
    wall_s: float
    phases: dict[str, float]
    extra: dict[str, float | None]
    cpu_s: dict[str, float]
    load: float


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _watched(
    cmd: list[str], cwd: Path, where: Path, poll_s: float, appears: Path | None = None
) -> tuple[float, float, TreeWatch, str]:
    """Run ``cmd`` (output to files in ``where``) under a `TreeWatch`; (start, end, watch,
    stderr). Raises with the stderr's tail when it fails."""
    out, err = where / "stdout", where / "stderr"
    env = {**os.environ, "LOGLEVEL": "INFO"}  # elastic's INFO lines, with times
    with out.open("wb") as o, err.open("wb") as e:
        start = time.time()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=o, stderr=e, env=env)
        watch = TreeWatch(proc.pid, poll_s, appears=appears)
        watch.start()
        code = proc.wait()
        end = time.time()
        watch.stop()
    if code != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} exited {code}:\n{_tail(err)}")
    return start, end, watch, err.read_text(errors="replace")


def _elastic_line(elastic: list[tuple[float, str]], text: str) -> float | None:
    return _first([t for t, message in elastic if text in message])


def run_evtrain(tmp: Path, index: int, steps: int, poll_s: float) -> Run:
    run_dir = tmp / f"evtrain-{index}" / "run"
    run_dir.parent.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-c",
        CLI,
        "launch",
        str(SPEC),
        "--steps",
        str(steps),
        "--quiet",
        "--run-dir",
        str(run_dir),
        "--log-level",
        "debug",
        "--log-format",
        "json",
    ]
    start, end, watch, log = _watched(cmd, ROOT, run_dir.parent, poll_s, run_dir / "launches")
    events, elastic = read_logs(log)

    def logged(event: str, key: str | None = None) -> list[float]:
        return [e["ts"] for e in events if e.get("event") == event and (key is None or key in e)]

    kinds = watch.kinds()
    agents, workers = kinds["agent"], kinds["worker"]
    reports = list((run_dir / "launches").glob("*/agent.json"))
    died: list[float] = []
    if reports:
        attempts = json.loads(reports[0].read_text()).get("attempts") or [{}]
        died = [w["died_at"] for w in attempts[-1].get("workers", []) if w.get("died_at")]
    done_line = [
        e["ts"]
        for e in events
        if e.get("event") == "progress" and str(e.get("step", "")).startswith(f"{steps}/")
    ]
    markers: dict[str, float | None] = {
        "agent_spawned": agents[0].start if agents else None,
        # Polled: never later than the broker, which starts right after.
        "run_dir_created": _first(
            [t for t in (watch.appeared_at, _first(logged("broker started"))) if t is not None]
        ),
        "broker_started": _first(logged("broker started")),
        "hooks_attached": _first(logged("hooks attached", "after_s")),
        "elastic_operator": _elastic_line(elastic, "Starting elastic_operator"),
        "rendezvous_done": _elastic_line(elastic, "Rendezvous complete for workers"),
        "workers_forked": _last([w.start for w in workers]),
        "stage_started": _last(logged("stage started", "pid")),
        "stage_running": _last(logged("stage running")),
        "steps_done": _first(done_line),
        "stage_finished": _last(logged("stage finished")),
        "workers_exited": _last(died) or _last([w.gone_at for w in workers if w.gone_at]),
        "agent_exited": agents[0].gone_at if agents else None,
        "hooks_exited": _last(logged("hook exited")),
        "broker_stopped": _last(logged("broker stopped")),
        "main_returned": _last(logged("bench: main returned")),
        "exit": end,
    }
    phases = phases_of(start, markers, [name for name, _ in EVTRAIN_PHASES])
    # Overlapped work, not on the path above: how long the agent and the fork
    # server were busy importing before they were needed.
    extra: dict[str, float | None] = {"hook_import_attach_s": None}
    hook_started = _first(logged("hook started"))
    if hook_started is not None and markers["hooks_attached"] is not None:
        extra["hook_import_attach_s"] = markers["hooks_attached"] - hook_started
    forkservers = kinds["forkserver"]
    if forkservers and workers:
        server = forkservers[0]
        busy = server.busy_until(min(w.start for w in workers) - 2 * poll_s)
        extra["forkserver_started_after_launch_s"] = server.start - start
        extra["forkserver_preload_s"] = busy - server.start if busy is not None else None
    operator = markers["elastic_operator"]
    if agents and markers["hooks_attached"] is not None and operator is not None:
        agent = agents[0]
        busy = agent.busy_until(markers["hooks_attached"])
        # Idle for a few polls before the config came: its imports were done then.
        idle = busy is not None and markers["hooks_attached"] - busy > 3 * poll_s
        ready = busy if idle and busy is not None else operator
        extra["agent_import_s"] = ready - agent.start
        extra["agent_waited_for_config_s"] = max(0.0, operator - ready)
    cpu: dict[str, float] = {}
    for kind, procs in kinds.items():
        if procs:
            cpu[kind] = sum(p.cpu_s for p in procs)
    return Run(end - start, phases, extra, cpu, os.getloadavg()[0])


def run_torchrun(tmp: Path, index: int, steps: int, poll_s: float, script: Path) -> Run:
    where = tmp / f"torchrun-{index}"
    marks_dir = where / "marks"
    marks_dir.mkdir(parents=True)
    exe = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(exe) if exe.exists() else "torchrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        str(steps),
        str(marks_dir),
    ]
    start, end, watch, log = _watched(cmd, where, where, poll_s)
    _, elastic = read_logs(log)

    ranks = [json.loads(p.read_text()) for p in sorted(marks_dir.glob("rank-*.json"))]
    if len(ranks) != 2:
        raise RuntimeError(f"torchrun: {len(ranks)} ranks wrote their marks:\n{log[-2000:]}")
    root = watch.root
    children = [p for p in watch.procs.values() if p.ppid == root and str(script) in p.cmd]
    markers: dict[str, float | None] = {
        "elastic_operator": _elastic_line(elastic, "Starting elastic_operator"),
        "rendezvous_done": _elastic_line(elastic, "Rendezvous complete for workers"),
        "workers_spawned": _last([c.start for c in children]),
        "exit": end,
    }
    for mark in ("start", "imports", "pg", "setup", "trained", "destroyed"):
        markers["script_start" if mark == "start" else mark] = max(r[mark] for r in ranks)
    phases = phases_of(start, markers, [name for name, _ in TORCHRUN_PHASES])
    cpu = {"torchrun": 0.0, "worker": 0.0}
    for p in watch.procs.values():
        cpu["torchrun" if p.pid == root else "worker"] += p.cpu_s
    return Run(end - start, phases, {}, cpu, os.getloadavg()[0])


def isolated_launcher_costs(steps: int) -> dict[str, Any]:
    """The launcher's imports, spec load and split plan, in a process of their own."""
    result = subprocess.run(
        [sys.executable, "-c", ISOLATED, str(SPEC), str(steps)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


# ------------------------------------------------------------------ report


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _range(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else "n/a"


def _table(
    title: str, runs: list[Run], spec: list[tuple[str, str]], total: float
) -> dict[str, float]:
    print(f"\n{title}")
    print(f"{'phase':20s} {'what':57s} {'median s':>8s} {'range':>11s} {'share':>6s}")
    medians: dict[str, float] = {}
    for name, what in spec:
        values = [r.phases[name] for r in runs]
        medians[name] = _median(values)
        share = medians[name] / total if total else float("nan")
        print(f"{name:20s} {what:57s} {medians[name]:8.3f} {_range(values):>11s} {share:6.1%}")
    print(f"{'sum of medians':78s} {sum(medians.values()):8.3f}")
    print(f"{'wall (median)':78s} {total:8.3f} {_range([r.wall_s for r in runs]):>11s}")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="launches of each (alternating)")
    parser.add_argument("--steps", type=int, default=10, help="training steps per launch")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=170.0,
        help="start no repeat that would end after this many seconds (at least 3 repeats)",
    )
    parser.add_argument("--poll-s", type=float, default=0.02, help="process/file poll interval")
    args = parser.parse_args()
    began = time.monotonic()
    cores = len(os.sched_getaffinity(0))
    print(
        f"evtrain launch vs torchrun, {args.steps} steps, {cores} cores, "
        f"load average {os.getloadavg()[0]:.2f} at start",
        flush=True,
    )
    evtrain_runs: list[Run] = []
    torchrun_runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="evt-launch-bench-") as tmp_name:
        tmp = Path(tmp_name)
        script = tmp / "pipeline_mlp.py"
        script.write_text(peer_script())
        isolated = isolated_launcher_costs(args.steps)
        print(
            "launcher alone (a process of its own): CLI imports {cli_imports_s:.2f} s "
            "(loads {loaded_after_cli}), torch and torch._dynamo {torch_import_s:.2f} s "
            "(loads {loaded_after_torch}), spec load {spec_load_s:.2f} s, split plan "
            "{split_plan_s:.2f} s (then loaded: {loaded_after_split_plan})".format(**isolated),
            flush=True,
        )
        for repeat in range(args.repeats):
            pair_began = time.monotonic()
            order = ("evtrain", "torchrun") if repeat % 2 == 0 else ("torchrun", "evtrain")
            for name in order:
                if name == "evtrain":
                    run = run_evtrain(tmp, repeat, args.steps, args.poll_s)
                    evtrain_runs.append(run)
                else:
                    run = run_torchrun(tmp, repeat, args.steps, args.poll_s, script)
                    torchrun_runs.append(run)
                print(
                    f"repeat {repeat + 1}/{args.repeats}  {name:8s} {run.wall_s:6.2f} s  "
                    f"(load average {run.load:.2f})",
                    flush=True,
                )
            elapsed = time.monotonic() - began
            pair = time.monotonic() - pair_began
            if repeat + 1 >= 3 and elapsed + pair > args.budget_s and repeat + 1 < args.repeats:
                print(f"time budget: stopping after {repeat + 1} repeats ({elapsed:.0f} s)")
                break

    ev_wall = _median([r.wall_s for r in evtrain_runs])
    tr_wall = _median([r.wall_s for r in torchrun_runs])
    ev = _table("evtrain launch", evtrain_runs, EVTRAIN_PHASES, ev_wall)
    tr = _table("torchrun (the same job, Schedule1F1B)", torchrun_runs, TORCHRUN_PHASES, tr_wall)

    coarse = {k: sum(ev[n] for n in names) for k, names in COARSE.items()}
    print("\nevtrain by phase of the launch")
    for key, value in coarse.items():
        print(f"  {key:34s} {value:7.3f} s  {value / ev_wall:6.1%}")
    extras: dict[str, float | None] = {}
    for key in sorted({k for r in evtrain_runs for k in r.extra}):
        values = [v for r in evtrain_runs if (v := r.extra.get(key)) is not None]
        extras[key] = round(_median(values), 3) if values else None
    print("  overlapped (not on the path above):")
    for key, value in extras.items():
        print(f"    {key:34s} {'n/a' if value is None else f'{value:.3f} s'}")
    print(
        f"  not measurable from outside: gloo init_process_group inside the workers' setup; "
        f"the torchrun script's own takes {tr['pg']:.3f} s (estimate)"
    )
    cpu_ev = {
        k: round(_median([r.cpu_s.get(k, 0.0) for r in evtrain_runs]), 2)
        for k in sorted({k for r in evtrain_runs for k in r.cpu_s})
    }
    cpu_tr = {
        k: round(_median([r.cpu_s.get(k, 0.0) for r in torchrun_runs]), 2)
        for k in sorted({k for r in torchrun_runs for k in r.cpu_s})
    }
    print(f"  CPU seconds by process (median): evtrain {cpu_ev}; torchrun {cpu_tr}")
    launch_cpu = _median([sum(r.cpu_s.values()) for r in evtrain_runs])
    torchrun_cpu = _median([sum(r.cpu_s.values()) for r in torchrun_runs])
    print(
        f"  CPU seconds per launch (median): evtrain {launch_cpu:.2f}, torchrun {torchrun_cpu:.2f}"
    )

    ratio = ev_wall / tr_wall
    per_repeat = [e.wall_s / t.wall_s for e, t in zip(evtrain_runs, torchrun_runs, strict=False)]
    print(
        f"\nevtrain {ev_wall:.2f} s ({_range([r.wall_s for r in evtrain_runs])}) vs torchrun "
        f"{tr_wall:.2f} s ({_range([r.wall_s for r in torchrun_runs])}): ratio {ratio:.2f} "
        f"(per repeat: {' '.join(f'{r:.2f}' for r in per_repeat)})"
    )
    target = 2 * tr_wall
    if ev_wall <= target:
        print(f"within 2x torchrun ({target:.2f} s) by {target - ev_wall:.2f} s")
    else:
        biggest = sorted(ev.items(), key=lambda kv: -kv[1])[:4]
        listed = ", ".join(f"{k} {v:.2f} s" for k, v in biggest)
        print(f"2x torchrun is {target:.2f} s: {ev_wall - target:.2f} s to cut; largest: {listed}")

    def rounded(d: dict[str, float]) -> dict[str, float]:
        return {k: round(v, 3) for k, v in d.items()}

    summary = {
        "launch_vs_torchrun_ratio": round(ratio, 3),
        "launch_cpu_s": round(launch_cpu, 2),
        "torchrun_cpu_s": round(torchrun_cpu, 2),
        "evtrain_wall_s": round(ev_wall, 3),
        "torchrun_wall_s": round(tr_wall, 3),
        "evtrain_wall_range_s": [
            round(min(r.wall_s for r in evtrain_runs), 3),
            round(max(r.wall_s for r in evtrain_runs), 3),
        ],
        "torchrun_wall_range_s": [
            round(min(r.wall_s for r in torchrun_runs), 3),
            round(max(r.wall_s for r in torchrun_runs), 3),
        ],
        "ratio_per_repeat": [round(r, 3) for r in per_repeat],
        "phases": rounded(coarse),
        "evtrain_phases": rounded(ev),
        "torchrun_phases": rounded(tr),
        "overlapped": extras,
        "isolated_launcher": {
            k: round(v, 3) if isinstance(v, float) else v for k, v in isolated.items()
        },
        "cpu_s": {"evtrain": cpu_ev, "torchrun": cpu_tr},
        "not_measured": [
            "gloo init_process_group inside the evtrain workers' setup (torchrun's pg phase "
            "is the estimate)",
            "inside the launcher: CLI imports vs torch import vs spec load vs split plan "
            "(isolated_launcher measures them in a process of their own)",
        ],
        "repeats": len(evtrain_runs),
        "steps": args.steps,
        "cores": cores,
        "load_average": [round(r.load, 2) for r in evtrain_runs + torchrun_runs],
        "bench_s": round(time.monotonic() - began, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
