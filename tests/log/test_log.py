"""The log contract, one suite run against both implementations: the SQLite logs (real files, several
threads and spawned processes) and the NATS JetStream logs (a real ``nats-server -js`` on a free port).
No mocks. SQLite-only properties (WAL mode) are marked as such."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from natsfix import NatsServer

from charon.log import open_input_log, open_output_log
from charon.log.sqlite import InputLog, OutputLog, log_partition_of
from charon.messages import Reply, Request
from charon.serde import encode


def req(i: int | str, key: str | None = None, ts: float = 0.0) -> Request:
    rid = f"r{i}"
    return Request(rid, "account", key if key is not None else f"k{i}", "deposit", encode([i]), ts)


def rep(i: int, epoch: int = 0) -> Reply:
    return Reply(f"r{i}", tid=i + 1, epoch=epoch, ok=True, value=encode(i))


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    srv = NatsServer(tmp_path_factory.mktemp("nats")).start()
    yield srv.url
    srv.stop()


class Logs:
    """Opens the input and output logs of one fresh location (a directory or a NATS deployment)."""

    def __init__(self, in_loc: str, out_loc: str) -> None:
        self.in_loc, self.out_loc = in_loc, out_loc
        self.opened: list[Any] = []

    def input(self, partitions: int | None = None) -> Any:
        log = open_input_log(self.in_loc, partitions)
        self.opened.append(log)
        return log

    def output(self) -> Any:
        log = open_output_log(self.out_loc)
        self.opened.append(log)
        return log

    def fresh(self) -> Logs:
        """Another empty location of the same kind."""
        if self.in_loc.startswith("nats://"):
            base = self.in_loc.rsplit("/", 1)[0]
            d = f"{base}/t{uuid.uuid4().hex[:12]}"
            return Logs(d, d)
        return Logs(self.in_loc + ".2", self.out_loc + ".2")


@pytest.fixture(params=["sqlite", "nats"])
def logs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Logs]:
    if request.param == "sqlite":
        lg = Logs(str(tmp_path / "in.db"), str(tmp_path / "out.db"))
    else:
        url = request.getfixturevalue("nats_url")
        d = f"{url}/t{uuid.uuid4().hex[:12]}"
        lg = Logs(d, d)
    yield lg
    for log in lg.opened:
        log.close()


# -- InputLog ------------------------------------------------------------------------------------


def test_append_read_dense_offsets(logs: Logs) -> None:
    log = logs.input(4)
    positions = [log.append(req(i)) for i in range(40)]
    # default partition: crc32 of the key string
    for i, (p, _) in enumerate(positions):
        assert p == zlib.crc32(f"k{i}".encode()) % 4 == log_partition_of(f"k{i}", 4)
    # offsets dense per partition, in append order
    for p in range(4):
        offs = [o for q, o in positions if q == p]
        assert offs == list(range(len(offs)))
    ends = log.end_offsets()
    assert ends == [sum(1 for q, _ in positions if q == p) for p in range(4)]
    assert log.count() == 40
    for p in range(4):
        got = log.read(p, 0, ends[p])
        want = [f"r{i}" for i, (q, _) in enumerate(positions) if q == p]
        assert [r.request_id for r in got] == want
        assert all(r.ts > 0 for r in got)  # ts assigned at append
    # sub-range
    p = max(range(4), key=lambda q: ends[q])
    assert [r.request_id for r in log.read(p, 1, 3)] == [r.request_id for r in log.read(p, 0, 3)[1:]]
    assert log.read(p, 2, 2) == []


def test_explicit_partition_ts_kept_and_roundtrip(logs: Logs) -> None:
    log = logs.input(3)
    r = req(1, ts=123.5)
    assert log.append(r, partition=2) == (2, 0)
    assert log.read(2, 0, 1) == [r]  # full fidelity, given ts kept
    before = time.time()
    log.append(req(2), partition=2)
    (stored,) = log.read(2, 1, 2)
    assert before <= stored.ts <= time.time()
    with pytest.raises(ValueError):
        log.append(req(3), partition=3)


def test_read_range_ordered(logs: Logs) -> None:
    log = logs.input(4)
    log.append_many([req(i) for i in range(100)])
    ends = log.end_offsets()
    starts = [min(2, e) for e in ends]
    rows = log.read_range(starts, ends)
    assert [(p, o) for p, o, _ in rows] == [(p, o) for p in range(4) for o in range(starts[p], ends[p])]
    assert len(rows) == 100 - sum(starts)
    for p, o, r in rows:
        assert log.read(p, o, o + 1) == [r]


def test_read_beyond_end_or_truncated_raises(logs: Logs) -> None:
    log = logs.input(1)
    log.append_many([req(i) for i in range(5)])
    with pytest.raises(ValueError, match="ends at 5"):
        log.read(0, 0, 6)
    log.truncate([3])
    with pytest.raises(ValueError, match="truncated"):
        log.read(0, 2, 5)
    assert [r.request_id for r in log.read(0, 3, 5)] == ["r3", "r4"]


def test_partition_count_is_persistent(logs: Logs) -> None:
    logs.input(8).close()
    assert logs.input().partitions == 8
    assert logs.input(8).partitions == 8
    with pytest.raises(ValueError, match="8 partitions"):
        logs.input(4)
    fresh = logs.fresh()
    assert fresh.input().partitions == 4
    for log in fresh.opened:
        log.close()


def test_resize_grow_shrink_regrow_keeps_offsets_and_routes_by_the_new_count(logs: Logs) -> None:
    """Physical partitions only grow; the routing count follows resize; every offset stays readable."""
    log = logs.input(2)
    first = log.append_many([req(i) for i in range(20)])
    assert all(p == log_partition_of(f"k{i}", 2) for i, (p, _) in enumerate(first))
    ends2 = log.end_offsets()
    assert log.resize(4) == (4, 4)
    assert (log.partitions, log.route) == (4, 4)
    assert log.end_offsets() == ends2 + [0, 0]  # new partitions start at 0
    grown = log.append_many([req(i) for i in range(20, 60)])
    assert all(p == log_partition_of(f"k{i}", 4) for i, (p, _) in zip(range(20, 60), grown, strict=True))
    assert {p for p, _ in grown} >= {2, 3}
    assert log.resize(3) == (4, 3)  # shrink: only the route goes down
    shrunk = log.append_many([req(i) for i in range(60, 100)])
    assert all(p == log_partition_of(f"k{i}", 3) for i, (p, _) in zip(range(60, 100), shrunk, strict=True))
    assert log.append(req(100), partition=3)[0] == 3  # a retired partition still takes explicit appends
    ends = log.end_offsets()
    assert len(ends) == 4 and sum(ends) == 101
    # a shorter offsets list (from before the growth) is padded with 0s
    rows = log.read_range(ends2, ends)
    assert len(rows) == 101 - sum(ends2)
    assert [r.request_id for _, _, r in log.read_range([0, 0], ends)] == [
        r.request_id for p in range(4) for r in log.read(p, 0, ends[p])
    ]
    with pytest.raises(ValueError):
        log.read_range([0] * 5, ends + [0])
    assert log.resize(4) == (4, 4)  # regrow reuses the retired partition: its offsets continue
    before = log.end_offsets()[3]
    k = next(i for i in range(1000, 2000) if log_partition_of(f"k{i}", 4) == 3)
    assert log.append(req(k)) == (3, before)
    log.truncate(ends2)  # a short list truncates the partitions it names
    assert log.start_offsets() == ends2 + [0, 0]
    with pytest.raises(ValueError):
        log.resize(0)


def test_resize_dedup_and_a_stale_second_handle(logs: Logs) -> None:
    """Dedup holds across partitions after a resize; another handle on the same log keeps appending correctly
    (it sees the new counts at its next append or within a second); a reopen sees the new counts."""
    a = logs.input(2)
    b = logs.input()
    assert b.partitions == 2
    pos = a.append_many([req(i) for i in range(30)])
    a.resize(4)
    # the same ids through either handle: the original positions, wherever the new route would put them
    assert b.append_many([req(i) for i in range(30)]) == pos
    assert a.append_many([req(i) for i in range(30)]) == pos
    b.append(req("x"), partition=3)  # names a partition b did not know: it refreshes and takes it
    time.sleep(1.1)  # NATS handles refresh their cached counts at most every second
    new = b.append_many([req(i) for i in range(30, 90)])
    assert all(p == log_partition_of(f"k{i}", 4) for i, (p, _) in zip(range(30, 90), new, strict=True))
    a.resize(3)
    time.sleep(1.1)
    later = b.append_many([req(i) for i in range(90, 130)])
    assert all(p == log_partition_of(f"k{i}", 3) for i, (p, _) in zip(range(90, 130), later, strict=True))
    assert a.count() == b.count() == 131
    assert sorted(r.request_id for _, _, r in b.read_range([0, 0], b.end_offsets())) == sorted(
        [f"r{i}" for i in range(130)] + ["rx"])
    # reopen: the counts are the log's; an explicit other count raises unless a resize is asked
    assert (logs.input().partitions, logs.input().route) == (4, 3)
    assert logs.input(3).route == 3
    with pytest.raises(ValueError, match="3 partitions"):
        logs.input(2)
    again = open_input_log(logs.in_loc, 6, resize=True)
    logs.opened.append(again)
    assert (again.partitions, again.route) == (6, 6)
    assert again.end_offsets()[4:] == [0, 0]


def test_wal_mode_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "in.db"
    InputLog(path).close()
    OutputLog(tmp_path / "out.db").close()
    for f in ("in.db", "out.db"):
        c = sqlite3.connect(tmp_path / f)
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        c.close()


def test_sqlite_blobs_are_stored_as_blobs(tmp_path: Path) -> None:
    """Requests and replies are bound as bytearray (the cheap path of the sqlite3 module): the files still hold
    BLOBs that a plain sqlite3 reader gets back as bytes, decoding to what was written."""
    from charon.serde import decode_reply, decode_request

    inp, out = InputLog(tmp_path / "in.db", 2), OutputLog(tmp_path / "out.db")
    reqs = [req(i, ts=1.5) for i in range(5)]
    inp.append_many(reqs)
    out.put_many([rep(i) for i in range(5)])
    inp.close()
    out.close()
    c = sqlite3.connect(tmp_path / "in.db")
    rows = c.execute("SELECT typeof(data), data FROM entries ORDER BY request_id").fetchall()
    assert [t for t, _ in rows] == ["blob"] * 5 and all(type(d) is bytes for _, d in rows)
    assert [decode_request(d) for _, d in rows] == reqs
    c.close()
    c = sqlite3.connect(tmp_path / "out.db")
    rows = c.execute("SELECT typeof(data), data FROM replies ORDER BY seq").fetchall()
    assert [t for t, _ in rows] == ["blob"] * 5 and [decode_reply(d) for _, d in rows] == [rep(i) for i in range(5)]
    c.close()


def test_sqlite_output_log_raw_reads(tmp_path: Path) -> None:
    """read_raw_since: the same seqs and limit as read_since, each reply's own msgpack bytes."""
    from charon.serde import decode_reply

    out = OutputLog(tmp_path / "out.db")
    out.put_many([rep(i) for i in range(6)])
    for since, limit in ((0, 10), (2, 3), (6, 5)):
        raw = out.read_raw_since(since, limit)
        assert [(s, decode_reply(d)) for s, d in raw] == out.read_since(since, limit)
        assert all(type(d) is bytes for _, d in raw)
    assert [s for s, _ in out.read_raw_since(2, 3)] == [3, 4, 5]
    out.close()


