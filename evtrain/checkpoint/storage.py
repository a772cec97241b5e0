"""Checkpoints on disk: layout, shard records, the manifest and its atomic commit, retention.

Layout of one run's checkpoints::

    RUN_DIR/checkpoints/
        latest                      name of the most recently committed checkpoint
        .coordinator.json           the checkpoint hook's own state (pending requests)
        step-00000100/
            stage-0/                one directory per pipeline stage, written by it
                .metadata             torch.distributed.checkpoint metadata (a pickle)
                __0_0.distcp          the tensors (model, optimizer state, RNG)
                state.json            non-tensor state: step, data position, optimizer
                                      hyperparameters, LR scheduler, python/numpy RNG
                SHARD.json            the shard-complete record, written last
            stage-1/ ...
            MANIFEST.json           written last of all: the checkpoint is committed

Durability protocol (each step only after the previous one is on disk):

1. Each stage writes its files with fsync, then its ``SHARD.json`` (sizes and
   sha256 of every file) atomically: temp file, fsync, rename, fsync of the
   directory. A stage directory without ``SHARD.json`` is incomplete.
2. The coordinator (the checkpoint hook) writes ``MANIFEST.json`` the same
   atomic way only when every stage's record is there. A checkpoint directory
   without a manifest is *uncommitted* and is never resumed.
3. Then ``latest`` moves (atomically), then retention prunes.

This module is torch-free so that ``evtrain ckpt list`` and the hook start fast;
the stage side (saving and loading tensors) is `evtrain.checkpoint.writer` and
`evtrain.checkpoint.loader`.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import os
import re
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
import structlog

from evtrain.errors import UsageError

__all__ = [
    "CHECKPOINTS_DIR",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "SHARD_RECORD_FILE",
    "STATE_FILE",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointInfo",
    "Manifest",
    "NotCommitted",
    "ResumeChoice",
    "ShardFile",
    "ShardRecord",
    "StageEntry",
    "TensorInfo",
    "atomic_write_bytes",
    "best_checkpoint",
    "checkpoint_path_template",
    "checkpoints_root",
    "commit_checkpoint",
    "commit_complete",
    "committed_shard_record",
    "find_resume",
    "format_checkpoint_path",
    "fsync_dir",
    "is_better",
    "is_committed",
    "latest_committed",
    "list_checkpoints",
    "parse_step_dir",
    "plan_retention",
    "prune",
    "read_manifest",
    "read_shard_record",
    "remove_checkpoint",
    "resolve_resume",
    "set_latest",
    "sha256_file",
    "shard_records",
    "stage_dir",
    "step_dir",
    "validate_checkpoint",
    "verify_shard_files",
    "write_shard_record",
]

log = structlog.get_logger("evtrain.checkpoint.storage")


CHECKPOINTS_DIR = "checkpoints"
MANIFEST_FILE = "MANIFEST.json"
SHARD_RECORD_FILE = "SHARD.json"
STATE_FILE = "state.json"
LATEST_FILE = "latest"
STEP_DIR_FORMAT = "step-{step:08d}"
_STEP_DIR_RE = re.compile(r"^step-(\d{8,})$")
_FORMAT_VERSION = 1


# ------------------------------------------------------------------------- errors


class CheckpointError(UsageError):
    """A checkpoint cannot be used as asked (missing, uncommitted, inconsistent)."""


class NotCommitted(CheckpointError):
    """The checkpoint directory has no valid manifest: it was never committed."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint file is missing, truncated or altered; the message names the file."""


# ----------------------------------------------------------------------- records


class ShardFile(msgspec.Struct, frozen=True):
    """Size and sha256 of one file of a stage shard."""

    size: int
    sha256: str


class TensorInfo(msgspec.Struct, frozen=True):
    """Shape and dtype (torch name without ``torch.``) of one tensor in a shard."""

    shape: list[int]
    dtype: str


