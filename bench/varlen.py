"""Batches of their own length against batches of one length: what new shapes cost.

A language model's batches are padded to their own longest sample, so every
step may bring a sequence length the run has not seen. evtrain agrees the
boundary specs of each new shape on the way (`evtrain.stages.shapes`: a
broadcast of a few integers per pass, one agreement per distinct shape);
this bench measures what that costs against the same run with one shape.

Model: Hugging Face's ``LlamaForCausalLM`` as written, the one of
bench/pipeline_vs_torch.py (width 128, 4 layers, 4 heads, vocabulary 256),
P = 2 stages, batch 16 in M = 4 microbatches, SGD, one thread per process.
Data: 4,096 token sequences whose lengths are uniform in [8, 64], read
through a DataLoader (``data_loader={"collate_fn": ...}``).
Two contenders, alternating, ``--repeats`` times each:

* ``varlen``: each batch padded to its own longest sample — a new shape in many
  steps (the summary says how many distinct ones the timed steps met);
* ``fixed``: each batch padded (or cut) to one length, the mean of
  ``varlen``'s padded lengths over the same steps (rounded): the same data
  path and about the same compute, every shape known from the first step.

Two figures, over the timed steps (after ``--warmup`` steps, which meet
their own new shapes untimed):

* ``varlen_overhead``: what the shapes cost, accounted by the stages
  themselves. Each pass's telling and agreeing is a ``shapes`` wait span
  (``microbatch_spans="all"``); on the stage that reads the inputs, where
  every step begins, their sum over its wall time in the ``varlen`` run
  (median over repeats). ``fixed_overhead`` is the same share in the
  ``fixed`` run: the per-pass broadcast alone.
* ``throughput_ratio``: padded tokens per second, ``varlen / fixed``
  (medians; the last stage's StepStarted/StepEnded timestamps). The compute
  of the two is equal to first order (attention's share, which grows with
  the square of the length, is small at these sizes), but on a shared
  2-core machine two runs differ by several percent either way: the
  accounted share is the figure that resolves 3 %.

    python bench/varlen.py [--steps 100] [--warmup 5] [--repeats 3]

The last line printed is one JSON object: ``varlen_overhead``,
``fixed_overhead``, ``throughput_ratio``, ``tokens_per_s`` (each contender's
median), ``distinct_lengths`` (of the timed steps, and all steps),
``fixed_length``, ``runs``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline_vs_torch as pvt

VOCAB = pvt.T_VOCAB
SHORTEST, LONGEST = 8, 64
SAMPLES = 4096
BATCH, MICROBATCHES, STAGES = 16, 4, 2
SEED = 5


class Sequences(Dataset[dict[str, torch.Tensor]]):
    """Token sequences of lengths uniform in [SHORTEST, LONGEST], unpadded."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, VOCAB, (SAMPLES, LONGEST + 1), generator=g)
        self.lengths = torch.randint(SHORTEST, LONGEST + 1, (SAMPLES,), generator=g).tolist()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = self.lengths[i]
        return {"input_ids": self.ids[i, :n], "labels": self.ids[i, 1 : n + 1]}


def pad(samples: list[dict[str, torch.Tensor]], length: int | None = None) -> dict[str, Any]:
    """Pad to ``length`` (default: the batch's longest sample), cutting longer samples."""
    t = length or max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), t, dtype=torch.long)
    labels = torch.full((len(samples), t), -100, dtype=torch.long)
    mask = torch.zeros(len(samples), t, dtype=torch.long)
    for row, s in enumerate(samples):
        n = min(len(s["input_ids"]), t)
        ids[row, :n], labels[row, :n], mask[row, :n] = s["input_ids"][:n], s["labels"][:n], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def spec(length: int | None) -> str:
    collate = "bench.pad" if length is None else f"functools.partial(bench.pad, length={length})"
    return f"""
import functools
import sys
import torch
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import varlen as bench
from evtrain.job import Job

job = Job(
    name="bench-varlen",
    model=bench.pvt.hf_llama,
    loss_fn=bench.pvt.hf_loss,
    optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
    train_data=bench.Sequences,
    data_loader={{"collate_fn": {collate}}},
    input_keys=("input_ids", "attention_mask"),
    target_keys="labels",
    batch_size={BATCH},
    num_microbatches={MICROBATCHES},
    max_steps=10,
    stages={STAGES},
    seed={SEED},
    microbatch_spans="all",
    threads=1,
)
"""