def test_idempotent_append(logs: Logs) -> None:
    log = logs.input(4)
    first = log.append(req(1))
    assert log.contains("r1") and not log.contains("r2")
    # a retry with the same request id, even with another key/partition, is not appended again
    assert log.append(Request("r1", "account", "other", "deposit", b"\x90"), partition=3) == first
    assert log.count() == 1
    # duplicates inside one batch and against the log
    got = log.append_many([req(2), req(1), req(2), req(3)])
    assert got[1] == first and got[0] == got[2] and got[3] != got[0]
    assert log.count() == 3
    assert sum(log.end_offsets()) == 3
    assert log.position("r2") == got[0]


def test_a_large_batch_appends_as_one_by_one(logs: Logs) -> None:
    """A batch longer than the SQLite log's statement chunks, with duplicates inside it (across chunk
    boundaries) and against the log, gets the positions and contents of the same requests appended one by one."""
    ids = [i % 233 for i in range(300)] + [5, 299, 0]  # 234 distinct, 69 repeats; ids 0..9 are in the log
    batch, one = logs.input(4), logs.fresh().input(4)
    for log in (batch, one):
        log.append_many([req(i, ts=1.0) for i in range(10)])
    got = batch.append_many([req(i, ts=1.0) for i in ids])
    want = [one.append(req(i, ts=1.0)) for i in ids]
    assert got == want
    assert batch.count() == one.count() == 234 and batch.end_offsets() == one.end_offsets()
    assert batch.read_range([0] * 4, batch.end_offsets()) == one.read_range([0] * 4, one.end_offsets())


