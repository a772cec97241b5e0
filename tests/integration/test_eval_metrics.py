"""Exact evaluation metrics, named evaluation sets and evaluation progress.

Real launches (P = 2, gloo):

* a classifier with two named eval sets, a torchmetrics macro F1 (built per
  stage by `metric`) and AUROC (an instance): both equal scikit-learn's on the
  same predictions, where the mean over microbatches would not; both sets are
  reported; the best checkpoint is chosen by ``val/f1``; ``evtrain eval``
  reproduces every recorded value of both sets and prints them by set;
  while the first evaluation is held at a known batch, ``EvalProgress`` says
  exactly how far it got;
* a padded language model whose eval microbatches hold different numbers of
  tokens: with `Job.eval_weight` the eval loss is the mean over all tokens,
  what one process computes on the whole set.

Without processes: the spec's mistakes, the exporters' names for named sets,
the console's evaluation progress.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from helpers.launch_helpers import (
    launched,
    new_marker,
    read_records,
    run_eval,
    run_launch,
    wait_for_records,
)

from evtrain.checkpoint import list_checkpoints
from evtrain.checkpoint.loader import read_model_tensors
from evtrain.data import eval_microbatches
from evtrain.errors import SpecError
from evtrain.events import EvalEnded, EvalProgress, EvalStarted, Message, RunStarted
from evtrain.exporters import MetricsLog, PrometheusExporter
from evtrain.exporters.metrics_log import eval_record
from evtrain.hooks.checkpoint import CheckpointHook
from evtrain.hooks.early_stopping import EarlyStopping
from evtrain.hooks.hook import Hook
from evtrain.job import Job, accuracy, layer, metric
from evtrain.launcher import check_monitored_metric
from evtrain.launcher.progress import RunConsole
from evtrain.spec import load_job
from evtrain.stages.evaluation import unsyncable_metric
from evtrain.stages.job_data import job_data
from evtrain.stages.partition import build_full_model

torchmetrics = pytest.importorskip("torchmetrics")
sklearn_metrics = pytest.importorskip("sklearn.metrics")

STEPS = 8
EVAL_EVERY = 4
HOLD_AT = 5
"""The first evaluation waits before this batch of the val set until the test lets it go."""
VAL, TEST = 100, 60
EVAL_BATCH, M = 8, 4

CLASSIFIER_SPEC = '''\
"""A 4-class classifier with two named eval sets and exact metrics (generated)."""

import functools
import os
import time

import torch
import torchmetrics
from torch import nn

from evtrain.job import Job, accuracy, layer, metric

CLASSES = 4


def blobs(n, offset):
    gen = torch.Generator().manual_seed(100 + offset)
    # Unbalanced classes: a macro average weighs the rare ones as much as the common.
    weights = torch.tensor([0.55, 0.25, 0.15, 0.05])
    y = torch.multinomial(weights, n, replacement=True, generator=gen)
    centers = 1.2 * torch.randn(CLASSES, 8, generator=torch.Generator().manual_seed(7))
    return centers[y] + torch.randn(n, 8, generator=gen), y


class Gate(nn.Module):
    """Identity. In the first evaluation it waits before batch `hold_at` until the file
    named by $EVTRAIN_TEST_GATE exists: the test holds the evaluation there. With
    $EVTRAIN_TEST_ROWS it appends "PID ROWS" of every eval microbatch to that file."""

    def __init__(self, hold_at, microbatches):
        super().__init__()
        self.hold_at = hold_at
        self.microbatches = microbatches
        self.calls = 0

    def forward(self, x):
        # Evaluation runs without grad; the shape probe at setup runs with it.
        rows = os.environ.get("EVTRAIN_TEST_ROWS")
        if rows and not self.training and not torch.is_grad_enabled():
            with open(rows, "a") as f:
                f.write(f"{{os.getpid()}} {{x.shape[0]}}\\n")
        path = os.environ.get("EVTRAIN_TEST_GATE")
        if path and not self.training and not torch.is_grad_enabled():
            self.calls += 1
            if self.calls == self.hold_at * self.microbatches + 1:
                deadline = time.monotonic() + 60
                while not os.path.exists(path):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the test never released the evaluation")
                    time.sleep(0.01)
        return x


job = Job(
    name="evalsets",
    layers=[
        layer(nn.Linear, 8, 32),
        layer(nn.Tanh),
        layer(nn.Linear, 32, CLASSES),
        layer(Gate, {hold_at!r}, {microbatches!r}),
    ],
    balance=[2, 2],
    loss_fn=nn.functional.cross_entropy,
    metrics={{
        "f1": metric(torchmetrics.F1Score, task="multiclass", num_classes=CLASSES, average="macro"),
        "auroc": torchmetrics.AUROC(task="multiclass", num_classes=CLASSES),
        "accuracy": accuracy,
    }},
    optimizer=functools.partial(torch.optim.Adam, lr=0.03),
    train_data=functools.partial(blobs, 256, 1),
    eval_data={{
        "val": functools.partial(blobs, {val!r}, 2),
        "test": functools.partial(blobs, {test!r}, 3),
    }},
    eval_batch_size={eval_batch!r},
    batch_size=32,
    num_microbatches={microbatches!r},
    max_steps={steps!r},
    eval_every={eval_every!r},
    seed=3,
    stages=2,
    run_dir={run_dir!r},
    hooks={hooks!r},
    microbatch_spans="off",
    threads=1,
)
'''


def write_classifier_spec(directory: Path, hooks: list[dict[str, Any]]) -> Path:
    path = directory / "spec.py"
    path.write_text(
        CLASSIFIER_SPEC.format(
            hold_at=HOLD_AT,
            microbatches=M,
            val=VAL,
            test=TEST,
            eval_batch=EVAL_BATCH,
            steps=STEPS,
            eval_every=EVAL_EVERY,
            run_dir=str(directory / "run"),
            hooks=hooks,
        )
    )
    return path


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def num_batches(n: int) -> int:
    return len(eval_microbatches(n, EVAL_BATCH, M))


@dataclass
class Trained:
    spec: Path
    run: Path
    records: list[dict[str, Any]]
    held: list[dict[str, Any]]
    """The eval records seen before the test let the held evaluation go on."""
    stdout: str


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    directory = tmp_path_factory.mktemp("evalsets")
    records = directory / "evals.jsonl"
    gate = directory / "gate"
    hooks = [
        {"type": "metrics"},
        {"type": "checkpoint", "best_metric": "val/f1", "mode": "max"},
        {"type": "helpers.launch_hooks:EvalRecorder", "path": str(records)},
    ]
    spec = write_classifier_spec(directory, hooks)
    with launched(spec, marker=new_marker(), EVTRAIN_TEST_GATE=str(gate)) as proc:
        held = wait_for_records(
            records,
            lambda rs: any(r.get("progress") == HOLD_AT for r in rs),
            proc,
            timeout=90,
        )
        gate.touch()
        out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, out + err
    yield Trained(spec, directory / "run", read_records(records), held, out)


def predictions(spec: Path, ckpt: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each eval set's (logits, targets) from the checkpoint's weights, in this process,
    microbatch by microbatch as the pipeline ran them (the same floats)."""
    job = load_job(spec)
    model = build_full_model(job)
    state = read_model_tensors(ckpt)
    model.load_state_dict({k: state[k] for k in model.state_dict()})
    model.eval()
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for name in job.eval_sets:
            data = job_data(job).eval_tensors(name)
            assert data is not None
            plan = eval_microbatches(data.num_samples, EVAL_BATCH, M)
            logits = [model(data.inputs[r.start : r.stop]) for b in plan for r in b]
            out[name] = (torch.cat(logits), data.targets)
    return out