def padded_lengths(steps: int) -> list[int]:
    """The length each step's batch is padded to, in the order the run reads them."""
    from evtrain.data import DataStream

    data = Sequences()
    stream = DataStream(len(data), BATCH, SEED)
    return [max(data.lengths[i] for i in stream.indices(step).tolist()) for step in range(steps)]


def run(spec: Path, steps: int, warmup: int, label: str) -> tuple[float, float]:
    """Launch the stages with a live bus: steps/s (the last stage's timestamps) and
    the share of its wall time the stage reading the inputs spent on shapes."""
    from evtrain.events import MicrobatchWait, StepEnded, StepStarted

    events = pvt.run_events(
        spec,
        {"steps": str(warmup + steps)},
        STAGES,
        f"bench-varlen-{label}",
        ("step.", "microbatch.wait"),
    )
    first, final = warmup + 1, warmup + steps

    def bounds(stage: int) -> tuple[float, float]:
        starts = [e.ts for e in events if isinstance(e, StepStarted) and e.stage == stage]
        ends = [e.ts for e in events if isinstance(e, StepEnded) and e.stage == stage]
        step_of = {e.ts: e.step for e in events if isinstance(e, StepStarted | StepEnded)}
        start = next(t for t in starts if step_of[t] == first)
        end = next(t for t in ends if step_of[t] == final)
        return start, end

    start, end = bounds(STAGES - 1)
    reader_start, reader_end = bounds(0)
    shapes = sum(
        e.end - e.start
        for e in events
        if isinstance(e, MicrobatchWait)
        and e.op == "shapes"
        and e.stage == 0
        and first <= e.step <= final
    )
    return steps / (end - start), shapes / (reader_end - reader_start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats")
    args = parser.parse_args()
    total = args.warmup + args.steps
    lengths = padded_lengths(total)
    timed = lengths[args.warmup :]
    fixed_length = round(statistics.fmean(timed))
    tokens = {
        "varlen": BATCH * sum(timed) / args.steps,
        "fixed": BATCH * fixed_length,
    }
    rates: dict[str, list[float]] = {"varlen": [], "fixed": []}
    shares: dict[str, list[float]] = {"varlen": [], "fixed": []}
    with tempfile.TemporaryDirectory() as tmp:
        specs = {}
        for kind, length in (("varlen", None), ("fixed", fixed_length)):
            specs[kind] = Path(tmp) / f"{kind}.py"
            specs[kind].write_text(spec(length))
        for repeat in range(args.repeats):
            order = ["varlen", "fixed"] if repeat % 2 == 0 else ["fixed", "varlen"]
            for kind in order:
                steps_per_s, share = run(specs[kind], args.steps, args.warmup, kind)
                rate = steps_per_s * tokens[kind]
                rates[kind].append(rate)
                shares[kind].append(share)
                print(
                    f"{kind:>6} repeat {repeat}: {rate:9.0f} padded tokens/s, "
                    f"shapes {share:.4f} of the input stage's time",
                    flush=True,
                )
    median = {kind: statistics.median(values) for kind, values in rates.items()}
    share = {kind: statistics.median(values) for kind, values in shares.items()}
    ratio = median["varlen"] / median["fixed"]
    print(
        f"varlen: {len(set(timed))} distinct lengths in {args.steps} timed steps "
        f"({len(set(lengths))} in all {total}); fixed: {fixed_length}; shapes cost "
        f"{share['varlen']:.4f} (fixed: {share['fixed']:.4f}); throughput ratio {ratio:.3f}"
    )
    summary = {
        "varlen_overhead": round(share["varlen"], 4),
        "fixed_overhead": round(share["fixed"], 4),
        "throughput_ratio": round(ratio, 4),
        "tokens_per_s": {kind: round(v) for kind, v in median.items()},
        "distinct_lengths": {"timed": len(set(timed)), "all": len(set(lengths))},
        "fixed_length": fixed_length,
        "runs": {
            kind: {"tokens_per_s": [round(v) for v in rates[kind]], "shapes": shares[kind]}
            for kind in rates
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