def test_append_many_is_one_transaction(logs: Logs) -> None:
    log = logs.input(2)
    bad = Request("bad", "account", "k", "f", b"", 0.0)
    with pytest.raises(ValueError):
        log.append_many([req(1), (bad, 7)])  # invalid partition: nothing of the batch is stored
    assert log.count() == 0 and log.end_offsets() == [0, 0] and not log.contains("r1")
    out = log.append_many([(req(i), i % 2) for i in range(6)])
    assert out == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]


def test_truncate_keeps_counting(logs: Logs) -> None:
    log = logs.input(2)
    log.append_many([(req(i), i % 2) for i in range(10)])
    assert log.end_offsets() == [5, 5]
    log.truncate([3, 5])
    assert log.count() == 2
    assert log.start_offsets() == [3, 5]
    assert log.end_offsets() == [5, 5]
    log.truncate([1, 1])  # below the truncation point: no-op
    assert log.start_offsets() == [3, 5]
    assert log.append(req("new"), partition=1) == (1, 5)  # offsets never reused
    assert [r.request_id for r in log.read(1, 5, 6)] == ["rnew"]
    # idempotency outlives retention
    assert log.contains("r0")
    assert log.append(req(0), partition=0) == (0, 0)
    assert log.count() == 3
    with pytest.raises(ValueError):
        log.truncate([6, 0])
    log.truncate([1])  # a shorter list (from before a resize) names fewer partitions: here a no-op
    assert log.start_offsets() == [3, 5]
    with pytest.raises(ValueError):
        log.truncate([1, 1, 1])  # more offsets than partitions


