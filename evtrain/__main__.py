"""``python -m evtrain`` is the ``evtrain`` command."""

import sys

from evtrain.cli import main

sys.exit(main())
