"""The launcher behind ``evtrain launch``: broker, supervised hooks, elastic stage workers.

One `Launcher` (`evtrain.launcher.launcher`) runs one job on this node:

1. It loads and validates the spec with its overrides, every hook the spec
   names, and the ``--resume`` / ``--load-weights`` paths (resolved to one
   committed checkpoint or weights file) *before* starting anything, so a
   mistake is one line and exit status 2 (`evtrain.launcher.options`,
   `evtrain.launcher.plan`). It picks a run id, takes the run directory over
   (`evtrain.launcher.run_dir`) and writes ``run.json`` there
   (`evtrain.launcher.run_record`: run id, spec, overrides, bus address; completed
   with the outcome at the end).
2. It starts the broker in threads of its own process, or joins one that
   already runs, and prints the bus address (`evtrain.launcher.bus`, which
   also holds the CURVE keys of a secured bus).
3. It starts the spec's hooks as supervised processes and waits until each
   has attached (`evtrain.launcher.hooks`).
4. It starts the stage workers through torch.distributed.elastic, run by a
   child process (`evtrain.launcher.agent`, which also says how a run spans
   several machines), and follows the run: progress line
   (`evtrain.launcher.progress`) from the bus; the truth about every stage, failures
   and their root cause from files that do not depend on the bus, and a bus
   that was lost (`evtrain.launcher.watch`); a run that hangs
   (`evtrain.launcher.hang`); signals and the phases of a stop
   (`evtrain.launcher.stop`).
5. At the end hooks get time to finish (they exit on `RunEnded`), then it
   prints a summary and returns the exit status (`evtrain.launcher.report`).

Evaluation only (``LaunchOptions.evaluate``: ``evtrain eval``,
`evtrain.tools.api.evaluate`) is the same launch for another purpose
(`evtrain.launcher.plan.Evaluation`): no hook, the stages evaluate the
committed checkpoint once, and its result is printed and written as JSON.

Exit status: 0 when the run completed or was stopped cleanly (by a hook's
stop command, or by SIGTERM/Ctrl-C when the stages ended the run at a step
boundary); 1 when a stage failed; 2 for a usage mistake (nothing started);
3 when the training completed or stopped cleanly but the bus was lost on the
way; 4 when the run hung (`evtrain.launcher.hang`); 128 + N when signal N
arrived before the stages could stop cleanly.
"""

from evtrain.launcher.launcher import Launcher
from evtrain.launcher.options import (
    EXIT_BUS_LOST,
    EXIT_FAILED,
    EXIT_HUNG,
    EXIT_OK,
    RESUME_AUTO,
    RESUME_LATEST,
    LaunchOptions,
    new_run_id,
    route_address,
)
from evtrain.launcher.plan import LaunchPlan, check_monitored_metric, make_plan
from evtrain.launcher.watch import FAILED_WORKERS_GRACE_S

__all__ = [
    "EXIT_BUS_LOST",
    "EXIT_FAILED",
    "EXIT_HUNG",
    "EXIT_OK",
    "FAILED_WORKERS_GRACE_S",
    "RESUME_AUTO",
    "RESUME_LATEST",
    "LaunchOptions",
    "LaunchPlan",
    "Launcher",
    "check_monitored_metric",
    "make_plan",
    "new_run_id",
    "route_address",
]
