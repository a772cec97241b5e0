"""Hook isolation: the same training with no hooks, all built-in hooks, and a 1 s/event hook.

Every configuration is a real ``evtrain launch`` (the `Launcher`, in this
process) of one job: an MLP of 8 Linear(512, 512) + ReLU layers, batch 256 in
8 microbatches, 2 stages (gloo on CPU, one torch thread per stage), default
event settings (microbatch spans "sampled").

* ``no_hooks``: the spec names no hook;
* ``all_hooks``: every built-in that only observes — logging, metrics,
  recorder, timer, lr_monitor, memory, prometheus, early_stopping (no evals
  happen, so it never acts) and tensorboard when installed. ``eval_every`` is
  left out: evaluating is extra training-side work by design, not overhead;
* ``slow_hook``: one hook that sleeps 1 s (blocking) in every event handler,
  subscribed to every event type.

Step time: wall-clock seconds per step between the last stage's ``step.ended``
events after ``--warmup`` steps, as the launcher's own subscriber receives them.
Configurations alternate within each repeat (order reversed every other
repeat); the ratios are medians over repeats of each repeat's ratio to that
repeat's ``no_hooks`` run, which cancels slow drift of the machine's load.
Goal: both ratios <= 1.02. The last line printed is one JSON object.

    python bench/hook_overhead.py [--steps 150] [--warmup 20] [--repeats 2]
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


def run_config(workdir: Path, name: str, steps: int, warmup: int, index: int) -> float:
    """Launch one configuration; seconds per step after the warm-up."""
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
    stamps: dict[int, float] = {}
    fold = launcher.progress.update

    def update(msg: Any) -> None:
        if isinstance(msg, StepEnded) and msg.stage == STAGES - 1:
            stamps[msg.step] = msg.ts
        fold(msg)

    launcher.progress.update = update  # type: ignore[method-assign]
    with stderr_to(workdir / "launch.log"):
        status = launcher.run()
    if status != 0:
        raise SystemExit(f"{name}: evtrain launch exited {status}; see {workdir / 'launch.log'}")
    first, last = warmup, warmup + steps
    if first not in stamps or last not in stamps:
        raise SystemExit(f"{name}: missing step events ({len(stamps)} of {last} seen)")
    return (stamps[last] - stamps[first]) / (last - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    from evtrain.logs import configure_logging

    configure_logging("console", "warning")  # the in-process launcher's own lines

    workdir = Path(tempfile.mkdtemp(prefix="evt-hookbench-"))
    (workdir / "slow_hook.py").write_text(SLOW_HOOK)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    started = time.monotonic()
    for repeat in range(args.repeats):
        order = list(CONFIGS) if repeat % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            step_s = run_config(workdir, name, args.steps, args.warmup, repeat)
            times[name].append(step_s)
            print(f"repeat {repeat}: {name:<10} {1000 * step_s:7.2f} ms/step", flush=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    base = median["no_hooks"]
    ratio = {
        name: statistics.median(v / b for v, b in zip(values, times["no_hooks"], strict=True))
        for name, values in times.items()
    }
    summary = {
        "no_hooks_step_s": round(base, 6),
        "all_hooks_step_s": round(median["all_hooks"], 6),
        "slow_hook_step_s": round(median["slow_hook"], 6),
        "all_hooks_ratio": round(ratio["all_hooks"], 4),
        "slow_hook_ratio": round(ratio["slow_hook"], 4),
        "all_hooks": [h["type"] for h in observing_hooks()],
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "runs_s": {name: [round(v, 6) for v in values] for name, values in times.items()},
        "wall_s": round(time.monotonic() - started, 1),
    }
    load = os.getloadavg()[0]
    summary["load_avg_1m"] = round(load, 2)
    print(f"no hooks:  {1000 * base:.2f} ms/step   (1-min load average at the end: {load:.1f})")
    print(f"all hooks: {summary['all_hooks_ratio']:.3f}x   (goal <= 1.02)")
    print(f"slow hook: {summary['slow_hook_ratio']:.3f}x   (goal <= 1.02)")
    if not args.keep:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"work directory: {workdir}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
