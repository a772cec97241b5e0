"""What the launcher itself tells the bus of a run's end: one `RunEnded`, once.

The stages publish the run's end when they can. When they cannot (a stage
failed, the run hung, the workers were killed) the launcher publishes it,
so that the hooks finish: `RunEnding` holds the launcher's publisher and the
event it published, which the failure and hang responses
(`evtrain.launcher.watch`, `evtrain.launcher.hang`) and the report read.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from evtrain.bus.publisher import Publisher
from evtrain.events import Event, RunEnded, StageFailed
from evtrain.launcher.hook_supervisor import HookSupervisor

__all__ = ["RunEnding"]


class RunEnding:
    """The launcher's publisher, and the `RunEnded` it published (None: none yet)."""

    def __init__(self, bus_down: Callable[[], bool]) -> None:
        self.publisher: Publisher | None = None
        self.supervisor: HookSupervisor | None = None
        """Told that the run ended, so that it restarts no hook from then on."""
        self.published: RunEnded | None = None
        self.published_at = 0.0
        self._bus_down = bus_down

    @property
    def failed(self) -> bool:
        return self.published is not None and self.published.status == "failed"

    def send(self, event: Event) -> None:
        """Publish ``event`` from the launcher, unless the bus is lost."""
        if self.publisher is not None and not self._bus_down():
            self.publisher.publish(event)

    def publish(self, event: RunEnded, *, on_bus: StageFailed | None = None) -> None:
        """The run ended with ``event``: published (or ``on_bus`` instead) and remembered."""
        self.send(event if on_bus is None else on_bus)
        self.published = event
        self.published_at = time.monotonic()
        if self.supervisor is not None:
            self.supervisor.mark_run_ended()
