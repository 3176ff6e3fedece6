"""A Spark driver for the compatible-update crash test, run as a subprocess (it SIGKILLs itself).

    python tests/support/code_update_driver.py DATA_DIR REQUESTS_JSON

It loads the ``acct`` accounts, appends the requests (one contended batch: epoch 0), lets epoch 0 run
(``pause(after_epoch=0)``), makes a compatible update to ``code_versions:c2`` at the boundary after it,
prints the outcome as JSON and resumes; ``CHARON_CRASH_AT=before_epoch:1`` then kills it as epoch 1 starts, after the
update was recorded and before any transaction ran on the new code.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from charon import serde
from charon.config import SparkConfig
from charon.messages import Request
from charon.runtime.spark.runtime import SparkRuntime

KEYS = [f"a{i}" for i in range(6)]


def config(data_dir: str) -> SparkConfig:
    return SparkConfig(master="local[2]", data_dir=data_dir, partitions=2, log_partitions=1, max_batch=1000,
                       idle_wait_ms=50)


def main(data_dir: str, requests_json: str) -> int:
    rt = SparkRuntime("code_versions:c1", config(data_dir))
    rt.load("acct", {k: 100 for k in KEYS})
    with open(requests_json) as f:
        reqs = [Request(rid, "acct", key, fn, serde.encode(args), float(i))
                for i, (rid, key, fn, args) in enumerate(json.load(f))]
    rt.input_log.append_many(reqs)
    rt.pause(after_epoch=0)
    rt.start()
    deadline = time.monotonic() + 300
    while not (rt.last_recorded_epoch() >= 0 and rt.control_status()["state"] == "paused"):
        if time.monotonic() > deadline:
            raise TimeoutError("epoch 0 did not run")
        time.sleep(0.05)
    out = asyncio.run(rt.update_code("code_versions:c2", "c2", mode="compatible"))
    print(json.dumps(out), flush=True)
    rt.resume()  # the update kept the pause (after epoch 0): epoch 1 starts now
    time.sleep(120)  # CHARON_CRASH_AT kills this process as epoch 1 starts
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