def test_reopen_sees_data(logs: Logs) -> None:
    with open_input_log(logs.in_loc, 2) as log:
        log.append_many([req(i) for i in range(7)])
        ends = log.end_offsets()
    log2 = logs.input()
    assert log2.end_offsets() == ends
    assert sorted(r.request_id for _, _, r in log2.read_range([0, 0], ends)) == sorted(
        f"r{i}" for i in range(7)
    )


def test_threads_append_concurrently(logs: Logs) -> None:
    log = logs.input(4)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(50):
                log.append(req(f"t{t}-{i}"))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert log.count() == 200
    rows = log.read_range([0] * 4, log.end_offsets())
    assert len({r.request_id for _, _, r in rows}) == 200


def _proc_append(path: str, worker: int, n: int, batch: int) -> None:
    log = open_input_log(path)
    i = 0
    while i < n:
        # every id appears in two workers: (worker, i) and (worker ^ 1, i) share "s{pair}-{i}"
        chunk = []
        for j in range(i, min(n, i + batch)):
            chunk.append(req(f"w{worker}-{j}"))
            chunk.append(req(f"s{worker // 2}-{j}"))
        if batch == 1:
            for r in chunk:
                log.append(r)
        else:
            log.append_many(chunk)
        i += batch
    log.close()


