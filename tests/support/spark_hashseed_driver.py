"""A Spark driver for test_spark_hashseed.py, run as a subprocess with the PYTHONHASHSEED the test chooses (the
driver's own seed): runs the repros' ``setiter`` (a function iterating a set of strings, calling per name) on
Spark with 4 partitions on ``local[2]``, and collects ``hash("x")`` from 8 Python tasks.

    python tests/support/spark_hashseed_driver.py DATA_DIR       prints one JSON line {"hashes", "replies"}
"""

from __future__ import annotations

import json
import os
import sys

from charon import serde
from charon.config import SparkConfig
from charon.messages import Request
from charon.runtime.spark.runtime import SparkRuntime

NAMES = [f"name-{i}" for i in range(12)]


def main() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "repros"))
    cfg = SparkConfig(master="local[2]", data_dir=sys.argv[1], partitions=4, truncate_log=False)
    rt = SparkRuntime("mistakes_app:app", cfg)
    try:
        sc = rt.spark.sparkContext
        hashes = sc.parallelize(range(8), 8).mapPartitions(lambda _: [hash("x")]).collect()
        rt.input_log.append_many([Request(f"s{i}", "acc", f"k{i}", "setiter", serde.encode([NAMES]))
                                  for i in range(4)])
        rt.start()
        rt.wait_idle(300)
        replies = {r.request_id: serde.decode(r.value) for r in rt.replies() if r.ok}
    finally:
        rt.stop()
        rt.spark.stop()
    print(json.dumps({"hashes": hashes, "replies": replies}))


if __name__ == "__main__":
    main()
