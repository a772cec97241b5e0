"""Hook isolation: the same training with no hooks, all built-in hooks, and a 1 s/event hook.

Every configuration is a real ``evtrain launch`` (the `Launcher`, in this
process) of one job: an MLP of 8 Linear(512, 512) + ReLU layers, batch 256 in
8 microbatches, 2 stages (gloo on CPU, one torch thread per stage), default
event settings (microbatch spans "sampled").

* ``no_hooks``: the spec names no hook;
* ``all_hooks``: every built-in that only observes — logging, metrics,
  recorder, timer, lr_monitor, memory, prometheus, early_stopping (no evals
  happen, so it never acts) and tensorboard when installed — which the
  launcher runs in one shared host process (`evtrain.launcher.hook_supervisor`).
  ``eval_every`` is left out: evaluating is extra training-side work by
  design, not overhead;
* ``slow_hook``: one hook that sleeps 1 s (blocking) in every event handler,
  subscribed to every event type (a user hook: a process of its own).

Step time: wall-clock seconds per step between the last stage's ``step.ended``
events after ``--warmup`` steps, as the launcher's own subscriber receives them.
Hook CPU: user + system seconds the launcher's ``evtrain hook`` children spent
over the same steps (read from /proc as those two events arrive), per step;
it does not depend on what else loads the machine, the step time does.
Configurations alternate within each repeat (order reversed every other
repeat); the ratios are medians over repeats of each repeat's ratio to that
repeat's ``no_hooks`` run, which cancels slow drift of the machine's load.
``--configs no_hooks,all_hooks`` runs only those (the keys of the others are
null). Goal: both ratios <= 1.02. The last line printed is one JSON object.

    python bench/hook_overhead.py [--steps 150] [--warmup 20] [--repeats 2]
        [--configs no_hooks,all_hooks,slow_hook]

Figures: docs/benchmarks.md (Hook isolation).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WIDTH = 512
LAYERS = 8
BATCH = 256
MICROBATCHES = 8
STAGES = 2

SPEC = """
import functools
import torch
from torch import nn
from evtrain.job import Job, layer

def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * {batch}, {width}, generator=g)
    return x, torch.randn(4 * {batch}, {width}, generator=g)

layers = []
for _ in range({layers}):
    layers += [layer(nn.Linear, {width}, {width}), layer(nn.ReLU)]

