"""The default demo as a spec file: an MLP on scikit-learn's handwritten digits, 2 stages.

Run it with ``evtrain launch examples/demo.py`` — the same as ``evtrain demo``
or ``evtrain launch`` without a spec. Overrides work as for any spec, e.g.
``evtrain launch examples/demo.py --steps 100 --run-dir /tmp/digits``.

Everything lives in `evtrain.tools.demo` (so the demo also works from an installed
package, without this repository); to start your own job from it, copy that
file. A spec only has to define ``job`` or ``make_job()``: this one re-exports
the demo's ``make_job``.
"""

from __future__ import annotations

from evtrain.tools.demo import make_job

__all__ = ["make_job"]
