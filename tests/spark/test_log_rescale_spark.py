"""Changing the input log's partition count of a running Spark deployment (:meth:`SparkRuntime.rescale_log`).

* On real PySpark, SQLite and NATS logs: clients call through the real gateway over HTTP with idempotency keys
  while the log goes 2 -> 4 -> 3 partitions (and the engine 2 -> 3 in the same call as the second switch):
  every request answered once, money conserved, the TIDs assigned by each epoch exceed every earlier one
  (also across the growth), the run equals an in-process replay of its epochs, and the switch needs no pause.
* Without Spark, a driver SIGKILLed on either side of the log switch restarts at the recorded count.
* On real PySpark, a driver SIGKILLed right after a log resize while requests keep being appended (some to the
  new partitions): the restart reads every partition, resizes online again, and nothing is lost or run twice.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest
from natsfix import NatsServer
from test_rescale_spark import KEYS, TOKEN, _client, _epochs_pass, _Load, _money, _run, _state_dirs

from charon import serde
from charon.apps import holds
from charon.config import SparkConfig
from charon.core.routing import store_key
from charon.core.sequencer import Sequencer
from charon.runtime.spark.layout import read_layout
from charon.runtime.spark.runtime import SparkRuntime
from charon.testing import replay_in_process

APP = "charon.apps.holds:app"


def _tid_bounds(rt: SparkRuntime) -> dict[int, tuple[int, int]]:
    """epoch -> [lowest, highest] TID it may assign to the requests it read: from the previous epoch's recorded
    counters grown to this epoch's log-partition count, to its own recorded counters."""
    out = {}
    prev = None
    for e in range(rt.last_recorded_epoch() + 1):
        rec = rt.read_record(e)
        seq = Sequencer.restore(prev.counters) if prev is not None else Sequencer(len(rec.ends))
        seq.resize(len(rec.ends))
        out[e] = (seq.first_tid(), Sequencer.restore(rec.counters).first_tid() - 1)
        prev = rec
    return out


def _check_tids(rt: SparkRuntime, replies: dict[str, tuple[str, dict]]) -> int:
    """Every request's TID lies in the range of the epoch that read it, and the ranges increase; returns how many
    epochs read more than two log partitions."""
    bounds = _tid_bounds(rt)
    tids = {rid: body["tid"] for rid, (_, body) in replies.items()}
    assert len(set(tids.values())) == len(tids), "TIDs are unique"
    wide = 0
    hi = 0
    for e in sorted(bounds):
        lo, top = bounds[e]
        assert lo > hi, f"epoch {e} may assign TIDs below an earlier epoch's"
        read = [r.request_id for _, r in rt.epoch_requests(e) if r.request_id in tids]
        assert all(lo <= tids[rid] <= top for rid in read), f"a TID of epoch {e} is out of its range"
        hi = max(hi, top)
        wide += len(rt.read_record(e).ends) > 2
    return wide


def _cfg(tmp_path: Path, log_url: str | None) -> SparkConfig:
    return SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, log_partitions=2, max_batch=200,
                       truncate_log=False, compact_every=3, timer_poll_ms=20, log_url=log_url)


_CRASH = """
import sys
from charon.config import SparkConfig
from charon.runtime.spark.runtime import SparkRuntime
rt = SparkRuntime("charon.apps.holds:app", SparkConfig(data_dir=sys.argv[1], partitions=2))
rt.rescale_log(int(sys.argv[2]))
"""


@pytest.mark.parametrize("point", ["log_relayout", "log_resized"])
def test_sigkill_around_the_log_switch_restarts_at_the_recorded_count(tmp_path: Path, point: str) -> None:
    """Without Spark: ``layout.json`` records the new count before the log switches, so a driver killed on
    either side of the switch restarts with the log at the new count; a later start with another
    ``log_partitions`` resizes it again (shrinking keeps the physical partitions)."""
    import os
    import subprocess
    import sys

    SparkRuntime(APP, SparkConfig(data_dir=str(tmp_path), partitions=2)).close()
    env = dict(os.environ, CHARON_CRASH_AT=f"{point}:*")
    proc = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path), "5"], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    from charon.log.sqlite import InputLog

    with InputLog(str(tmp_path / "input.sqlite")) as log:
        assert log.counts() == ((5, 5) if point == "log_resized" else (2, 2))
    assert read_layout(str(tmp_path / "checkpoint")).log_partitions == 5
    rt = SparkRuntime(APP, SparkConfig(data_dir=str(tmp_path), partitions=2))
    assert rt.config.n_log_partitions == 5 and rt.input_log.counts() == (5, 5)
    rt.close()
    rt = SparkRuntime(APP, SparkConfig(data_dir=str(tmp_path), partitions=2, log_partitions=3))
    assert rt.input_log.counts() == (5, 3) and read_layout(str(tmp_path / "checkpoint")).log_partitions == 3
    with pytest.raises(ValueError):
        rt.rescale_log(0)
    with pytest.raises(ValueError):
        rt.rescale()
    rt.close()