def test_multiprocess_appends(logs: Logs) -> None:
    path = logs.in_loc
    logs.input(4).close()
    ctx = mp.get_context("spawn")
    n = 60
    procs = [ctx.Process(target=_proc_append, args=(path, w, n, 1 if w % 2 else 7)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    log = logs.input()
    ends = log.end_offsets()
    rows = log.read_range([0] * 4, ends)
    ids = [r.request_id for _, _, r in rows]
    want = {f"rw{w}-{j}" for w in range(4) for j in range(n)}
    want |= {f"rs{k}-{j}" for k in range(2) for j in range(n)}
    assert len(ids) == len(set(ids)) == len(want)  # shared ids appended once
    assert set(ids) == want
    assert sum(ends) == len(want) == log.count()
    for p in range(4):  # dense, per partition
        assert [o for q, o, _ in rows if q == p] == list(range(ends[p]))
    for q, _, r in rows:
        assert q == log_partition_of(r.key, 4)


# -- OutputLog -----------------------------------------------------------------------------------


def test_output_log_exactly_once(logs: Logs) -> None:
    out = logs.output()
    assert out.put_many([rep(1), rep(2), rep(3)]) == 3
    # a replayed epoch re-delivers 2 and 3 (maybe with other tids): ignored
    assert out.put_many([Reply("r2", 99, 1, False, b"", "X", "y"), rep(3), rep(4)]) == 1
    assert out.put_many([]) == 0
    assert out.count() == 4
    assert out.get("r2") == rep(2)
    assert out.get("nope") is None
    seen = out.read_since(0)
    assert [r.request_id for _, r in seen] == ["r1", "r2", "r3", "r4"]
    seqs = [s for s, _ in seen]
    assert seqs == sorted(seqs) and len(set(seqs)) == 4
    assert [r.request_id for _, r in out.read_since(seqs[1])] == ["r3", "r4"]
    assert [r.request_id for _, r in out.read_since(0, limit=2)] == ["r1", "r2"]
    assert out.read_between(seqs[0], seqs[2]) == seen[1:3]
    assert out.last_seq() == seqs[-1]
    assert out.seq_after(0, 2) == seqs[1] and out.seq_after(0, 100) == seqs[-1]
    assert out.put(rep(5)) is True and out.put(rep(5)) is False


def test_output_log_consumer_sees_each_reply_once(logs: Logs) -> None:
    out = logs.output()
    stop = threading.Event()

    def producer() -> None:
        for i in range(300):
            batch = [rep(i), rep(max(0, i - 1))]  # every reply is re-put once (replay)
            out.put_many(batch)
        stop.set()

    consumer_log = logs.output()
    seen: list[str] = []
    seq = 0
    th = threading.Thread(target=producer)
    th.start()
    while True:
        done = stop.is_set()
        for s, r in consumer_log.read_since(seq, limit=17):
            assert s > seq
            seq = s
            seen.append(r.request_id)
        if done and not consumer_log.read_since(seq):
            break
    th.join()
    assert seen == [f"r{i}" for i in range(300)]


def test_wait_for(logs: Logs) -> None:
    out = logs.output()
    t0 = time.monotonic()
    assert out.wait_for("r1", timeout=0.05) is None
    assert time.monotonic() - t0 >= 0.05
    timer = threading.Timer(0.1, lambda: logs.output().put_many([rep(1)]))
    timer.start()
    got = out.wait_for("r1", timeout=5)
    timer.join()
    assert got == rep(1)


def test_reply_stream_atoms_are_whole_epochs(logs: Logs) -> None:
    """Early replies of one epoch arrive in several groups; the replies stream cuts only at epoch ends."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

    from charon.runtime.spark.source import CharonRepliesStreamReader

    out = logs.output()
    reader = CharonRepliesStreamReader({"path": logs.out_loc})
    out.mark_epoch(-1)  # what the Spark runtime does when it opens its output log

    def put(epoch: int, ids: range) -> None:
        out.put_many([Reply(f"e{epoch}-{i}", i, epoch, True) for i in ids])

    put(0, range(0, 3))  # lock-free replies of epoch 0 ...
    assert reader.latestOffset({"seq": 0}, ReadAllAvailable()) == {"seq": 0}, "no batch before an epoch ends"
    put(0, range(3, 5))  # ... then its fallback replies
    out.mark_epoch(0)
    put(1, range(0, 4))
    end = reader.latestOffset({"seq": 0}, ReadAllAvailable())
    assert end == {"seq": 5, "start": 0}, "epoch 1 is not finished: the batch stops at the end of epoch 0"
    assert {r.epoch for _, r in out.read_between(0, 5)} == {0}
    out.mark_epoch(1)
    out.mark_epoch(1)  # idempotent (a replayed epoch marks again)
    assert reader.latestOffset({"seq": 5}, ReadMaxRows(2)) == {"seq": 9, "start": 5}, "a whole epoch beyond the cap"
    assert reader.latestOffset({"seq": 0}, ReadMaxRows(6)) == {"seq": 5, "start": 0}, "cut back to an epoch end"


# -- retention (dedup window) --------------------------------------------------------------------


def test_forget_only_truncated_ids_and_prune_their_replies(logs: Logs) -> None:
    tick = "__charon_tick:"  # a runtime's own record (Spark's ticks, the node's markers): no reply
    log = logs.input(1)
    out = logs.output()
    for i in range(6):
        log.append(req(i))
    log.append(Request(f"{tick}3", "__tick", "", "", encode([]), 0.0))
    for e in range(6):
        out.put_many([rep(e, e)])
        out.mark_epoch(e)  # boundary of epoch e: seq e + 1
    log.truncate([4])  # r0..r3 left the log; r4, r5 and the tick are still in it
    forgotten = log.forget(out.request_ids_through(out.last_seq()), truncated_prefix=tick)
    assert forgotten == ["r0", "r1", "r2", "r3"]
    assert not log.contains("r0") and log.contains("r4") and log.contains(f"{tick}3")
    assert out.prune(forgotten) == 4
    assert out.get("r3") is None and out.get("r4") is not None and out.count() == 2
    assert out.epoch_boundaries(0) == [4, 5, 6]  # epoch 3's boundary, below the oldest reply (seq 5), stays
    assert out.last_seq() == 6 and [s for s, _ in out.read_since(0)] == [5, 6]
    # a forgotten id is new again: the retry is appended (and would run) again
    assert log.append(req(0)) == (0, 7)
    log.truncate([8])
    assert log.forget([], truncated_prefix=tick) == [] and not log.contains(f"{tick}3")
    assert out.prune(["r4", "r5"]) == 2 and out.count() == 0 and out.last_seq() == 6
    out.put(rep(9))
    assert [s for s, _ in out.read_since(6)] == [7]