@pytest.mark.slow
def test_both_sets_are_reported_with_their_prefixes(trained: Trained) -> None:
    evals = [r for r in lines(trained.run / "metrics.jsonl") if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [EVAL_EVERY, STEPS]
    names = {f"{s}/{m}" for s in ("val", "test") for m in ("loss", "f1", "auroc", "accuracy")}
    for record in evals:
        assert set(record["metrics"]) == names
        assert record["sets"] == {"val": VAL, "test": TEST} and record["samples"] == VAL + TEST
    ended = [r for r in trained.records if "eval_ended" in r]
    assert [r["metrics"] for r in ended] == [r["metrics"] for r in evals]
    assert f"eval at step {STEPS}: " in trained.stdout and "val/f1 " in trained.stdout


@pytest.mark.slow
def test_torchmetrics_f1_and_auroc_equal_scikit_learn_on_the_same_predictions(
    trained: Trained,
) -> None:
    recorded = {
        r["step"]: r["metrics"] for r in lines(trained.run / "metrics.jsonl") if r["type"] == "eval"
    }
    best = [c for c in list_checkpoints(trained.run) if c.committed and c.metric is not None]
    assert best, "no best checkpoint by val/f1"
    ckpt = max(best, key=lambda c: c.step)
    assert ckpt.metric == recorded[ckpt.step]["val/f1"]
    for name, (logits, y) in predictions(trained.spec, ckpt.path).items():
        got = recorded[ckpt.step]
        pred = logits.argmax(dim=1)
        f1 = sklearn_metrics.f1_score(y.numpy(), pred.numpy(), average="macro")
        probs = torch.softmax(logits, dim=1).double().numpy()
        auroc = sklearn_metrics.roc_auc_score(y.numpy(), probs, multi_class="ovr")
        assert got[f"{name}/f1"] == pytest.approx(f1, abs=1e-6)
        assert got[f"{name}/auroc"] == pytest.approx(auroc, abs=1e-5)
        assert got[f"{name}/accuracy"] == pytest.approx(float((pred == y).double().mean()))
        whole = float(torch.nn.functional.cross_entropy(logits, y))
        assert got[f"{name}/loss"] == pytest.approx(whole, rel=1e-6)
        # What a mean of the microbatches' F1 reports instead: off by far more than
        # the tolerance above.
        sizes = [len(r) for b in eval_microbatches(len(y), EVAL_BATCH, M) for r in b]
        means, start = [], 0
        for n in sizes:
            part = slice(start, start + n)
            score = sklearn_metrics.f1_score(y[part], pred[part], average="macro")
            means.append(score * n)
            start += n
        assert abs(sum(means) / len(y) - f1) > 0.01


@pytest.mark.slow
def test_evaluation_progress_is_published_while_it_runs(trained: Trained) -> None:
    total = num_batches(VAL) + num_batches(TEST)
    first = [r for r in trained.held if "progress" in r]
    # Held before batch HOLD_AT of the val set, the last stage had done exactly HOLD_AT.
    assert first and first[-1] == {"progress": HOLD_AT, "of": total, "set": "val", "step": 4}
    assert all(r["progress"] <= HOLD_AT and r["set"] == "val" for r in first)
    started = [r for r in trained.records if "eval_started" in r]
    assert started == [
        {"eval_started": EVAL_EVERY, "num_batches": total},
        {"eval_started": STEPS, "num_batches": total},
    ]
    for step in (EVAL_EVERY, STEPS):
        seen = [r["progress"] for r in trained.records if r.get("step") == step]
        assert seen == sorted(seen) and all(0 <= s <= total for s in seen)


@pytest.mark.slow
def test_evtrain_eval_reproduces_both_sets_and_prints_them(
    trained: Trained, tmp_path: Path
) -> None:
    recorded = {
        r["step"]: r["metrics"] for r in lines(trained.run / "metrics.jsonl") if r["type"] == "eval"
    }
    ckpt = max(
        (c for c in list_checkpoints(trained.run) if c.committed and c.metric is not None),
        key=lambda c: c.step,
    )
    output = tmp_path / "scores.json"
    done, left = run_eval(trained.spec, ckpt.path, output)
    assert done.returncode == 0, done.stdout + done.stderr
    assert left == []
    saved = json.loads(output.read_text())
    assert saved["metrics"] == recorded[ckpt.step]  # both sets, bit for bit
    assert saved["sets"] == {"val": VAL, "test": TEST} and saved["samples"] == VAL + TEST
    assert saved["recorded"] == {"val/f1": ckpt.metric}
    assert f"eval of step {ckpt.step}: {VAL + TEST} samples" in done.stdout
    assert "  val: loss=" in done.stdout and f"({VAL} samples)" in done.stdout
    assert "  test: loss=" in done.stdout and f"({TEST} samples)" in done.stdout


@pytest.mark.slow
def test_two_replicas_share_the_evaluation_and_equal_one(trained: Trained, tmp_path: Path) -> None:
    """At D=2 each replica evaluates half of every set's batches; loss, accuracy and the
    torchmetrics F1 and AUROC combined over both equal one replica's, bit for bit."""
    recorded = {
        r["step"]: r["metrics"] for r in lines(trained.run / "metrics.jsonl") if r["type"] == "eval"
    }
    output = tmp_path / "scores.json"
    eval_dir = tmp_path / "eval"
    rows = tmp_path / "rows"
    args = ("--dp", "2", "--eval-dir", str(eval_dir))
    done, left = run_eval(trained.spec, trained.run, output, *args, EVTRAIN_TEST_ROWS=str(rows))
    assert done.returncode == 0, done.stdout + done.stderr
    assert left == []
    saved = json.loads(output.read_text())
    assert saved["metrics"] == recorded[saved["step"]]
    assert saved["sets"] == {"val": VAL, "test": TEST}
    # Both replicas' last stages evaluated a share, every batch once: of val's 13
    # batches (12 of 8 samples, one of 4) replica 0 took 7 (52 samples), replica 1
    # six; of test's 8 (the last of 4) 32 and 28 samples.
    seen: dict[str, int] = {}
    for line in rows.read_text().splitlines():
        pid, n = line.split()
        seen[pid] = seen.get(pid, 0) + int(n)
    assert sorted(seen.values()) == [48 + 28, 52 + 32]


LM_SPEC = '''\
"""A padded language model whose eval microbatches hold different token counts (generated)."""

import functools

import torch
from torch import nn

from evtrain.job import Job, layer

VOCAB, LENGTH, PAD = 11, 12, -100


def sequences(n, offset, empty=0):
    gen = torch.Generator().manual_seed(200 + offset)
    tokens = torch.randint(0, VOCAB, (n, LENGTH + 1), generator=gen)
    x, y = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    # Lengths grow along the set, so microbatches hold very different token counts;
    # the first `empty` sequences are padding only.
    lengths = torch.linspace(1, LENGTH, n).round().long()
    lengths[:empty] = 0
    y[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = PAD
    return x, y


class Sharpen(nn.Module):
    """Scales the logits: confident predictions make the per-token losses vary widely."""

    def forward(self, x):
        return 8.0 * x


def loss_fn(output, target):
    flat = output.reshape(-1, VOCAB)
    return nn.functional.cross_entropy(flat, target.reshape(-1), ignore_index=PAD)


def token_accuracy(output, target):
    keep = target != PAD
    return (output.argmax(-1)[keep] == target[keep]).float().mean()


job = Job(
    name="paddedlm",
    layers=[
        layer(nn.Embedding, VOCAB, 16),
        layer(nn.Linear, 16, 32),
        layer(nn.Tanh),
        layer(nn.Linear, 32, VOCAB),
        layer(Sharpen),
    ],
    loss_fn=loss_fn,
    metrics={{"token_accuracy": token_accuracy}},
    eval_weight=lambda target: (target != PAD).sum(),
    # lr 0: the evaluated weights are the initial ones, which this test builds too.
    optimizer=functools.partial(torch.optim.SGD, lr=0.0),
    train_data=functools.partial(sequences, 64, 1),
    eval_data=functools.partial(sequences, 40, 2, empty=2),
    eval_batch_size=8,
    batch_size=16,
    num_microbatches=4,
    max_steps=1,
    eval_every=1,
    seed=5,
    stages=2,
    run_dir={run_dir!r},
    hooks=[{{"type": "metrics"}}],
    microbatch_spans="off",
    threads=1,
)
'''


@pytest.mark.slow
def test_a_token_level_loss_is_weighted_by_tokens(tmp_path: Path) -> None:
    spec = tmp_path / "lm.py"
    spec.write_text(LM_SPEC.format(run_dir=str(tmp_path / "run")))
    proc, left = run_launch(spec, marker=new_marker(), timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert left == []
    (record,) = [r for r in lines(tmp_path / "run" / "metrics.jsonl") if r["type"] == "eval"]
    job = load_job(spec)
    model = build_full_model(job).eval()
    data = job_data(job).eval_tensors()
    assert data is not None
    with torch.no_grad():
        logits = model(data.inputs)
    keep = data.targets != -100
    whole = float(job.loss_fn(logits, data.targets))  # one process, every token once
    accuracy_all = float((logits.argmax(-1)[keep] == data.targets[keep]).double().mean())
    assert math.isfinite(record["metrics"]["loss"])  # the all-padding microbatch added nothing
    assert record["metrics"]["loss"] == pytest.approx(whole, rel=1e-6)
    assert record["metrics"]["token_accuracy"] == pytest.approx(accuracy_all, rel=1e-6)
    # Weighted by samples instead (each microbatch's mean counted once per sequence)
    # the loss would be clearly different: the test tells the two apart.
    by_samples, n = 0.0, 0
    for batch in eval_microbatches(40, 8, 4):
        for r in batch:
            part = job.loss_fn(logits[r.start : r.stop], data.targets[r.start : r.stop])
            if keep[r.start : r.stop].any():
                by_samples += float(part) * len(r)
                n += len(r)
    assert abs(by_samples / n - whole) > 0.01


# ------------------------------------------------------------ without processes


def make_job(**fields: Any) -> Job:
    values: dict[str, Any] = dict(
        name="unit",
        layers=[layer(torch.nn.Linear, 4, 3)],
        loss_fn=torch.nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        train_data=(torch.randn(16, 4), torch.randint(0, 3, (16,))),
        batch_size=8,
        num_microbatches=2,
        max_steps=2,
        stages=1,
    )
    values.update(fields)
    return Job(**values)


class UpdateOnly:
    def update(self, output: Any, target: Any) -> None:
        """Accumulates nothing: it lacks compute() and reset()."""


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"f1": torchmetrics.F1Score}, r"metric 'f1' is the class F1Score; give an instance"),
        ({"m": UpdateOnly()}, r"metric 'm' has no compute\(\)/reset\(\)"),
        ({"f1": lambda: None}, r"cannot be called as fn\(output, target\); .*metric\(factory"),
    ],
)
def test_an_ambiguous_metric_is_refused_with_the_fix(metrics: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message) as caught:
        make_job(metrics=metrics)
    assert caught.value.field == "metrics"


