"""A Spark driver for the rescale crash test, run as a subprocess (so it can be SIGKILLed inside the move).

    python tests/support/spark_rescale_driver.py DATA_DIR --partitions N [--load K] [--rescale M] [--rescale-log L]

Opens ``SparkRuntime("charon.apps.holds:app")`` over DATA_DIR with N engine partitions (a checkpoint of
another count is rescaled at open), bulk-loads K accounts of 100 if asked, starts the query, waits until two
epochs ran in this process, then resizes the input log to L partitions and/or rescales to M engine partitions
while the test keeps appending to the input log (``CHARON_CRASH_AT=relayout:*`` kills it inside the move,
before its commit point; ``log_resized:*`` right after the log resize). The input log starts with 2
partitions; a restart keeps the recorded count. Then it waits for
the file ``DATA_DIR/done`` and for every appended request to have run, prints ``idle <epoch>`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from charon.config import SparkConfig
from charon.runtime.spark.runtime import SparkRuntime


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("data_dir")
    p.add_argument("--partitions", type=int, required=True)
    p.add_argument("--load", type=int, default=0)
    p.add_argument("--rescale", type=int, default=None)
    p.add_argument("--rescale-log", type=int, default=None)
    args = p.parse_args()
    t0 = time.monotonic()

    def say(what: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {what}", flush=True)

    fresh = not os.path.exists(os.path.join(args.data_dir, "checkpoint", "layout.json"))
    cfg = SparkConfig(master="local[2]", data_dir=args.data_dir, partitions=args.partitions,
                      log_partitions=2 if fresh else None,
                      max_batch=500, compact_every=3, truncate_log=False, timer_poll_ms=20)
    rt = SparkRuntime("charon.apps.holds:app", cfg)
    say(f"opened at {rt.config.partitions} partitions")
    try:
        if args.load:
            rt.load("acct", {f"k{i}": 100 for i in range(args.load)})
        rt.start()
        say("started")
        first = rt.last_recorded_epoch()
        deadline = time.monotonic() + 300
        while rt.last_recorded_epoch() < first + 2:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no epochs: {rt.health()}")
            time.sleep(0.05)
        info = rt.rescale(args.rescale, log_partitions=args.rescale_log)
        say("rescaled " + json.dumps(info))
        say("waiting for done")
        done = os.path.join(args.data_dir, "done")
        while not os.path.exists(done):
            if rt.health()["fatal"]:
                raise RuntimeError(rt.health()["fatal"])
            time.sleep(0.1)
        say("done")
        rt.wait_idle(300)
        say("idle once")
        time.sleep(1.0)  # the last holds' timers come due
        rt.wait_idle(300)
        say(f"idle {rt.last_recorded_epoch()}")
        rt.stop()
        return 0
    finally:
        rt.close()


if __name__ == "__main__":
    sys.exit(main())
