"""The stage worker entrypoint: what `torch.distributed.elastic` starts once per stage.

The contract with the launcher (``evtrain launch``) is two names:

* `WorkerConfig` — everything a worker needs besides the environment,
  JSON-encoded into one string (`WorkerConfig.encode`) so it passes through
  ``elastic_launch(config, worker_main)(cfg.encode())`` without pickling any
  object of ours.
* `worker_main(config_json)` — module-level, so elastic can import it in the
  child process. It reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR`` and ``MASTER_PORT`` from the environment as torchrun /
  elastic set them; rank r runs pipeline stage r (world size == stages P; no
  data parallelism yet).

`worker_main` returns None when the run completed or was stopped (StopRun,
SIGTERM/SIGINT) and raises when the stage failed, after publishing
`StageFailed` — so elastic sees a non-zero exit and tears the others down.

Fast exit: tearing down an interpreter that imported torch (and, through the
optimizers, torch._dynamo) takes 1-3 s on a small machine. When a worker
started by elastic (``TORCHELASTIC_RUN_ID`` set) ended cleanly, it ends its
process with ``os._exit(0)`` at interpreter exit instead — after elastic
collected its return value and after every bus message was flushed.
"""

from __future__ import annotations

import atexit
import os
import sys

import msgspec

__all__ = ["WorkerConfig", "worker_main"]


class WorkerConfig(msgspec.Struct, kw_only=True):
    """What the launcher tells every stage worker (the same for all ranks)."""

    spec_path: str
    """The job spec file; every worker loads it itself (`evtrain.spec.load_job`)."""

    overrides: dict[str, str] = {}
    """Command-line overrides as strings (`evtrain.spec.apply_overrides`)."""

    bus: str | None = None
    """Bus address (``ipc:///dir`` or ``tcp://host:port``); None publishes no events
    and receives no commands."""

    run_id: str
    """Stamped on every event."""

    device: str | None = None
    """Overrides the spec's ``device`` (``"cpu"`` / ``"cuda"``) when set."""

    resume: str | None = None
    """Checkpoint to resume: a checkpoint directory, a run directory (its latest
    committed checkpoint) or ``"latest"`` (the job's run directory). Rank 0 resolves
    it and all stages load the same one (`evtrain.stages.checkpoint.agree_on_resume`)."""

    load_weights: str | None = None
    """Load model weights only (a committed checkpoint or a safetensors file) and
    start at step 0 with a fresh optimizer; ignored when ``resume`` is set."""

    dump_weights_dir: str | None = None
    """A testing/export aid: at the end of the run each stage writes its parameters
    (keys of the unsplit model, ``"3.weight"``) to ``DIR/stage-{r}.safetensors``."""

    def encode(self) -> str:
        """The JSON string `worker_main` takes."""
        return msgspec.json.encode(self).decode()

    @classmethod
    def decode(cls, text: str | bytes) -> WorkerConfig:
        """Inverse of `encode`."""
        return msgspec.json.decode(text, type=cls)


def worker_main(config_json: str) -> None:
    """Run one pipeline stage to the end; the elastic entrypoint (see module docstring)."""
    from evtrain.stages.actor import run_worker

    run_worker(WorkerConfig.decode(config_json))
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        atexit.register(_fast_exit)


def _fast_exit() -> None:
    # atexit runs handlers last-in first-out: this one runs first, once
    # elastic's wrapper has handed over the return value and returned.
    import zmq

    # Our sockets are closed (with linger); term() waits until their last
    # messages are sent.
    zmq.Context.instance().term()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
