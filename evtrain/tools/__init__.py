"""The tools that drive a run from outside: what the ``evtrain`` commands and Python call.

- `evtrain.tools.api`: ``launch`` and ``evaluate`` from Python (re-exported as
  ``evtrain.launch`` and ``evtrain.evaluate``), the same processes as the commands;
- `evtrain.tools.top`: ``evtrain top``, a live view of a run from its bus;
- `evtrain.tools.timeline`: ``evtrain timeline``, a run's instructions drawn from its events;
- `evtrain.tools.replay`: ``evtrain replay``, a recorded run's events published again;
- `evtrain.tools.demo`: the built-in demo job that ``evtrain demo`` launches.

The command line itself (`evtrain.cli`) parses arguments and calls these; they sit
above the control plane (`evtrain.launcher`), which runs the processes.
"""