@pytest.mark.spark
@pytest.mark.parametrize("backend", ["sqlite", "nats"])
def test_spark_log_2_4_3_under_gateway_load(tmp_path: Path, backend: str) -> None:
    from charon.server.serve import BackgroundServer

    srv_nats = NatsServer(tmp_path / "nats").start() if backend == "nats" else None
    url = f"{srv_nats.url}/logscale" if srv_nats is not None else None
    rt = SparkRuntime(APP, _cfg(tmp_path / "data", url))
    replies: dict[str, tuple[str, dict]] = {}
    errors: list = []
    stop = threading.Event()
    try:
        rt.load("acct", {k: 100 for k in KEYS})
        initial = {store_key("acct", k): serde.encode(100) for k in KEYS}
        with BackgroundServer(rt, token=TOKEN) as srv:
            clients = [threading.Thread(target=_client, args=(srv.url, s, stop, replies, errors), daemon=True)
                       for s in range(8)]
            for c in clients:
                c.start()
            _epochs_pass(rt, 3)
            grow = rt.rescale(log_partitions=4)["log"]
            assert rt.input_log.counts() == (4, 4) and rt.control_status()["log_partitions"] == {"route": 4,
                                                                                                 "physical": 4}
            _epochs_pass(rt, 4)
            both = rt.rescale(3, log_partitions=3)  # the log shrinks (route only), the engine grows
            shrink = both["log"]
            assert rt.input_log.counts() == (4, 3) and rt.config.partitions == 3
            _epochs_pass(rt, 4)
            stop.set()
            for c in clients:
                c.join(200)
            assert not errors, errors[:3]
            deadline = time.monotonic() + 120
            while _money(rt.snapshot())[1] > 0 or not rt.caught_up():  # the last holds' timers fire
                assert time.monotonic() < deadline, "holds were not released"
                time.sleep(0.2)
        assert len(replies) > 50
        log = {r.request_id: r for r in rt.replies()}
        assert len(rt.replies()) == len(log), "one reply per request id in the output log"
        assert all((log[rid].tid, log[rid].epoch) == (body["tid"], body["epoch"]) for rid, (_, body) in replies.items())
        got = sorted(body["epoch"] for _, body in replies.values())
        assert got[0] <= grow["epoch"] < shrink["epoch"] < got[-1], "both switches happened while clients were served"
        assert _money(rt.snapshot()) == (100 * len(KEYS), 0), "money is conserved; every hold released"
        assert _check_tids(rt, replies) > 0, "epochs read the grown log"
        ends = rt.input_log.end_offsets()
        assert len(ends) == 4 and ends[2] > 0 and ends[3] > 0, "the new partitions were appended to and read"
        ip, results = replay_in_process(holds.app, rt, initial)
        assert ip.snapshot() == rt.snapshot(), "the run equals an in-process replay of its epochs"
        assert all(log[r.request_id] == r for res in results for r in res.replies.values())
        assert (grow["from"], grow["to"], shrink["from"], shrink["to"], shrink["physical"]) == (2, 4, 4, 3, 4)
        assert read_layout(str(tmp_path / "data" / "checkpoint")).log_partitions == 3
        print("\nlog switches: " + json.dumps([grow, shrink]))
    finally:
        stop.set()
        rt.close()
        if srv_nats is not None:
            srv_nats.kill()


@pytest.mark.spark
def test_spark_driver_sigkill_right_after_a_log_resize(tmp_path: Path) -> None:
    from charon.log.sqlite import InputLog

    data = tmp_path / "data"
    ckpt = data / "checkpoint"
    log = tmp_path / "driver.log"
    # requests keep arriving once the driver created the log (2 partitions), driver up or down
    load = _Load(data, log, seed=11, ready=lambda: "started" in (log.read_text() if log.exists() else ""))
    stop = load.stop
    try:
        rc = _run(data, ["--partitions", "2", "--load", str(len(KEYS)), "--rescale-log", "4"], log, "log_resized:*")
        assert rc == -signal.SIGKILL, log.read_text()[-3000:]
        assert read_layout(str(ckpt)).log_partitions == 4
        inp = InputLog(str(data / "input.sqlite"))
        assert inp.counts() == (4, 4), "killed after the resize"
        time.sleep(1.0)  # appends land in the new partitions while the driver is down
        assert sum(inp.end_offsets()[2:]) > 0
        log.write_text("")
        closer = load.finish_after("rescaled")
        rc = _run(data, ["--partitions", "2", "--rescale-log", "3"], log, None)  # restart: the recorded count
        closer.join(60)
        text = log.read_text()
        assert rc == 0, text[-3000:]
        assert '"from": 4, "to": 3' in text and "idle " in text
    finally:
        stop.set()
    rt = SparkRuntime(APP, SparkConfig(data_dir=str(data), partitions=2))
    assert rt.config.n_log_partitions == 3 and rt.input_log.counts() == (4, 3)
    assert _state_dirs(ckpt) == [read_layout(str(ckpt)).state]
    load.check_answered_once(rt)
    last = rt.read_record(rt.last_recorded_epoch())
    assert len(last.ends) == 4 and len(last.counters) == 4, "the epochs read all four partitions"
