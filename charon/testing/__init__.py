"""Test support: the serial-execution oracle and the seeded fault harness, importable from here.

- :mod:`charon.testing.oracle`: :func:`serial_execute`, :func:`check_epoch`, :func:`replay_in_process`,
  :class:`SerialContext`, :class:`CaughtCalleeError` (the engine's results must equal a serial execution's);
- :mod:`charon.testing.harness`: :func:`run_app` and what it takes and returns (an application's workload through
  the Spark runtime's code under seeded faults);
- :mod:`charon.testing.pytest_plugin`: the ``pytest11`` plugin (``@fault_seeds(n)``, the ``charon_harness``
  fixture);
- :mod:`charon.testing.simulation` (the seeded simulated cluster the harness runs on) and
  :mod:`charon.testing.workloads` (generated programs checked against the oracle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# re-exported (``X as X``: explicit for a user's ``mypy --strict``)
from charon.testing.oracle import CaughtCalleeError as CaughtCalleeError
from charon.testing.oracle import SerialContext as SerialContext
from charon.testing.oracle import check_epoch as check_epoch
from charon.testing.oracle import replay_in_process as replay_in_process
from charon.testing.oracle import serial_execute as serial_execute

if TYPE_CHECKING:
    # re-exported too, imported on first use by __getattr__ below
    from charon.testing.harness import Faults as Faults
    from charon.testing.harness import HarnessFailure as HarnessFailure
    from charon.testing.harness import Invocation as Invocation
    from charon.testing.harness import Report as Report
    from charon.testing.harness import Snapshot as Snapshot
    from charon.testing.harness import from_hints as from_hints
    from charon.testing.harness import invocations as invocations
    from charon.testing.harness import run_app as run_app
    from charon.testing.pytest_plugin import fault_seeds as fault_seeds

#: The fault harness's public names (:mod:`charon.testing.harness`, :mod:`charon.testing.pytest_plugin`), imported
#: on first use so that importing this package stays light: the harness loads the Spark runtime's code and
#: hypothesis (a development dependency, not the package's), and pytest imports this package for its plugin.
_HARNESS = {name: "charon.testing.harness" for name in (
    "Faults", "HarnessFailure", "Invocation", "Report", "Snapshot", "from_hints", "invocations", "run_app")}
_HARNESS["fault_seeds"] = "charon.testing.pytest_plugin"


def __getattr__(name: str) -> object:
    module = _HARNESS.get(name)
    if module is None:
        raise AttributeError(f"module 'charon.testing' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
