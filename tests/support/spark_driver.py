"""A Charon Spark driver for the fault and cluster tests, run as a subprocess (so it can be SIGKILLed).

    python tests/support/spark_driver.py DATA_DIR [--load N] [--master URL] [--partitions 4] [--max-batch 100]
                                 [--compact-every 3] [--conf k=v ...] [--idle-timeout S] [--exchange resident|jobs]
                                 [--status-file PATH]

``--load N`` bulk-loads N YCSB accounts (``SparkRuntime.load``) and exits, or with ``--run`` waits for the
file ``DATA_DIR/go`` (the test records the initial snapshot meanwhile) and goes on. Then the driver starts
``SparkRuntime("charon.apps.ycsb:app")`` over DATA_DIR and runs epochs until the file ``DATA_DIR/done``
exists (the test writes it after its last append) and every request appended by then has run; then it
stops the query and exits 0. ``CHARON_CRASH_AT`` (see ``charon.runtime.faults.crash_point``) makes it
SIGKILL itself at a named point. It prints ``started`` once the query runs and ``idle <last epoch>`` at
the end. ``--status-file`` has it write ``SparkRuntime.health()`` there as JSON (atomically) every 0.2 s while it
runs (the resident gang's placement is in it: ``gang``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from charon.config import SparkConfig
from charon.messages import Request
from charon.runtime.spark.runtime import SparkRuntime

APP = "charon.apps.ycsb:app"


def config(args: argparse.Namespace) -> SparkConfig:
    conf = dict(kv.split("=", 1) for kv in args.conf)
    conf.setdefault("spark.sql.streaming.stopTimeout", "60s")
    return SparkConfig(
        master=args.master, data_dir=args.data_dir, partitions=args.partitions, max_batch=args.max_batch,
        compact_every=args.compact_every, truncate_log=False, spark_conf=conf,
        exchange=getattr(args, "exchange", None) or "resident",
        # a NATS log and object storage when the environment names them (as charon run reads them)
        log_url=os.environ.get("CHARON_LOG_URL") or None, storage_url=os.environ.get("CHARON_STORAGE_URL") or None,
        **({} if getattr(args, "restart_batch", None) is None else {"restart_batch": args.restart_batch}),
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("data_dir")
    p.add_argument("--load", type=int, default=0)
    p.add_argument("--balance", type=int, default=100)
    p.add_argument("--run", action="store_true", help="with --load: then wait for DATA_DIR/go and run")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--max-batch", type=int, default=100)
    p.add_argument("--restart-batch", type=int, default=None)  # SparkConfig.restart_batch (default: its default)
    p.add_argument("--compact-every", type=int, default=3)
    p.add_argument("--conf", action="append", default=[])
    p.add_argument("--idle-timeout", type=float, default=600.0)
    p.add_argument("--exchange", default="resident", choices=("resident", "jobs"))
    p.add_argument("--status-file", default=None)
    args = p.parse_args()
    rt = SparkRuntime(APP, config(args))
    try:
        if args.load:
            from charon.apps import ycsb

            n = rt.load("account", ycsb.initial_state(args.load, balance=args.balance))
            print(f"loaded {n}", flush=True)
            if not args.run:
                return 0
            go = os.path.join(args.data_dir, "go")
            while not os.path.exists(go):  # the test takes its initial snapshot meanwhile
                time.sleep(0.1)
        rt.start()
        print("started", flush=True)
        done = os.path.join(args.data_dir, "done")
        while not os.path.exists(done):
            h = rt.health()
            if args.status_file:
                write_status(args.status_file, h)
            if h["fatal"]:  # the supervisor restarts a failed query; it gives up only on a repeating failure
                raise RuntimeError(f"the runtime gave up: {h['fatal']}")
            time.sleep(0.2)
        rt.wait_idle(args.idle_timeout)
        print(f"idle {rt.last_recorded_epoch()}", flush=True)
        rt.stop()
        return 0
    finally:
        rt.close()


def write_status(path: str, health: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(health, f, default=str)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())


# -- the tests' side: run this script as a subprocess, kill it, check the outcome ------------------------------
# (imported by tests/faults/test_spark_recovery.py and tests/spark/test_spark_cluster.py; not used by the driver itself)
def make_config(
    data_dir: str, *, master: str = "local[2]", partitions: int = 4, max_batch: int = 100, compact_every: int = 3,
    exchange: str = "resident",
) -> SparkConfig:
    """The configuration the driver builds from the same options (for snapshots and checks in the test)."""
    return config(argparse.Namespace(master=master, data_dir=data_dir, partitions=partitions, max_batch=max_batch,
                                     compact_every=compact_every, conf=[], exchange=exchange))


def driver_args(
    *, master: str = "local[2]", partitions: int = 4, max_batch: int = 100, compact_every: int = 3,
    conf: dict[str, str] | None = None, restart_batch: int | None = None, exchange: str = "resident",
    status_file: str | None = None,
) -> list[str]:
    out = ["--master", master, "--partitions", str(partitions), "--max-batch", str(max_batch),
           "--compact-every", str(compact_every), "--exchange", exchange]
    if status_file is not None:
        out += ["--status-file", status_file]
    if restart_batch is not None:
        out += ["--restart-batch", str(restart_batch)]
    for k, v in (conf or {}).items():
        out += ["--conf", f"{k}={v}"]
    return out


class Driver:
    """``spark_driver.py`` in its own session; its process tree is tracked so that a kill reaches everything."""

    def __init__(self, data_dir: str, args: list[str], log_path: str, *, crash_at: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        import subprocess

        from charon.runtime.spark.cluster import ProcessTree

        e = dict(os.environ)
        e.pop("CHARON_CRASH_AT", None)
        if crash_at:
            e["CHARON_CRASH_AT"] = crash_at
        e.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1",
                 PYTHONUNBUFFERED="1")
        e.update(env or {})
        self.log_path = log_path
        self.crash_at = crash_at
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), data_dir, *args], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, env=e, start_new_session=True,
            )
        self.tree = ProcessTree(self.proc)

    def output(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def tail(self, n: int = 6000) -> str:
        return f"--- driver log {self.log_path} (crash_at={self.crash_at}) ---\n{self.output()[-n:]}"

    def wait_until(self, cond: Any, timeout: float, what: str) -> None:
        """Poll ``cond`` (recording the process tree meanwhile); fail if the driver exits first or time runs out."""
        deadline = time.monotonic() + timeout
        while not cond():
            self.tree.scan()
            if self.proc.poll() is not None:
                raise AssertionError(f"driver exited ({self.proc.returncode}) before {what}\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{self.tail()}")
            time.sleep(0.1)

    def wait(self, timeout: float) -> int:
        """Wait for the driver to exit; returns its exit code (negative: killed by that signal)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            self.tree.scan()
            if time.monotonic() > deadline:
                raise AssertionError(f"driver still running after {timeout} s\n{self.tail()}")
            time.sleep(0.1)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the driver, its JVM and Python workers, and wait until they are all gone."""
        if not self.tree.kill(timeout=30):
            raise AssertionError(f"processes of the driver survive SIGKILL: {self.tree._alive()}")


def epoch_records(data_dir: str) -> list[int]:
    d = os.path.join(make_config(data_dir).checkpoint_dir, "epochs")
    try:
        return sorted(int(n.split(".")[0]) for n in os.listdir(d) if n.endswith(".msgpack"))
    except FileNotFoundError:
        return []


def last_epoch(data_dir: str) -> int:
    recs = epoch_records(data_dir)
    return recs[-1] if recs else -1


def transfers(n_accounts: int, count: int, seed: int) -> list[Request]:
    """YCSB-T transfers (Zipf 0.99 creditors) as requests with ids ``t0, t1, ...``."""
    from charon import serde
    from charon.apps import ycsb

    return [Request(f"t{i}", op, k, f, serde.encode(a))
            for i, (op, k, f, a) in enumerate(ycsb.workload(n_accounts, count, zipf=0.99, seed=seed, max_amount=30))]


def check_result(data_dir: str, initial: dict[bytes, bytes], appended: list[Request], total_balance: int,
                 **cfg: Any) -> SparkRuntime:
    """The Spark run's state and replies equal the in-process runtime's over the recorded epochs; exactly one
    reply per request; the total balance is conserved. Returns the (never started) runtime it read."""
    from charon import serde
    from charon.apps import ycsb
    from charon.testing import replay_in_process

    rt = SparkRuntime(APP, make_config(data_dir, **cfg))  # snapshot() and replies() need no SparkSession
    snap = rt.snapshot()
    values = {k: serde.decode(v) for k, v in snap.items()}
    assert len(values) == len({k for k in initial}), "accounts appeared or vanished"
    assert sum(values.values()) == total_balance, "the total balance is not conserved"

    ids = [r.request_id for r in appended]
    replies = rt.replies()
    assert rt.output_log.count() == len(replies) == len(appended), (rt.output_log.count(), len(appended))
    assert len({r.request_id for r in replies}) == len(replies), "a request has two replies"
    assert {r.request_id for r in replies} == set(ids), "replies do not match the requests"

    ran = [r.request_id for e in range(rt.last_recorded_epoch() + 1) for _, r in rt.epoch_requests(e)]
    assert sorted(ran) == sorted(ids), "the recorded epochs do not cover every request exactly once"

    ip, results = replay_in_process(ycsb.app, rt, initial)
    assert ip.snapshot() == snap, "the Spark state differs from the in-process runtime's"
    expected = {r.request_id: r for res in results for r in res.replies.values()}
    assert len(expected) == len(appended)
    diff = [r.request_id for r in replies if expected[r.request_id] != r]
    assert not diff, f"{len(diff)} replies differ from the in-process runtime's, e.g. {diff[:5]}"
    return rt
