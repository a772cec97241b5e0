"""The elastic entrypoint of a stage worker, apart from the stage runtime it starts."""

from __future__ import annotations

from evtrain.stages.worker import WorkerConfig

__all__ = ["worker_main"]


def worker_main(config_json: str) -> None:
    """Run one pipeline stage to the end: the elastic entrypoint.

    Module-level in this torch-free module, so that the agent can name it to
    elastic (which pickles it by name) without importing the stage runtime:
    the fork server the workers are forked from has that preloaded
    (`evtrain.launcher.forking`).
    """
    # lazy: the stage runtime imports torch; the agent only names this function.
    from evtrain.stages.actor import serve

    serve(WorkerConfig.decode(config_json))
