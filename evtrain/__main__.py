"""``python -m evtrain`` is the ``evtrain`` command."""

from evtrain.cli import run

run()
