"""Checkpointing: the protocol across processes, and what a checkpoint is on disk.

The protocol (stages, the coordinator hook, the bus):

1. *When.* The coordinator (the ``checkpoint`` hook) sends the stages a
   `evtrain.events.CheckpointPlan` when the run starts (and again whenever it
   restarts); a one-off is a `evtrain.events.CheckpointNow`. Both are commands
   with the delivery and boundary rules of `evtrain.bus.commands`. When the
   launcher runs the coordinator, stage 0 holds boundary 0 until the plan
   arrived, so it applies from the first step.
2. *Deciding alike.* Every stage holds the same plan (`plan.PlanState`) and,
   at each boundary, the same facts: the step and, after an evaluation, the
   metric the last stage shares with all. So every stage saves at the same
   boundaries without another message: the multiples of ``every_steps``,
   each evaluation that beats the best (saved after the evaluation, so the
   shard holds the weights measured), and the last step on stop. One
   directory per boundary; several reasons share it.
3. *Saving.* Stage 0 announces each save (``CheckpointRequested``); every
   stage writes its shard in the background (`writer.ShardWriter`) and
   reports it durable (``CheckpointShardSaved``) or failed.
4. *Committing.* The coordinator's state machine (`coordinator.Coordinator`)
   commits a checkpoint once every stage's shard record is on disk: manifest,
   then ``latest``, then retention (`storage`). It publishes a verdict for
   each: ``CheckpointCommitted`` or ``CheckpointFailed`` with the reason.
5. *Closing the books.* At the end of a run without failure every shard is
   reported before the final barrier, and stage 0 waits for the verdict on
   every save of the run before it publishes ``RunEnded``.

Modules:

- `evtrain.checkpoint.storage` (torch-free): the layout of a run's
  checkpoints, shard records, the manifest and its atomic commit, retention,
  listing and resume resolution. Its public names are re-exported here.
- `evtrain.checkpoint.coordinator` (torch-free): the coordinator's state machine.
- `evtrain.checkpoint.plan` (torch-free): the stages' side of a plan.
- `evtrain.checkpoint.state_tree` (torch): a stage's state as tensors by key
  plus JSON, and the RNG states.
- `evtrain.checkpoint.writer` (torch): `ShardWriter`, which saves one stage's
  shard in the background at a step boundary.
- `evtrain.checkpoint.loader` (torch): loading shards into any number of
  stages, restricted to tensors and DCP metadata, and agreeing on what to resume.

Importing this package does not import torch, so the CLI and the hooks start fast.
"""

from evtrain.checkpoint.storage import (
    CHECKPOINTS_DIR,
    LATEST_FILE,
    MANIFEST_FILE,
    SHARD_RECORD_FILE,
    STATE_FILE,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointInfo,
    Manifest,
    NotCommitted,
    ResumeChoice,
    ShardFile,
    ShardRecord,
    StageEntry,
    TensorInfo,
    atomic_write_bytes,
    best_checkpoint,
    checkpoint_path_template,
    checkpoints_root,
    commit_checkpoint,
    commit_complete,
    committed_shard_record,
    find_resume,
    format_checkpoint_path,
    fsync_dir,
    is_better,
    is_committed,
    latest_committed,
    list_checkpoints,
    parse_step_dir,
    plan_retention,
    prune,
    read_manifest,
    read_shard_record,
    remove_checkpoint,
    resolve_resume,
    set_latest,
    sha256_file,
    shard_records,
    stage_dir,
    step_dir,
    validate_checkpoint,
    verify_shard_files,
    write_shard_record,
)

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