class Tally:
    """A metric object of one's own: update/compute/reset, nothing to sync replicas with."""

    def __init__(self) -> None:
        self.n = 0

    def update(self, output: Any, target: Any) -> None:
        self.n += len(target)

    def compute(self) -> float:
        return float(self.n)

    def reset(self) -> None:
        self.n = 0


def test_replicas_share_evaluation_unless_a_metric_object_cannot_sync() -> None:
    f1 = metric(torchmetrics.F1Score, task="multiclass", num_classes=3)
    collection = torchmetrics.MetricCollection({"acc": torchmetrics.Accuracy(task="binary")})
    assert unsyncable_metric(make_job(metrics={"f1": f1, "all": collection})) is None
    assert unsyncable_metric(make_job(metrics={"f1": f1, "mine": Tally()})) == "mine"


def test_metric_kinds_and_eval_set_names() -> None:
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    f1 = metric(torchmetrics.F1Score, task="multiclass", num_classes=3)
    job = make_job(
        metrics={"accuracy": accuracy, "f1": f1, "auroc": torchmetrics.AUROC(task="binary")},
        eval_data={"val": (x, y), "test": (x[:6], y[:6])},
    )
    assert job.eval_sets == ("val", "test")
    assert job.eval_metric_names()[:4] == ("val/loss", "val/accuracy", "val/f1", "val/auroc")
    data = job_data(job)
    assert data.num_eval_samples("test") == 6 and data.eval_tensors("val").num_samples == 10
    with pytest.raises(ValueError, match="several eval sets"):
        job_data(job).eval_tensors()
    assert make_job(eval_data=(x, y)).eval_sets == ("",)
    assert make_job().eval_sets == ()
    # Stacked tensors by key are one set, not sets named after the keys.
    keyed = make_job(eval_data={"x": x, "y": y}, input_keys="x", target_keys="y")
    assert keyed.eval_sets == ("",) and job_data(keyed).num_eval_samples() == 10
    for bad, message in [({}, "names no evaluation set"), ({"a/b": (x, y)}, "set names")]:
        with pytest.raises(SpecError, match=message):
            make_job(eval_data=bad)
    with pytest.raises(SpecError, match="set 'val': "):
        job_data(make_job(eval_data={"val": "data.csv"})).eval_tensors("val")


