"""Waiting for a workflow of the ``pin`` test apps (``wf_pin_v1``/``wf_pin_v2``) over a client, for the pinning tests
on the node and on Spark."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from charon.client import Client

Pred = Callable[[dict[str, Any]], Any]


def until(c: Client, wid: str, pred: Pred, what: str, timeout: float = 30.0, interval: float = 0.05,
          name: str = "pin") -> dict[str, Any]:
    """Poll workflow ``name``/``wid`` until ``pred`` holds on its record; the record (fails naming ``what``)."""
    deadline = time.monotonic() + timeout
    while True:
        rec = c.workflow(name, wid)
        if pred(rec):
            return rec
        assert time.monotonic() < deadline, f"{what}: {rec}"
        time.sleep(interval)


def at(step: str) -> Pred:
    """The workflow waits at ``step`` for what it awaits."""
    return lambda r: r["status"] == "waiting" and r["step"] == step and r["awaiting"]
