"""``evtrain ckpt``: list, verify, commit and export checkpoints.

* ``evtrain ckpt list RUN_DIR`` — one line per checkpoint: step, time, size,
  metric, committed or not (``*`` marks the one a resume would use; a
  manifest that cannot be read shows as ``CORRUPT``). A ``run.json`` left
  ``running`` by a launcher that is gone is marked ``interrupted`` on the way.
* ``evtrain ckpt verify CKPT`` — check every file against its recorded sha256;
  for a run directory also that no checkpoint's manifest is corrupt.
* ``evtrain ckpt commit RUN_DIR`` — commit the complete checkpoints newer than
  the latest committed one that no coordinator committed (its bus was lost,
  or it was gone), each verified first (`evtrain.checkpoint.commit_complete`).
* ``evtrain ckpt export CKPT -o FILE`` — one safetensors file of the whole
  model, keys as in the unsplit ``nn.Sequential`` (``"3.weight"``), loadable
  with ``build_full_model(job).load_state_dict(safetensors.torch.load_file(FILE))``;
  ``--hf DIR`` writes a Hugging Face model directory instead
  (``model.safetensors``, and ``config.json`` when the run's model has a
  config), which ``Cls.from_pretrained(DIR)`` loads.

``CKPT`` is a checkpoint directory or a run directory (its latest committed
checkpoint). Torch is imported only by ``export``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from evtrain.checkpoint import (
    CheckpointCorrupt,
    commit_complete,
    find_resume,
    latest_committed,
    list_checkpoints,
    read_manifest,
    resolve_resume,
    validate_checkpoint,
)
from evtrain.errors import UsageError
from evtrain.launcher.run_record import mark_if_stale


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``ckpt`` subcommand and its actions."""
    parser = sub.add_parser(
        "ckpt",
        help="list, verify, commit and export checkpoints",
        description=(
            "Inspect a run's checkpoints, commit the complete ones no coordinator could, "
            "and export one for inference."
        ),
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    listing = actions.add_parser(
        "list",
        help="list a run's checkpoints",
        description="List the checkpoints of a run: step, time, size, metric, committed or not.",
    )
    listing.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.set_defaults(func=run_list)

    verify = actions.add_parser(
        "verify",
        help="check a checkpoint's files against their hashes",
        description="Check a committed checkpoint: manifest, shard records, sizes and sha256.",
    )
    verify.add_argument("ckpt", metavar="CKPT", help="checkpoint directory or run directory")
    verify.set_defaults(func=run_verify)

    commit = actions.add_parser(
        "commit",
        help="commit complete checkpoints that no coordinator committed",
        description=(
            "Commit every complete checkpoint newer than the run's latest committed one: "
            "written while the checkpoint coordinator was unreachable (a lost bus) or gone. "
            "Each is verified (every stage's shard, every file's sha256) before its manifest "
            "is written; the newest becomes the one a resume uses. Retention is not applied."
        ),
    )
    commit.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    commit.set_defaults(func=run_commit)

    export = actions.add_parser(
        "export",
        help="write the full model as one safetensors file",
        description=(
            "Consolidate the model tensors of a committed checkpoint (any number of "
            "stages) into one safetensors file with the unsplit model's keys."
        ),
    )
    export.add_argument("ckpt", metavar="CKPT", help="checkpoint directory or run directory")
    where = export.add_mutually_exclusive_group(required=True)
    where.add_argument("-o", "--output", metavar="FILE", help="output file")
    where.add_argument(
        "--hf",
        metavar="DIR",
        help="write a Hugging Face model directory: model.safetensors, and config.json "
        "when the job's model has a config (Cls.from_pretrained(DIR) loads it)",
    )
    export.add_argument(
        "--spec",
        metavar="FILE",
        help="with --hf: the job spec whose model's config to write (default: the run's, "
        "from its run.json)",
    )
    export.set_defaults(func=run_export)


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def run_list(args: argparse.Namespace) -> int:
    """Print the table (or JSON lines); notes about the run go to stderr."""
    infos = list_checkpoints(args.run_dir)
    latest = latest_committed(args.run_dir)
    stale = mark_if_stale(args.run_dir)
    if stale is not None:
        print(
            f"note: run {stale.get('run_id')} was interrupted (its launcher, pid "
            f"{stale.get('launcher_pid')}, is gone): run.json marked interrupted",
            file=sys.stderr,
        )
    for info in infos:
        if info.corrupt is not None:
            print(f"warning: {info.corrupt}", file=sys.stderr)
    if args.json:
        for info in infos:
            print(
                json.dumps(
                    {
                        "step": info.step,
                        "path": str(info.path),
                        "committed": info.committed,
                        "corrupt": info.corrupt,
                        "latest": latest is not None and info.path == latest.path,
                        "time": info.time,
                        "size_bytes": info.size_bytes,
                        "metric_name": info.metric_name,
                        "metric": info.metric,
                        "checkpoint_id": info.checkpoint_id,
                        "reason": info.reason,
                        "shards": info.shards_done,
                        "num_stages": info.num_stages,
                    }
                )
            )
        return 0
    if not infos:
        print(f"no checkpoints in {args.run_dir}")
        return 0
    header = ("", "STEP", "TIME", "SIZE", "METRIC", "COMMITTED", "SHARDS", "REASON")
    rows = [header]
    for info in infos:
        metric = (
            f"{info.metric_name}={info.metric:.6g}"
            if info.metric is not None and info.metric_name
            else "-"
        )
        shards = f"{info.shards_done}/{info.num_stages}" if info.num_stages else "0/?"
        rows.append(
            (
                "*" if latest is not None and info.path == latest.path else "",
                str(info.step),
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.time)),
                _size(info.size_bytes),
                metric,
                "yes" if info.committed else ("CORRUPT" if info.corrupt else "no"),
                shards,
                info.reason or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """Verify every file; a problem is a `CheckpointCorrupt` (exit 2) naming the file."""
    choice = find_resume(args.ckpt)
    manifest = validate_checkpoint(choice.path, hashes=True)
    if choice.skipped:
        damaged = "; ".join(str(info.corrupt) for info in choice.skipped)
        raise CheckpointCorrupt(
            f"not ok: {damaged} (the latest intact checkpoint, {choice.path}, verifies)"
        )
    print(f"ok: {choice.path} (step {manifest.step}, {manifest.num_stages} stages)")
    return 0


def run_commit(args: argparse.Namespace) -> int:
    """Commit what a coordinator could not; print each one."""
    if not Path(args.run_dir).is_dir():
        raise UsageError(f"run directory {args.run_dir} does not exist")
    committed = commit_complete(args.run_dir)
    for path in committed:
        print(f"committed: {path}")
    latest = latest_committed(args.run_dir)
    where = f"latest committed: {latest.path} (step {latest.step})" if latest else "none committed"
    print(f"{len(committed)} checkpoint(s) committed; {where}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    """Write the consolidated safetensors file atomically."""
    path = resolve_resume(args.ckpt)
    manifest = read_manifest(path)
    if args.hf is not None:
        hf_dir = Path(args.hf).expanduser()
        if hf_dir.exists() and not hf_dir.is_dir():
            raise UsageError(f"--hf: {hf_dir} is a file, not a directory")
        spec = _spec_of(path, args.spec)
        hf_dir.mkdir(parents=True, exist_ok=True)
        out = hf_dir / "model.safetensors"
    else:
        out = Path(args.output).expanduser()
        if not out.parent.is_dir():
            raise UsageError(f"output directory {out.parent} does not exist")
    # torch only now: mistakes above are reported without the import cost.
    from safetensors.torch import save_file

    # lazy: torch loads when the command runs, not when the CLI is built
    from evtrain.checkpoint.loader import read_model_tensors

    tensors = read_model_tensors(path)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        save_file(
            {k: t.contiguous() for k, t in tensors.items()},
            str(tmp),
            metadata={
                "format": "pt",
                "evtrain_checkpoint": str(path),
                "checkpoint_id": manifest.checkpoint_id,
                "step": str(manifest.step),
            },
        )
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"wrote {out}: {len(tensors)} tensors, {_size(nbytes)} (step {manifest.step} of {path})")
    if args.hf is not None:
        print(_write_config(spec, out.parent))
    return 0


def _spec_of(ckpt: Path, given: str | None) -> Path | None:
    """The job spec of the run that wrote ``ckpt``: ``given``, else its run.json's."""
    if given is not None:
        spec = Path(given).expanduser()
        if not spec.is_file():
            raise UsageError(f"--spec: {spec} is not a file")
        return spec
    # lazy: torch loads when the command runs, not when the CLI is built
    from evtrain.launcher.run_record import read_run_record

    for directory in ckpt.parents:
        record = read_run_record(directory)
        if record is not None and record.get("spec"):
            spec = Path(record["spec"])
            return spec if spec.is_file() else None
    return None


def _write_config(spec: Path | None, directory: Path) -> str:
    """Write the config.json of the spec's model, if it has one; what was done, in a line."""
    if spec is None:
        return "no config.json: the run's job spec is not found (give --spec FILE)"
    # lazy: torch loads when the command runs, not when the CLI is built
    from evtrain.spec import load_job
    from evtrain.stages.partition import meta_model

    config = getattr(meta_model(load_job(spec)), "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return f"no config.json: the model of {spec} has no Hugging Face config"
    config.save_pretrained(str(directory))
    return f"wrote {directory / 'config.json'} ({type(config).__name__} of {spec})"