class ShardRecord(msgspec.Struct, kw_only=True):
    """``stage-{k}/SHARD.json``: written by a stage when its shard is durable."""

    format: str = "evtrain-shard"
    version: int = _FORMAT_VERSION
    checkpoint_id: str
    step: int
    """Optimizer steps completed when the state was captured (= the next step to run)."""
    stage: int
    num_stages: int
    layers: list[int]
    """``[start, stop)`` global layer indices this stage held; one such pair after
    the other when it held several model chunks (interleaved and zbv)."""
    reason: str = ""
    metric: float | None = None
    """The evaluated metric value a best checkpoint was saved for."""
    created: float
    """Wall-clock time the state was captured."""
    bytes: int
    duration_s: float
    """Capture to durable record, seconds."""
    blocked_s: float
    """Training time the save blocked, seconds."""
    files: dict[str, ShardFile]
    tensors: dict[str, TensorInfo]
    """Every tensor key in the DCP shard, with its shape and dtype."""
    model_keys: list[str]
    """The keys of ``tensors`` that are model state (named as in the unsplit model)."""


class StageEntry(msgspec.Struct, frozen=True):
    """One stage shard as listed in the manifest."""

    stage: int
    path: str
    layers: list[int]
    bytes: int
    record_sha256: str
    """sha256 of the stage's ``SHARD.json``: binds the manifest to the records."""


class Manifest(msgspec.Struct, kw_only=True):
    """``MANIFEST.json``: its presence makes a checkpoint committed."""

    format: str = "evtrain-checkpoint"
    version: int = _FORMAT_VERSION
    checkpoint_id: str
    step: int
    num_stages: int
    created_at: float
    committed_at: float
    bytes: int
    reason: str = ""
    run_id: str = ""
    metric_name: str | None = None
    metric: float | None = None
    metric_mode: Literal["min", "max"] | None = None
    stages: list[StageEntry]


_json_encoder = msgspec.json.Encoder()


def _encode_json(obj: object) -> bytes:
    # Pretty enough to read with `cat`, exact enough to round-trip floats.
    return msgspec.json.format(_json_encoder.encode(obj), indent=1) + b"\n"


# ------------------------------------------------------------------------ layout


def checkpoints_root(run_dir: str | os.PathLike[str]) -> Path:
    """``RUN_DIR/checkpoints``."""
    return Path(run_dir) / CHECKPOINTS_DIR


def step_dir(run_dir: str | os.PathLike[str], step: int) -> Path:
    """``RUN_DIR/checkpoints/step-{step:08d}``."""
    return checkpoints_root(run_dir) / STEP_DIR_FORMAT.format(step=step)


def checkpoint_path_template(run_dir: str | os.PathLike[str]) -> str:
    """The ``CheckpointNow.path`` to send: ``RUN_DIR/checkpoints/step-{step:08d}``.

    The stages replace ``{step}`` with the step at which they apply the command
    (see `format_checkpoint_path`), so the coordinator need not know it ahead.
    """
    return str(checkpoints_root(run_dir) / STEP_DIR_FORMAT)


def format_checkpoint_path(path: str | os.PathLike[str], step: int) -> Path:
    """``path`` with a ``{step}`` placeholder (format spec allowed) filled in.

    A path without a placeholder is returned unchanged. Raises `CheckpointError`
    for any other placeholder.
    """
    text = os.fspath(path)
    if "{" not in text:
        return Path(text)
    try:
        return Path(text.format(step=step))
    except (KeyError, IndexError, ValueError) as exc:
        raise CheckpointError(
            f"bad checkpoint path template {text!r}: only {{step}} may be used ({exc})"
        ) from None


def stage_dir(ckpt_dir: str | os.PathLike[str], stage: int) -> Path:
    """``CKPT_DIR/stage-{stage}``."""
    return Path(ckpt_dir) / f"stage-{stage}"


def parse_step_dir(path: str | os.PathLike[str]) -> int | None:
    """The step of a ``step-NNNNNNNN`` directory name, else None."""
    match = _STEP_DIR_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


