"""State per process under tensor parallelism: P=2 stages x T = 1, 2, 4 tensor ranks.

    python bench/tp_memory.py [--width 512] [--layers 8] [--steps 3] [--warmup 2] [--tps 1,2,4]

Model: ``--layers`` feed-forward blocks ``x + down(gelu(up(x)))`` (up: W -> 4W,
down: 4W -> W; W = ``--width``), MSE loss, AdamW, a global batch of 64 in M = 4
microbatches, one torch thread per process, gloo. The plan splits every
``up`` by columns and every ``down`` by rows, as Megatron-LM's MLP. Each
contender is a real ``evtrain launch SPEC --tp T`` (T = 1 is the peer: the
same stages unsplit, measured in the same run); what a process holds and how
fast it steps come from the run's own metrics.jsonl:

* ``state_bytes``: the parameters and optimizer state a process holds between
  steps (its slices of the split linears, the rest whole), counted tensor by
  tensor by the stage — tensor rank 0's, which every rank of an evenly split
  stage equals;
* ``step_s``: seconds per step from the end of step ``--warmup`` to the end of
  the last.

P x T processes share the machine's cores: on 2 cores the step times measure
oversubscription and gloo's all-reduces, not what NVLink gives a GPU node;
read them as what the split costs in collectives here, not as a speed-up.

The last line printed is one JSON object: ``tp_state_bytes_t<T>_over_t1`` for
each T > 1 (goals: T=2 <= 0.55, T=4 <= 0.3) and ``tp_step_time_t<T>_over_t1``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp_scaling import _checked, _launch_evtrain, step_times
from memory_scaling import per_process

BATCH = 64
MICROBATCHES = 4

SPEC = """
import functools

import torch
from torch import nn

from evtrain.job import Job, layer

WIDTH, LAYERS = {width}, {layers}


def data(n):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


job = Job(
    name="bench-tp-memory",
    layers=[layer(FeedForward) for _ in range(LAYERS)],
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
    train_data=functools.partial(data, 4 * {batch}),
    batch_size={batch},
    num_microbatches={microbatches},
    max_steps=4,
    stages=2,
    threads=1,
    microbatch_spans="off",
    hooks=[{{"type": "metrics"}}],
    tensor_parallel={tp},
    tp_plan={plan},
)
"""


def run(work: Path, width: int, layers: int, tp: int, steps: int, warmup: int) -> dict[str, Any]:
    label = f"tp{tp}"
    spec = work / f"{label}.py"
    plan = {"*.up": "colwise", "*.down": "rowwise"} if tp > 1 else None
    spec.write_text(
        SPEC.format(
            width=width, layers=layers, batch=BATCH, microbatches=MICROBATCHES, tp=tp, plan=plan
        )
    )
    run_dir = work / label
    last = warmup + steps
    rc, tail = _launch_evtrain(spec, run_dir, work / f"{label}.log", "--steps", str(last))
    # P x T processes: _checked compares with stages x dp.
    result: dict[str, Any] = {"ran": False, "stages": 2, "dp": tp, "tp": tp}
    reason = _checked(run_dir, rc, tail, result)
    if reason is not None:
        return {**result, "reason": reason}
    times = step_times(run_dir)
    result.update(per_process(run_dir, last))
    result["step_s"] = (times[last] - times[warmup]) / steps
    result["ran"] = True
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tps", default="1,2,4")
    args = parser.parse_args()
    tps = [int(t) for t in args.tps.split(",")]
    if 1 not in tps:
        parser.error("--tps must include 1: the peer every ratio is against")
    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="evtrain-tp-") as tmp:
        for tp in tps:
            results[tp] = run(Path(tmp), args.width, args.layers, tp, args.steps, args.warmup)
            r = results[tp]
            if not r["ran"]:
                print(f"T={tp}: did not run: {r['reason']}", file=sys.stderr)
                continue
            print(
                f"T={tp}: state {r['state_bytes'] / 2**20:8.1f} MiB per process, "
                f"step {r['step_s'] * 1000:7.1f} ms"
            )
    one = results[1]
    summary: dict[str, Any] = {"width": args.width, "layers": args.layers}
    if one["ran"]:
        summary["tp_state_bytes_t1"] = one["state_bytes"]
        for tp, r in results.items():
            if tp > 1 and r["ran"]:
                summary[f"tp_state_bytes_t{tp}_over_t1"] = round(
                    r["state_bytes"] / one["state_bytes"], 4
                )
                summary[f"tp_step_time_t{tp}_over_t1"] = round(r["step_s"] / one["step_s"], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
