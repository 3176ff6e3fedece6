"""Runtimes running epochs at the same time in different threads of one process (e.g. two applications, or
tests) each equal the serial oracle: the process-wide live-coroutine table must not let one thread close or
resume the coroutines another thread's round is using ("cannot reuse already awaited coroutine")."""

from __future__ import annotations

import random
import sys
import threading
import traceback

from review3_app import app

from charon import InProcessRuntime, Request, serde
from charon.testing import check_epoch


def _worker(seed: int, errors: list[str]) -> None:
    try:
        rng = random.Random(seed)
        rt = InProcessRuntime(app, partitions=2)
        for e in range(25 + 7 * seed):  # different epoch numbers at the same time in the threads
            reqs = []
            for i in range(30):
                inner = [["put", 2], ["call", "a", f"r-{rng.randrange(3)}", [["get"]]]]
                plan = [["put", 1], ["call", "b", f"r-{rng.randrange(3)}", inner], ["get"]]
                reqs.append(Request(f"{seed}-{e}-{i}", "a", f"r-{rng.randrange(3)}", "node", serde.encode([plan])))
            before = rt.snapshot()
            result = rt.run_epoch(reqs)
            check_epoch(app, before, rt.snapshot(), result)
    except Exception:  # noqa: BLE001 - reported by the test
        errors.append(traceback.format_exc())


def test_runtimes_in_threads_equal_the_oracle():
    errors: list[str] = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: rounds of the runtimes interleave
    try:
        threads = [threading.Thread(target=_worker, args=(s, errors)) for s in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == [], errors[0][-2000:]
