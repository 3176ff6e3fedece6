"""Atomic output streams on real PySpark: the ``charon_stream`` source gives a downstream query whole atoms,
each exactly once across a SIGKILL of the consumer (with the producer running meanwhile)."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from charon.runtime.node.inprocess import InProcessRuntime

TESTS = Path(__file__).resolve().parents[1] / "support"
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent / "runtime"))  # test_streams
from streams_app import app as ledger  # noqa: E402
from test_streams import _ledger_requests  # noqa: E402

pytestmark = pytest.mark.spark


def _consumer(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "SPARK_LOCAL_IP": "127.0.0.1"}
    return subprocess.Popen([sys.executable, str(TESTS / "stream_consumer.py"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _count(sink: str, q: str) -> int:
    if not os.path.exists(sink):
        return 0
    c = sqlite3.connect(sink)
    try:
        return c.execute(q).fetchone()[0]
    except sqlite3.OperationalError:
        return 0
    finally:
        c.close()


def test_downstream_query_sees_each_atom_once_across_a_consumer_sigkill(tmp_path: Path) -> None:
    """The producer (a durable node) commits epochs of transfers, some aborting, while a Spark query
    consumes its ``credits`` stream; the query SIGKILLs itself right after its sink committed batch 2
    (Spark had not recorded it), and a restart replays batch 2 with the same atoms, which the sink skips.
    In the end the sink holds every committed event exactly once, each micro-batch whole atoms."""
    rt = InProcessRuntime(ledger, partitions=2, data_dir=str(tmp_path / "node"), fsync=False)
    rt.load("acct", {f"a{i}": 50 for i in range(6)})
    streams_db = rt.streams.path
    sink, ckpt = str(tmp_path / "sink.sqlite"), str(tmp_path / "ckpt")
    rng = random.Random(7)
    stop = threading.Event()

    def produce() -> None:
        e = 0
        while not stop.is_set() and e < 60:
            rt.run_epoch(_ledger_requests(rng, e, rng.randint(1, 6)))
            e += 1
            time.sleep(0.05)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        first = _consumer([streams_db, "credits", ckpt, sink, "1000000", "2"])
        out, err = first.communicate(timeout=240)
        assert first.returncode == -signal.SIGKILL, err[-3000:]
        assert _count(sink, "SELECT count(*) FROM batches") >= 3
    finally:
        stop.set()
        producer.join()
    total = rt.streams.end_offset("credits")
    second = _consumer([streams_db, "credits", ckpt, sink, str(total)])
    out, err = second.communicate(timeout=240)
    assert second.returncode == 0, err[-3000:]

    c = sqlite3.connect(sink)
    rows = c.execute("SELECT batch, offset, epoch, value FROM rows ORDER BY offset").fetchall()
    replays = c.execute("SELECT batch, same FROM replays").fetchall()
    c.close()
    events = rt.streams.read_range("credits", 0, total)
    assert [(o, e, v) for _, o, e, v in rows] == [(ev.offset, ev.epoch, ev.value) for ev in events]  # once each
    assert (2, 1) in replays and all(same for _, same in replays)  # batch 2 replayed with the same offsets
    batch_of_epoch: dict[int, int] = {}
    for b, _, e, _ in rows:
        assert batch_of_epoch.setdefault(e, b) == b, f"epoch {e}'s atom split over batches"
    ends = set(rt.streams.atom_ends("credits", -1))
    per_batch: dict[int, list[int]] = {}
    for b, o, _, _ in rows:
        per_batch.setdefault(b, []).append(o)
    assert all(max(os_) + 1 in ends for os_ in per_batch.values())
    assert any(len(os_) > 1 for os_ in per_batch.values()) and len(per_batch) >= 4
    rt.close()


def test_spark_producer_sigkill_keeps_each_atom_once_and_drops_aborted_events(tmp_path: Path) -> None:
    """The Spark runtime runs emitting transactions (deposits, and transfers that often abort); it is
    SIGKILLed after epoch 3's state and atom are written but before its epoch record, restarted, and runs
    the rest. Its streams then equal the in-process replay of its recorded epochs, each atom once, and
    hold exactly the committed requests' events."""
    from stream_producer import APP, config

    from charon import serde
    from charon.log.sqlite import InputLog, OutputLog
    from charon.log.streams import StreamLog
    from charon.messages import Request
    from charon.runtime.spark.cluster import ProcessTree
    from charon.runtime.spark.runtime import SparkRuntime
    from charon.testing import replay_in_process

    data = str(tmp_path / "data")
    os.makedirs(data)
    rng = random.Random(3)
    reqs = []
    for i in range(70):
        if i % 3 == 0:
            reqs.append(Request(f"d{i}", "acct", f"a{i % 4}", "credit", serde.encode([rng.randint(5, 30), f"d{i}"])))
        else:
            src, dst = rng.sample([f"a{j}" for j in range(4)], 2)
            reqs.append(Request(f"t{i}", "acct", src, "transfer", serde.encode([dst, rng.randint(1, 40), f"t{i}"])))
    log = InputLog(os.path.join(data, "input.sqlite"), 2)
    log.append_many([(r, None) for r in reqs])
    log.close()

    def run(crash_at: str | None) -> subprocess.Popen:
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
               "SPARK_LOCAL_IP": "127.0.0.1"}
        env.pop("CHARON_CRASH_AT", None)
        if crash_at:
            env["CHARON_CRASH_AT"] = crash_at
        return subprocess.Popen([sys.executable, str(TESTS / "stream_producer.py"), data], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    first = run("after_finalize:3")
    tree = ProcessTree(first)
    try:
        _, err = first.communicate(timeout=400)
    finally:
        tree.kill()
    assert first.returncode == -signal.SIGKILL, err[-3000:]
    streams = StreamLog(os.path.join(data, "streams.sqlite"))
    assert streams.last_epoch() == 3  # the atom of the epoch whose record was lost is already there
    second = run(None)
    tree = ProcessTree(second)
    try:
        out, err = second.communicate(timeout=400)
    finally:
        tree.kill()
    assert second.returncode == 0, err[-3000:]

    spark_rt = SparkRuntime(APP, config(data))
    ref, results = replay_in_process(spark_rt.app, spark_rt, {})
    replies = {r.request_id: r for _, r in OutputLog(os.path.join(data, "output.sqlite")).read_since(0, 1000)}
    assert len(replies) == 70 and any(not r.ok for r in replies.values()) and any(r.ok for r in replies.values())
    for s in ("payments", "credits"):
        want = [(r.epoch, v) for r in results for _, st, v in r.events if st == s]
        got = streams.read_range(s, 0, 10_000)
        assert [(e.epoch, e.value) for e in got] == want and [e.offset for e in got] == list(range(len(want)))
    payments = [serde.decode(e.value)["tag"] for e in streams.read_range("payments", 0, 10_000)]
    assert sorted(payments) == sorted(rid for rid, r in replies.items() if r.ok and rid.startswith("t"))
    credits = [serde.decode(e.value)[0] for e in streams.read_range("credits", 0, 10_000)]
    assert sorted(credits) == sorted(rid for rid, r in replies.items() if r.ok)