def test_each_named_set_has_its_own_reader_in_memory_and_through_a_data_loader() -> None:
    from evtrain.stages.loading import make_reader

    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    sets = {"val": (x, y), "test": (x[6:], y[6:])}
    pairs = {name: [(a[i], b[i]) for i in range(len(a))] for name, (a, b) in sets.items()}
    cpu = torch.device("cpu")
    for job in (make_job(eval_data=sets), make_job(eval_data=pairs, data_loader={})):
        data = job_data(job)
        plan = eval_microbatches(data.num_eval_samples("test"), 4, 2)
        assert [len(r) for b in plan for r in b] == [2, 2]
        reader = make_reader(data, "eval", True, True, cpu, eval_plan=plan, eval_set="test")
        assert reader is not None
        for r in (range(0, 2), range(2, 4)):  # in order, as an evaluation reads them
            inputs, targets = reader.rows(r)
            rows = slice(6 + r.start, 6 + r.stop)
            assert torch.equal(inputs, x[rows]) and torch.equal(targets, y[rows])


def test_a_hook_watching_an_unprefixed_name_of_named_sets_is_a_spec_error() -> None:
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    named = make_job(metrics={"accuracy": accuracy}, eval_data={"val": (x, y), "test": (x, y)})
    with pytest.raises(SpecError, match=r"best_metric 'accuracy' .* 'val/accuracy' or 'test/"):
        check_monitored_metric(named, CheckpointHook(best_metric="accuracy"))
    with pytest.raises(SpecError, match=r"metric 'loss' is reported per eval set"):
        check_monitored_metric(named, EarlyStopping())
    check_monitored_metric(named, CheckpointHook(best_metric="val/accuracy"))
    check_monitored_metric(make_job(eval_data=(x, y)), CheckpointHook(best_metric="loss"))

    class Watcher(Hook):
        """A hook of the user's own that says which metric it acts on."""

        def watched_metric(self) -> tuple[str, str] | None:
            return "threshold_of", "accuracy"

    with pytest.raises(SpecError, match=r"hook watcher: threshold_of 'accuracy' is reported"):
        check_monitored_metric(named, Watcher())
    check_monitored_metric(named, Hook())  # watches nothing