# ---------------------------------------------------------------- atomic writes


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that entries created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably.

    Temp file in the same directory, fsync, rename over ``path``, fsync of the
    directory: a crash leaves either the old file or the new one, never a mix,
    and once this returns the new one survives power loss.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file (hashlib releases the GIL on large chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------- shard records


def write_shard_record(stage_path: str | os.PathLike[str], record: ShardRecord) -> None:
    """Write ``SHARD.json`` atomically (the last file a stage writes)."""
    atomic_write_bytes(Path(stage_path) / SHARD_RECORD_FILE, _encode_json(record))


def read_shard_record(stage_path: str | os.PathLike[str]) -> ShardRecord:
    """Read ``stage-{k}/SHARD.json``; `CheckpointCorrupt` naming the file if absent or bad."""
    path = Path(stage_path) / SHARD_RECORD_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{path} is missing: the stage shard was never completed") from None
    try:
        return msgspec.json.decode(data, type=ShardRecord)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointCorrupt(f"{path} is not a valid shard record: {exc}") from None


def shard_records(ckpt_dir: str | os.PathLike[str]) -> dict[int, ShardRecord]:
    """The readable shard records present in a checkpoint directory, by stage."""
    out: dict[int, ShardRecord] = {}
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        return out
    for child in ckpt.iterdir():
        if not (child.name.startswith("stage-") and (child / SHARD_RECORD_FILE).exists()):
            continue
        try:
            record = read_shard_record(child)
        except CheckpointCorrupt as exc:
            log.warning("unreadable shard record", error=str(exc))
            continue
        if child.name == f"stage-{record.stage}":
            out[record.stage] = record
    return out


def verify_shard_files(
    stage_path: str | os.PathLike[str], record: ShardRecord, *, hashes: bool = True
) -> None:
    """Check every file of a shard against its record (size, and sha256 with ``hashes``).

    Raises `CheckpointCorrupt` naming the first file that is missing, truncated
    or altered.
    """
    stage_path = Path(stage_path)
    for name, expected in sorted(record.files.items()):
        path = stage_path / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{path} is missing from the checkpoint") from None
        if size != expected.size:
            raise CheckpointCorrupt(
                f"{path} is truncated or altered: {size} bytes, the shard record says "
                f"{expected.size}"
            )
        if hashes and sha256_file(path) != expected.sha256:
            raise CheckpointCorrupt(
                f"{path} is corrupted: its sha256 does not match the shard record"
            )


# ---------------------------------------------------------------------- manifest


def read_manifest(ckpt_dir: str | os.PathLike[str]) -> Manifest:
    """The manifest of a committed checkpoint.

    Raises `CheckpointError` if the directory does not exist, `NotCommitted`
    if it has no manifest, `CheckpointCorrupt` if the manifest is unreadable.
    """
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint directory {ckpt} does not exist")
    path = ckpt / MANIFEST_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise NotCommitted(
            f"checkpoint {ckpt} is not committed (no {MANIFEST_FILE}): its write did not "
            "finish or was abandoned; only committed checkpoints can be used"
        ) from None
    try:
        return msgspec.json.decode(data, type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointCorrupt(f"{path} is not a valid manifest: {exc}") from None


def is_committed(ckpt_dir: str | os.PathLike[str]) -> bool:
    """Whether ``ckpt_dir`` holds a readable manifest."""
    try:
        read_manifest(ckpt_dir)
    except CheckpointError:
        return False
    return True


def commit_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    *,
    checkpoint_id: str,
    num_stages: int,
    step: int | None = None,
    reason: str = "",
    run_id: str = "",
    metric_name: str | None = None,
    metric: float | None = None,
    metric_mode: Literal["min", "max"] | None = None,
    verify_hashes: bool = False,
) -> Manifest:
    """Commit a checkpoint: write its manifest atomically once every shard is durable.

    Checks that ``stage-0 .. stage-{num_stages-1}`` each hold a shard record of
    ``checkpoint_id`` (and ``step``, if given) and that every recorded file is
    present with its recorded size (and hash with ``verify_hashes``); raises
    `CheckpointError` otherwise and writes nothing. Returns the manifest.
    """
    ckpt = Path(ckpt_dir)
    if (ckpt / MANIFEST_FILE).exists():
        raise CheckpointError(f"checkpoint {ckpt} is already committed")
    entries: list[StageEntry] = []
    records: list[ShardRecord] = []
    for stage in range(num_stages):
        spath = stage_dir(ckpt, stage)
        record = read_shard_record(spath)
        if record.checkpoint_id != checkpoint_id:
            raise CheckpointError(
                f"{spath / SHARD_RECORD_FILE} belongs to checkpoint {record.checkpoint_id!r}, "
                f"not {checkpoint_id!r}"
            )
        if record.num_stages != num_stages or record.stage != stage:
            raise CheckpointError(
                f"{spath / SHARD_RECORD_FILE} is stage {record.stage} of "
                f"{record.num_stages}, expected stage {stage} of {num_stages}"
            )
        if step is not None and record.step != step:
            raise CheckpointError(
                f"{spath / SHARD_RECORD_FILE} was saved at step {record.step}, expected {step}"
            )
        verify_shard_files(spath, record, hashes=verify_hashes)
        records.append(record)
        entries.append(
            StageEntry(
                stage=stage,
                path=spath.name,
                layers=record.layers,
                bytes=record.bytes,
                record_sha256=sha256_file(spath / SHARD_RECORD_FILE),
            )
        )
    steps = {r.step for r in records}
    if len(steps) != 1:
        raise CheckpointError(f"the shards of {ckpt} were saved at different steps {sorted(steps)}")
    # Every layer exactly once: the shards tile the model.
    covered = sorted(
        (start, stop)
        for r in records
        for start, stop in zip(r.layers[::2], r.layers[1::2], strict=True)
    )
    for (_, stop), (start, _) in itertools.pairwise(covered):
        if stop != start:
            raise CheckpointError(f"the shards of {ckpt} do not tile the layers: {covered}")
    manifest = Manifest(
        checkpoint_id=checkpoint_id,
        step=steps.pop(),
        num_stages=num_stages,
        created_at=min(r.created for r in records),
        committed_at=time.time(),
        bytes=sum(r.bytes for r in records),
        reason=reason,
        run_id=run_id,
        metric_name=metric_name,
        metric=metric,
        metric_mode=metric_mode,
        stages=entries,
    )
    # The stage directories' own entries must be durable before the manifest is.
    fsync_dir(ckpt)
    atomic_write_bytes(ckpt / MANIFEST_FILE, _encode_json(manifest))
    log.debug("manifest written", path=str(ckpt), step=manifest.step, id=checkpoint_id)
    return manifest


def validate_checkpoint(ckpt_dir: str | os.PathLike[str], *, hashes: bool = True) -> Manifest:
    """Fully check a committed checkpoint: manifest, records, every file's size and hash.

    Raises `NotCommitted` or `CheckpointCorrupt` (naming the file) on the first problem.
    """
    ckpt = Path(ckpt_dir)
    manifest = read_manifest(ckpt)
    for entry in manifest.stages:
        spath, record = committed_shard_record(ckpt, entry)
        verify_shard_files(spath, record, hashes=hashes)
    return manifest


def committed_shard_record(ckpt: Path, entry: StageEntry) -> tuple[Path, ShardRecord]:
    """A committed stage's shard directory and record, checked against the manifest.

    Raises `CheckpointCorrupt` if the record is missing or was altered after commit.
    """
    spath = ckpt / entry.path
    record_path = spath / SHARD_RECORD_FILE
    if not record_path.exists():
        raise CheckpointCorrupt(f"{record_path} is missing from the committed checkpoint")
    if sha256_file(record_path) != entry.record_sha256:
        raise CheckpointCorrupt(f"{record_path} was altered after the checkpoint was committed")
    return spath, read_shard_record(spath)


# ------------------------------------------------------------------------ latest


def set_latest(run_dir: str | os.PathLike[str], ckpt_dir: str | os.PathLike[str]) -> None:
    """Point ``RUN_DIR/checkpoints/latest`` at ``ckpt_dir`` (atomically; must be committed)."""
    ckpt = Path(ckpt_dir)
    read_manifest(ckpt)  # never point at an uncommitted checkpoint
    atomic_write_bytes(checkpoints_root(run_dir) / LATEST_FILE, f"{ckpt.name}\n".encode())


# ------------------------------------------------------------------------ listing


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory as found on disk."""

    path: Path
    step: int
    committed: bool
    time: float
    """Commit time if committed, else the newest modification time inside."""
    size_bytes: int
    checkpoint_id: str | None
    reason: str
    metric: float | None
    metric_name: str | None
    metric_mode: str | None
    num_stages: int | None
    shards_done: int
    """Stages whose shard record is present."""
    manifest: Manifest | None
    corrupt: str | None = None
    """Why its ``MANIFEST.json`` cannot be read, when it has one that cannot: a
    checkpoint that was committed and then damaged (it is not treated as committed)."""


def _tree_size_and_mtime(path: Path) -> tuple[int, float]:
    size, newest = 0, 0.0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            size += st.st_size
            newest = max(newest, st.st_mtime)
    if newest == 0.0:
        with contextlib.suppress(FileNotFoundError):
            newest = path.stat().st_mtime
    return size, newest


def _info(path: Path, step: int) -> CheckpointInfo:
    size, mtime = _tree_size_and_mtime(path)
    records = shard_records(path)
    corrupt: str | None = None
    try:
        manifest: Manifest | None = read_manifest(path)
    except CheckpointCorrupt as exc:
        manifest, corrupt = None, str(exc)
    except CheckpointError:
        manifest = None
    if manifest is not None:
        return CheckpointInfo(
            path=path,
            step=manifest.step,
            committed=True,
            time=manifest.committed_at,
            size_bytes=size,
            checkpoint_id=manifest.checkpoint_id,
            reason=manifest.reason,
            metric=manifest.metric,
            metric_name=manifest.metric_name,
            metric_mode=manifest.metric_mode,
            num_stages=manifest.num_stages,
            shards_done=len(records),
            manifest=manifest,
        )
    first = next(iter(records.values()), None)
    return CheckpointInfo(
        path=path,
        step=step,
        committed=False,
        time=mtime,
        size_bytes=size,
        checkpoint_id=first.checkpoint_id if first else None,
        reason=first.reason if first else "",
        metric=None,
        metric_name=None,
        metric_mode=None,
        num_stages=first.num_stages if first else None,
        shards_done=len(records),
        manifest=None,
        corrupt=corrupt,
    )


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Every ``step-*`` directory of a run, committed or not, by step (then time).

    Raises `CheckpointError` if ``run_dir`` does not exist; a run without a
    ``checkpoints`` directory has none.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise CheckpointError(f"run directory {run} does not exist")
    root = checkpoints_root(run)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = parse_step_dir(child)
        if step is not None and child.is_dir():
            found.append(_info(child, step))
    return sorted(found, key=lambda info: (info.step, info.time))


def _read_latest_pointer(root: Path) -> Path | None:
    try:
        name = (root / LATEST_FILE).read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    if not name or "/" in name or parse_step_dir(name) is None:
        return None
    return root / name


def latest_committed(run_dir: str | os.PathLike[str]) -> CheckpointInfo | None:
    """The checkpoint a resume should use: the most recently committed one.

    ``latest`` is followed when it points at a committed checkpoint; otherwise
    (missing, or a crash between the commit and its move) the committed
    checkpoint with the newest commit time wins. Uncommitted checkpoints are
    never returned.
    """
    infos = [info for info in list_checkpoints(run_dir) if info.committed]
    if not infos:
        return None
    pointed = _read_latest_pointer(checkpoints_root(run_dir))
    newest = max(infos, key=lambda info: (info.time, info.step))
    for info in infos:
        if pointed is not None and info.path == pointed:
            if info is not newest and newest.time > info.time:
                # `latest` lags: the crash came between a commit and its move.
                log.warning("latest pointer is stale", latest=str(pointed), newest=str(newest.path))
                return newest
            return info
    return newest


def commit_complete(run_dir: str | os.PathLike[str], *, run_id: str = "") -> list[Path]:
    """Commit the checkpoints that no coordinator could: every complete one newer than
    the latest committed (each stage's shard record there, every file's hash verified),
    oldest first; the newest becomes ``latest``. Returns their directories.

    For a run whose coordinator was unreachable (a lost bus) or is gone: the
    shards were durable, only the verdict was missing. One that does not verify
    stays uncommitted, with a warning. Retention is the coordinator's and is
    not applied.
    """
    latest = latest_committed(run_dir)
    floor = -1 if latest is None else latest.step
    done: list[Path] = []
    for info in list_checkpoints(run_dir):
        complete = info.num_stages is not None and info.shards_done == info.num_stages
        if info.committed or info.step <= floor or info.corrupt or not complete:
            continue
        assert info.checkpoint_id is not None and info.num_stages is not None
        try:
            commit_checkpoint(
                info.path,
                checkpoint_id=info.checkpoint_id,
                num_stages=info.num_stages,
                step=info.step,
                reason=info.reason,
                run_id=run_id,
                verify_hashes=True,
            )
        except CheckpointError as exc:
            log.warning("checkpoint left uncommitted", path=str(info.path), error=str(exc))
            continue
        done.append(info.path)
    if done:
        set_latest(run_dir, done[-1])
    return done


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint a path resolves to, and the damaged ones passed over to get there."""

    path: Path
    skipped: tuple[CheckpointInfo, ...] = ()
    """Checkpoints at or after the chosen step whose manifest is corrupt."""

    def warnings(self) -> list[str]:
        """One line per skipped checkpoint, naming what is resumed instead."""
        return [
            f"{info.corrupt}: passed over for the older {self.path.name}" for info in self.skipped
        ]


def find_resume(path: str | os.PathLike[str]) -> ResumeChoice:
    """The committed checkpoint directory that ``path`` names (see `resolve_resume`).

    For a run directory, it also returns the newer checkpoints that were
    passed over because their manifest is corrupt, so the caller can say so.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist")
    if p.is_file():
        if p.name != LATEST_FILE:
            raise CheckpointError(f"{p} is a file; give a checkpoint directory or a run directory")
        target = _read_latest_pointer(p.parent)
        if target is None:
            raise CheckpointError(f"{p} does not name a checkpoint")
        p = target
    if (
        (p / MANIFEST_FILE).exists()
        or parse_step_dir(p) is not None
        or any(child.name.startswith("stage-") for child in p.iterdir())
    ):
        read_manifest(p)  # NotCommitted / CheckpointCorrupt with a clear message
        return ResumeChoice(p)
    run_dir = p.parent if p.name == CHECKPOINTS_DIR else p
    infos = list_checkpoints(run_dir)
    corrupt = [info for info in infos if info.corrupt is not None]
    info = latest_committed(run_dir)
    if info is None:
        damaged = "".join(f"; {c.path.name} has a corrupt manifest" for c in corrupt)
        raise CheckpointError(f"no committed checkpoint under {checkpoints_root(run_dir)}{damaged}")
    return ResumeChoice(info.path, tuple(c for c in corrupt if c.step >= info.step))


def resolve_resume(path: str | os.PathLike[str]) -> Path:
    """The committed checkpoint directory that ``path`` names.

    ``path`` is a checkpoint directory (``.../checkpoints/step-00000100``), a
    run directory or its ``checkpoints`` directory (its latest committed
    checkpoint), or the ``latest`` file. Raises `NotCommitted` for an
    uncommitted checkpoint, `CheckpointCorrupt` for a damaged manifest and
    `CheckpointError` when nothing usable is there. A newer checkpoint whose
    manifest is corrupt is passed over with a warning.
    """
    choice = find_resume(path)
    for line in choice.warnings():
        log.warning(line)
    return choice.path


# ---------------------------------------------------------------------- retention


def is_better(value: float, best: float | None, mode: str) -> bool:
    """Whether ``value`` improves on ``best`` in direction ``mode`` (NaN never does)."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value < best if mode == "min" else value > best


def best_checkpoint(
    infos: Iterable[CheckpointInfo], metric_name: str | None = None, mode: str = "min"
) -> CheckpointInfo | None:
    """The committed checkpoint with the best metric (``metric_name`` if given)."""
    best: CheckpointInfo | None = None
    for info in infos:
        if not info.committed or info.metric is None:
            continue
        if metric_name is not None and info.metric_name != metric_name:
            continue
        if is_better(info.metric, best.metric if best else None, mode):
            best = info
    return best


def plan_retention(
    infos: Sequence[CheckpointInfo],
    *,
    keep_last: int | None,
    keep_best: bool = True,
    metric_name: str | None = None,
    mode: str = "min",
    in_progress: Iterable[str | os.PathLike[str]] = (),
    latest: CheckpointInfo | None = None,
) -> list[CheckpointInfo]:
    """Which checkpoints to delete (pure; `prune` applies it).

    Kept: the ``keep_last`` most recently committed (all with None), the best
    by metric (``keep_best``), the latest committed, and everything in
    ``in_progress``. Uncommitted checkpoints are deleted only when abandoned:
    not in progress and older than the latest commit (by step and by time).
    A run's only committed checkpoint is never deleted.
    """
    busy = {Path(p).resolve() for p in in_progress}
    committed = sorted((i for i in infos if i.committed), key=lambda i: (i.time, i.step))
    if latest is None and committed:
        latest = committed[-1]
    keep: set[Path] = set()
    if keep_last is None:
        keep.update(i.path for i in committed)
    elif keep_last > 0:
        keep.update(i.path for i in committed[-keep_last:])
    if latest is not None:
        keep.add(latest.path)
    if keep_best:
        best = best_checkpoint(committed, metric_name, mode)
        if best is not None:
            keep.add(best.path)
    doomed = []
    for info in infos:
        if info.path in keep or info.path.resolve() in busy:
            continue
        if info.committed or (
            latest is not None and info.step < latest.step and info.time < latest.time
        ):
            doomed.append(info)
    return doomed


def remove_checkpoint(ckpt_dir: str | os.PathLike[str]) -> None:
    """Delete a checkpoint directory, de-committing it first.

    The manifest goes first (and the directory is fsynced), so a crash midway
    leaves an uncommitted remainder, never a committed checkpoint with files
    missing.
    """
    ckpt = Path(ckpt_dir)
    manifest = ckpt / MANIFEST_FILE
    if manifest.exists():
        manifest.unlink()
        fsync_dir(ckpt)
    shutil.rmtree(ckpt, ignore_errors=True)


def prune(
    run_dir: str | os.PathLike[str],
    *,
    keep_last: int | None,
    keep_best: bool = True,
    metric_name: str | None = None,
    mode: str = "min",
    in_progress: Iterable[str | os.PathLike[str]] = (),
) -> list[Path]:
    """Apply `plan_retention` to a run's checkpoints; returns the deleted paths."""
    infos = list_checkpoints(run_dir)
    doomed = plan_retention(
        infos,
        keep_last=keep_last,
        keep_best=keep_best,
        metric_name=metric_name,
        mode=mode,
        in_progress=in_progress,
        latest=latest_committed(run_dir),
    )
    for info in doomed:
        remove_checkpoint(info.path)
        log.debug("checkpoint pruned", path=str(info.path), committed=info.committed)
    return [info.path for info in doomed]
