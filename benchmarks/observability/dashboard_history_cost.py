"""The dashboard history's cost: CPU per observed reply, CPU per one-second tick with a full 10,000-reply window
(the worst case, at >= 10k replies/s), and the bytes one sample takes.

Run: ``.venv/bin/python benchmarks/observability/dashboard_history_cost.py``"""

from __future__ import annotations

import time

from charon import InProcessRuntime
from charon.apps import ycsb
from charon.messages import Reply
from charon.runtime.contract import as_engine
from charon.server.metrics import GatewayMetrics


def main() -> None:
    rt = InProcessRuntime(ycsb.app, partitions=4)
    m = GatewayMetrics(as_engine(rt))
    replies = [Reply(f"r{i}", i, 1, i % 5 != 0, error_type="" if i % 5 else f"E{i % 3}") for i in range(10_000)]
    t0 = time.process_time()
    for r in replies:
        m.observe_reply(r, 0.001)
    per_reply = (time.process_time() - t0) / len(replies)
    ticks = []
    for _ in range(20):
        for r in replies[:2000]:
            m.observe_reply(r, 0.001)
        t0 = time.process_time()
        m.tick(0, now=time.time() + 0.0001)
        ticks.append(time.process_time() - t0)
    ticks.sort()
    print(f"observe_reply {per_reply * 1e6:.2f} us CPU; tick (2,000 new replies) median "
          f"{ticks[len(ticks) // 2] * 1e3:.2f} ms CPU, max {ticks[-1] * 1e3:.2f} ms; "
          f"bytes per sample ~{m.history.bytes // len(m.history)}")
    rt.close()


if __name__ == "__main__":
    main()