def _replayed(hook: Any, events: list[Message]) -> None:
    from evtrain.tools.replay import ReplayRunner

    runner = ReplayRunner([hook])
    anyio.run(runner.replay, events)
    assert runner.errors == 0


def _run_started() -> RunStarted:
    return RunStarted(
        name="r",
        num_stages=2,
        num_microbatches=2,
        schedule="1f1b",
        max_steps=10,
        batch_size=8,
        run_id="run-a",
    )


NAMED = EvalEnded(
    step=4,
    stage=1,
    metrics={"val/loss": 0.5, "val/f1": 0.75, "test/loss": 0.625, "x/y": 2.0},
    samples=30,
    sets={"val": 20, "test": 10},
    run_id="run-a",
)


def test_prometheus_labels_each_set_and_keeps_an_unnamed_one_as_it_was() -> None:
    exporter = PrometheusExporter(port=0)
    plain = EvalEnded(step=2, stage=1, metrics={"loss": 1.5, "a/b": 3.0}, run_id="run-a")
    _replayed(exporter, [_run_started(), plain, NAMED])
    value = exporter.registry.get_sample_value
    assert value("evtrain_eval_metric", {"set": "val", "metric": "f1"}) == 0.75
    assert value("evtrain_eval_metric", {"set": "test", "metric": "loss"}) == 0.625
    # Not a set of this evaluation: the whole name is the metric.
    assert value("evtrain_eval_metric", {"set": "", "metric": "x/y"}) == 2.0
    assert value("evtrain_eval_metric", {"set": "", "metric": "loss"}) == 1.5
    assert value("evtrain_eval_metric", {"set": "", "metric": "a/b"}) == 3.0