job = Job(
    name="hook-overhead",
    layers=layers,
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
    train_data=data,
    batch_size={batch},
    num_microbatches={microbatches},
    max_steps={steps},
    stages={stages},
    threads=1,
    run_dir={run_dir!r},
    hooks={hooks!r},
)
"""

SLOW_HOOK = '''
"""A hook that blocks 1 s in every handler (the worst-behaved subscriber)."""
import time

from evtrain.events import MESSAGE_TYPES, Event
from evtrain.hooks import Hook, on


class SlowHook(Hook):
    name = "slow"

    @on(*[t for t in MESSAGE_TYPES if issubclass(t, Event)])
    def handle(self, ev):
        time.sleep(1.0)
'''


def observing_hooks() -> list[dict[str, Any]]:
    """Every built-in hook that does not change the training work."""
    hooks: list[dict[str, Any]] = [
        dict(type="logging", every=20),
        dict(type="metrics"),
        dict(type="recorder"),
        dict(type="timer", every=50),
        dict(type="lr_monitor"),
        dict(type="memory"),
        dict(type="prometheus", port=0),
        dict(type="early_stopping", metric="loss", patience=3),
    ]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        pass
    else:
        hooks.append(dict(type="tensorboard"))
    return hooks


CONFIGS: dict[str, Any] = {
    "no_hooks": lambda: [],
    "all_hooks": observing_hooks,
    "slow_hook": lambda: [dict(type="slow_hook:SlowHook")],
}


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """Send this process's (and its children's) stderr to ``path`` for a while."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("ab") as sink:
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def hook_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of each ``evtrain hook`` child of this process, by pid."""
    ticks = os.sysconf("SC_CLK_TCK")
    found: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields follow the last ")".
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) != os.getpid() or b"evtrain" not in cmdline or b"hook" not in cmdline:
            continue
        found[int(entry)] = (int(fields[11]) + int(fields[12])) / ticks
    return found


@dataclass
class Measured:
    """One launch of one configuration, over its timed steps."""

    step_s: float
    hook_cpu_s: float
    """CPU seconds the hook processes spent (all of them together)."""
    hook_processes: int


def run_config(workdir: Path, name: str, steps: int, warmup: int, index: int) -> Measured:
    """Launch one configuration; its step time and hook CPU after the warm-up."""
    from evtrain.events import StepEnded
    from evtrain.launcher import Launcher, LaunchOptions

    spec = workdir / f"{name}-{index}.py"
    run_dir = workdir / f"run-{name}-{index}"
    spec.write_text(
        SPEC.format(
            batch=BATCH,
            width=WIDTH,
            layers=LAYERS,
            microbatches=MICROBATCHES,
            steps=warmup + steps,
            stages=STAGES,
            run_dir=str(run_dir),
            hooks=CONFIGS[name](),
        )
    )
    launcher = Launcher(
        LaunchOptions(spec=str(spec), quiet=True, hook_finish_timeout=2.0, log_level="warning"),
        out=open(os.devnull, "w"),  # noqa: SIM115 - lives as long as the launcher
    )
    # The launcher's own subscriber sees every step.ended: time the last stage's.
    # The hook processes' CPU is sampled as the first and last timed step arrive.
    stamps: dict[int, float] = {}
    cpu: dict[int, dict[int, float]] = {}
    fold = launcher.progress.update
    first, last = warmup, warmup + steps

    def update(msg: Any) -> None:
        if isinstance(msg, StepEnded) and msg.stage == STAGES - 1:
            stamps[msg.step] = msg.ts
            if msg.step in (first, last):
                cpu[msg.step] = hook_cpu()
        fold(msg)

    launcher.progress.update = update  # type: ignore[method-assign]
    with stderr_to(workdir / "launch.log"):
        status = launcher.run()
    if status != 0:
        raise SystemExit(f"{name}: evtrain launch exited {status}; see {workdir / 'launch.log'}")
    if first not in stamps or last not in stamps:
        raise SystemExit(f"{name}: missing step events ({len(stamps)} of {last} seen)")
    before, after = cpu[first], cpu[last]
    spent = sum(after[pid] - before.get(pid, 0.0) for pid in after)
    return Measured((stamps[last] - stamps[first]) / (last - first), spent, len(after))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="comma-separated configurations to run (no_hooks always runs; the others' "
        "keys are null when left out)",
    )
    args = parser.parse_args()
    chosen = ["no_hooks", *(n for n in args.configs.split(",") if n and n != "no_hooks")]
    unknown = sorted(set(chosen) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configuration(s): {', '.join(unknown)}")
    from evtrain.logs import configure_logging

    configure_logging("console", "warning")  # the in-process launcher's own lines

    workdir = Path(tempfile.mkdtemp(prefix="evt-hookbench-"))
    (workdir / "slow_hook.py").write_text(SLOW_HOOK)
    times: dict[str, list[float]] = {name: [] for name in chosen}
    hook_cpu_ms: dict[str, list[float]] = {name: [] for name in chosen}
    processes: dict[str, int] = {}
    started = time.monotonic()
    for repeat in range(args.repeats):
        order = chosen if repeat % 2 == 0 else chosen[::-1]
        for name in order:
            run = run_config(workdir, name, args.steps, args.warmup, repeat)
            times[name].append(run.step_s)
            hook_cpu_ms[name].append(1000 * run.hook_cpu_s / args.steps)
            processes[name] = run.hook_processes
            print(
                f"repeat {repeat}: {name:<10} {1000 * run.step_s:7.2f} ms/step, "
                f"hooks {hook_cpu_ms[name][-1]:5.2f} ms CPU/step in {run.hook_processes} "
                "process(es)",
                flush=True,
            )
    median = {name: round(statistics.median(values), 6) for name, values in times.items()}
    base = median["no_hooks"]
    ratios = {
        name: [v / b for v, b in zip(values, times["no_hooks"], strict=True)]
        for name, values in times.items()
    }
    ratio = {name: round(statistics.median(values), 4) for name, values in ratios.items()}
    summary = {
        "no_hooks_step_s": base,
        "all_hooks_step_s": median.get("all_hooks"),
        "slow_hook_step_s": median.get("slow_hook"),
        "all_hooks_ratio": ratio.get("all_hooks"),
        "slow_hook_ratio": ratio.get("slow_hook"),
        "all_hooks": [h["type"] for h in observing_hooks()],
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "runs_s": {name: [round(v, 6) for v in values] for name, values in times.items()},
        "ratios": {name: [round(v, 4) for v in values] for name, values in ratios.items()},
        "hook_cpu_ms_per_step": {
            name: [round(v, 3) for v in values] for name, values in hook_cpu_ms.items()
        },
        "hook_processes": processes,
        "wall_s": round(time.monotonic() - started, 1),
    }
    load = os.getloadavg()[0]
    summary["load_avg_1m"] = round(load, 2)
    print(f"no hooks:  {1000 * base:.2f} ms/step   (1-min load average at the end: {load:.1f})")
    for name in chosen[1:]:
        print(f"{name.replace('_', ' ') + ':':<10} {ratio[name]:.3f}x   (goal <= 1.02)")
    if not args.keep:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"work directory: {workdir}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
