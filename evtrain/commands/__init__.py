"""Subcommands of the ``evtrain`` CLI, one module each (see `evtrain.cli`)."""
