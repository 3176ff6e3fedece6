"""What one page of the state browser costs against a read of max_scan entities, from the live stores
(in-process) and from the durable copy (Spark, an earlier in-process epoch): 100,000 entities in 4 partitions.

    .venv/bin/python benchmarks/state/state_pages.py
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable

from charon import serde
from charon.core.routing import partition_of, store_key
from charon.runtime.control.reads import read_durable, read_stores
from charon.state.durable import DurableState
from charon.state.store import MemoryStore

N, P, OP = 100_000, 4, "account"


def best_ms(f: Callable[[], object], n: int = 10) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def main() -> None:
    stores = [MemoryStore() for _ in range(P)]
    deltas: list[dict[bytes, bytes | None]] = [{} for _ in range(P)]
    for i in range(N):
        deltas[partition_of(OP, f"a{i}", P)][store_key(OP, f"a{i}")] = serde.encode(i)
    for s, d in zip(stores, deltas, strict=True):
        s.commit(0, d)
    page = best_ms(lambda: read_stores(stores, OP, None, 101, "a50000"))
    full = best_ms(lambda: read_stores(stores, OP, None, 10_001))
    print(f"live:    a page of 100 after a50000 {page:7.2f} ms, 10,000 entities {full:7.2f} ms")
    with tempfile.TemporaryDirectory() as root:
        d = DurableState(root, fsync=False)
        for pid in range(P):
            d.write_base(pid, 0, sorted((k, v) for k, v in deltas[pid].items() if v is not None))
        page = best_ms(lambda: read_durable(d, P, OP, 0, None, 101, "a50000"))
        full = best_ms(lambda: read_durable(d, P, OP, 0, None, 10_001))
        print(f"durable: a page of 100 after a50000 {page:7.2f} ms, 10,000 entities {full:7.2f} ms")


if __name__ == "__main__":
    main()
