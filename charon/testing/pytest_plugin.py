"""The fault harness in pytest (registered as a ``pytest11`` plugin): ``@fault_seeds(n)`` and ``charon_harness``.

::

    from charon.testing import fault_seeds

    @fault_seeds(20)
    def test_wallets(charon_harness):
        charon_harness.run(wallets.app, wallets.payments, [wallets.credited_once])

``fault_seeds(n)`` runs the test once per seed (``CHARON_HARNESS_SEEDS`` overrides ``n``;
``CHARON_HARNESS_SEED`` runs that one seed). ``charon_harness.run`` is :func:`charon.testing.harness.run_app` with the
test's seed, and a failure's reproduction line is the pytest command that reruns that seed.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from charon.operator import Application
    from charon.testing.harness import Faults, Invariant, Report, WorkloadSource

SEED_ENV = "CHARON_HARNESS_SEED"
SEEDS_ENV = "CHARON_HARNESS_SEEDS"


def fault_seeds(n: int, start: int = 0) -> pytest.MarkDecorator:
    """Parametrize a test over seeds ``start .. start+n-1`` as ``charon_seed`` (see the module docstring)."""
    one = os.environ.get(SEED_ENV)
    if one is not None:
        seeds = [int(one)]
    else:
        seeds = list(range(start, start + int(os.environ.get(SEEDS_ENV, n))))
    return pytest.mark.parametrize("charon_seed", seeds, ids=[str(s) for s in seeds])


class HarnessRunner:
    """``charon_harness``: runs :func:`charon.testing.harness.run_app` with this test's seed and reproduction line."""

    def __init__(self, nodeid: str, seed: int) -> None:
        self.nodeid, self.seed = nodeid, seed

    def reproduction(self, seed: int) -> str:
        return f"{SEED_ENV}={seed} python -m pytest {shlex.quote(self.nodeid)}"

    def run(self, app: Application | str, workload: WorkloadSource | None = None,
            invariants: Sequence[Invariant] = (), *, seed: int | None = None, steps: int | None = None,
            keys: Sequence[str] = ("k0", "k1", "k2", "k3"), initial: Mapping[tuple[str, str], object] | None = None,
            faults: Faults | None = None, rescale: bool | None = None, partition_rescale: bool | None = None,
            ) -> Report:
        """:func:`charon.testing.harness.run_app` with this test's seed (or ``seed``); a failure's line reruns this
        test."""
        __tracebackhide__ = True
        from charon.testing.harness import STEPS, run_app

        s = self.seed if seed is None else seed
        return run_app(app, workload, invariants, seed=s, steps=STEPS if steps is None else steps, keys=keys,
                       initial=initial, faults=faults, rescale=rescale, partition_rescale=partition_rescale,
                       reproduce=self.reproduction(s))


@pytest.fixture
def charon_seed() -> int:
    """The test's seed: ``@fault_seeds`` parametrizes it; without it, ``CHARON_HARNESS_SEED`` or 0."""
    return int(os.environ.get(SEED_ENV, "0"))


@pytest.fixture
def charon_harness(request: pytest.FixtureRequest, charon_seed: int) -> HarnessRunner:
    """The fault harness bound to this test and its seed (``charon_seed``)."""
    return HarnessRunner(request.node.nodeid, charon_seed)
