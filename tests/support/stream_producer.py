"""A Charon Spark runtime running ``streams_app`` (it emits events), as a subprocess (so it can be killed).

    python tests/support/stream_producer.py DATA_DIR

Runs every request already in DATA_DIR's input log, then stops. ``CHARON_CRASH_AT`` (see
``charon.runtime.faults.crash_point``) makes it SIGKILL itself at a named point.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from charon.config import SparkConfig  # noqa: E402
from charon.runtime.spark.runtime import SparkRuntime  # noqa: E402

APP = "streams_app:app"


def config(data_dir: str) -> SparkConfig:
    return SparkConfig(master="local[2]", data_dir=data_dir, partitions=2, max_batch=10, compact_every=3,
                       truncate_log=False, spark_conf={"spark.sql.streaming.stopTimeout": "60s"})


def main() -> int:
    rt = SparkRuntime(APP, config(sys.argv[1]))
    try:
        rt.start()
        rt.wait_idle(600)
        print(f"idle {rt.last_recorded_epoch()}", flush=True)
        rt.stop()
        return 0
    finally:
        rt.close()


if __name__ == "__main__":
    sys.exit(main())
