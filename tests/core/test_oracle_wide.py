"""Widened oracle checks: generated programs (charon.testing.workloads) on the in-process runtime, every epoch
against the serial oracle, and across epochs every request accounted for exactly once, the replies
delivered through the runtime equal to the epochs' results, the final state equal to serial execution.

Placement varies per example: 1/2/4 partitions, live coroutines on/off. The explicit cases below are the
defects the generator found on the code it was written against (each names its defect); they fail until
that defect is fixed.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings

from charon.testing.workloads import (
    CI,
    FEATURES,
    Shape,
    Workload,
    check_inprocess,
    oracle_aborts_caught_callee,
    workloads,
)

EXAMPLES = int(os.environ.get("CHARON_ORACLE_EXAMPLES", "1000"))
WITHOUT = frozenset(x for x in os.environ.get("CHARON_WORKLOAD_WITHOUT", "").split(",") if x)  # local bisecting


@pytest.mark.slow  # ~30 s: 1,000 generated workloads
@settings(CI, max_examples=EXAMPLES)
@given(workloads(Shape(features=FEATURES - WITHOUT)))
def test_generated_workloads_equal_serial_execution(w: Workload) -> None:
    check_inprocess(w)


def _w(epochs: list, partitions: int = 1, live: bool = True, initial: dict | None = None) -> Workload:
    return Workload(initial or {}, {}, [[(k, 0, prog, 1.0) for k, prog in ep] for ep in epochs], partitions, live)


FOUND = {
    # r1: a fast-fallback replay writes what its dry run only read; the write leaks to a higher TID's reply
    "r1-fast-layer-leak": _w([[("e", [["put", 5]]), ("e", [["call", "b", []], ["get"], ["put_if", 1, 4]]),
                               ("e", [["get"]])]], partitions=2),
    # r2: code between creating a call and awaiting it re-runs on journal replay (a write, a read)
    "r2-early-call-replay": _w([[("a", [["early", "a", [], [["get"], ["put", 1]]]])]], live=False),
    # r2 (send twice): a send between creating and awaiting a call is sent again on replay
    "r2-early-call-send": _w([[("a", [["early", "b", [], [["send", "c", [["add", "c0", 1]]]]]])]], live=False),
    # r2, calls awaited in another order than created: the fast fallback's journal replay swaps the replies
    "r2-awaited-out-of-order": _w([[("a", [["put", 0], ["early2", "a", [], "a", [], [], 0]]),
                                    ("a", [["scan_all"], ["early2", "b", [["get"]], "c", [], [], 1]])]]),
    # the oracle numbered a call when awaited, the engine when created: ctx.random() differed in the callee
    "oracle-call-numbering": _w([[("a", [["early", "b", [["rand", 0.5, [["get"]], []]], [["send", "c", []]]]])]]),
    # r5: a caller catching its callee's exception; the engine aborts the transaction (any raise aborts)
    "r5-caught-callee": _w([[("a", [["try", "b", [["raise_if", -1]]], ["put", 3]])]]),
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_found_cases(name: str) -> None:
    for parts in (1, 2, 4):
        for live in (True, False):
            w = FOUND[name]
            check_inprocess(Workload(w.initial, w.items, w.epochs, parts, live))


def test_r5_the_oracle_itself_models_the_abort_rule() -> None:
    """r5: charon.testing's oracle aborts a transaction whose caller caught its callee's exception, as the
    engine does (the checks above model the rule themselves until then: charon.testing.workloads.engine_abort_rule)."""
    assert oracle_aborts_caught_callee()