def test_metrics_log_and_tensorboard_names_of_named_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert eval_record(NAMED)["sets"] == {"val": 20, "test": 10}
    assert "sets" not in eval_record(EvalEnded(step=1, stage=1, metrics={"loss": 1.0}))
    log = MetricsLog(dir=str(tmp_path))
    _replayed(log, [_run_started(), NAMED])
    (written,) = lines(tmp_path / "metrics.jsonl")
    assert written["metrics"] == NAMED.metrics and written["sets"] == NAMED.sets

    scalars: list[tuple[str, float, int]] = []

    class Writer:
        def __init__(self, log_dir: str, flush_secs: int) -> None:
            self.log_dir = log_dir

        def add_scalar(self, tag: str, value: float, step: int, walltime: Any = None) -> None:
            scalars.append((tag, value, step))

        def flush(self) -> None:
            """Nothing buffered."""

        def close(self) -> None:
            """Nothing open."""

    from evtrain.exporters import tensorboard

    monkeypatch.setattr(tensorboard, "_summary_writer_class", lambda: Writer)
    board = tensorboard.TensorBoardWriter(dir=str(tmp_path / "tb"))
    _replayed(board, [_run_started(), NAMED])
    assert ("eval/val/f1", 0.75, 4) in scalars and ("eval/test/loss", 0.625, 4) in scalars


class Stream(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_console_shows_evaluation_progress_in_plain_lines() -> None:
    out = Stream()
    console = RunConsole(out, Stream(), interval=5.0)
    console.update(_run_started())
    console.update(EvalStarted(step=4, stage=1, num_batches=21))
    console.update(EvalProgress(step=4, stage=1, batches_done=5, num_batches=21, set="val"))
    console.update(EvalProgress(step=4, stage=1, batches_done=3, num_batches=21, set="val"))
    assert console.progress.eval_text() == "evaluating@4 5/21 val"
    console.tick(now=console._last_plain + 6)
    console.tick(now=console._last_plain + 12)  # no progress since: nothing new to say
    console.update(EvalProgress(step=4, stage=1, batches_done=15, num_batches=21, set="test"))
    console.tick(now=console._last_plain + 6)
    console.update(NAMED)
    assert console.progress.eval_text().startswith("eval@4 val/loss 0.5")
    console.close()
    assert out.getvalue().splitlines() == [
        "evaluating step 4: 5/21 batches val",
        "evaluating step 4: 15/21 batches test",
        "eval at step 4: val/loss 0.5 val/f1 0.75 test/loss 0.625 x/y 2",
    ]
    # An evaluation-only run prints its own result: no eval line from the console.
    quiet_evals = Stream()
    console = RunConsole(quiet_evals, Stream(), eval_lines=False)
    console.update(NAMED)
    console.close()
    assert quiet_evals.getvalue() == ""
