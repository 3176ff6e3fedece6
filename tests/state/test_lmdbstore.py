"""LmdbStore: executor-local LMDB state versioned by epoch, restored from DurableState (real LMDB)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from charon.core.routing import entity_prefix, store_key
from charon.state.durable import DurableState
from charon.state.lmdbstore import LmdbStore, StoreError, open_store
from charon.state.store import MemoryStore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT)


def apply(state: dict, delta: dict) -> dict:
    out = dict(state)
    for k, v in delta.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def delta_of(e: int) -> dict[bytes, bytes | None]:
    r = random.Random(e)
    return {b"k%03d" % r.randrange(300): (None if r.random() < 0.2 else b"v%d" % e) for _ in range(40)}


def models_upto(n: int) -> list[dict]:
    models = [{}]  # models[e + 1] = state after epoch e
    for e in range(n + 1):
        models.append(apply(models[-1], delta_of(e)))
    return models


@pytest.fixture
def dirs(tmp_path):
    local, dur = str(tmp_path / "local"), str(tmp_path / "durable")
    stores: list[LmdbStore] = []

    def make(local_path: str = local, pid: int = 0, durable: bool = True) -> LmdbStore:
        s = LmdbStore(local_path, pid, DurableState(dur) if durable else None)
        stores.append(s)
        return s

    yield make, local, dur
    for s in stores:
        s.close()


def test_commit_is_idempotent_per_epoch(dirs):
    make, local, dur = dirs
    s = make()
    assert s.epoch == -1
    s.commit(0, {b"a": b"1", b"b": b"2"})
    s.commit(0, {b"a": b"changed"})  # replay: no-op
    s.commit(1, {b"b": None})
    s.commit(1, {b"b": b"back"})  # replay: no-op
    s.commit(0, {b"c": b"old"})  # older epoch: no-op
    assert s.epoch == 1
    assert dict(s.items()) == {b"a": b"1"}
    assert s.durable.load(0) == ({b"a": b"1"}, 1)
    # a second handle (other object, same process) sees the same committed state
    assert make().epoch == 1


def test_scan_prefix_ordered_and_get(dirs):
    make, *_ = dirs
    s = make()
    entities = [("b", ""), ("a", "x"), ("a", ""), ("a", "b"), ("ab", ""), ("a", "a")]
    delta = {store_key("acct", k, item): b"%d" % i for i, (k, item) in enumerate(entities)}
    s.commit(0, delta)
    got = list(s.scan(entity_prefix("acct", "a")))
    assert [k for k, _ in got] == [store_key("acct", "a", i) for i in ["", "a", "b", "x"]]
    assert list(s.scan(b"zzz")) == []
    assert [k for k, _ in s.scan(b"")] == sorted(delta)
    assert s.get(store_key("acct", "ab")) == delta[store_key("acct", "ab")]
    assert s.get(b"missing") is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    deltas=st.lists(
        st.dictionaries(st.binary(min_size=1, max_size=3), st.none() | st.binary(max_size=4), max_size=15),
        min_size=1, max_size=8,
    ),
    prefixes=st.lists(st.binary(max_size=2), min_size=1, max_size=5),
)
def test_scans_match_memory_store(deltas, prefixes):
    with tempfile.TemporaryDirectory() as root:
        s = LmdbStore(root, 0, None, sync=False)
        m = MemoryStore()
        try:
            for e, d in enumerate(deltas):
                s.commit(e, d)
                m.commit(e, d)
                with s.reading():
                    for p in prefixes:
                        assert list(s.scan(p)) == list(m.scan(p))
                for p in prefixes:
                    assert list(s.scan(p)) == list(m.scan(p))
            assert s.epoch == m.epoch
        finally:
            s.close()


def test_read_transaction_is_a_snapshot(dirs):
    make, *_ = dirs
    s = make(durable=False)
    s.commit(0, {b"k": b"0"})
    s.begin_read()
    s.commit(1, {b"k": b"1", b"n": b"new"})
    assert s.get(b"k") == b"0" and s.epoch == 0 and list(s.scan(b"n")) == []
    s.end_read()
    assert s.get(b"k") == b"1" and s.epoch == 1


def test_restore_when_missing(dirs):
    make, local, dur = dirs
    s = make()
    for e in range(6):
        s.commit(e, delta_of(e))
    s.close()
    shutil.rmtree(local)
    s2 = make()
    assert s2.epoch == -1
    s2.ensure_epoch(5)
    assert s2.epoch == 5 and dict(s2.items()) == models_upto(5)[6]


def test_restore_when_behind_applies_only_the_missing_deltas(dirs):
    make, local, dur = dirs
    big = {b"big%06d" % i: b"x" * 100 for i in range(5000)}
    a = make(os.path.join(local, "a"))  # the executor that ran the epochs
    b = make(os.path.join(local, "b"))  # another executor whose copy fell behind
    a.bulk_load(-1, big.items())
    b.ensure_epoch(-1)
    models = [big]
    for e in range(4):
        a.commit(e, delta_of(e))
        models.append(apply(models[-1], delta_of(e)))
        if e == 1:
            b.ensure_epoch(1)
            assert dict(b.items()) == models[2]
    before = b.bytes_read
    b.ensure_epoch(3)
    # only deltas 2 and 3 were read, not the ~500 KB state
    assert b.bytes_read - before < 20_000
    assert b.epoch == 3 and dict(b.items()) == models[4]
    # after a compaction past b's epoch, catching up is a full reload
    a.commit(4, delta_of(4))
    models.append(apply(models[-1], delta_of(4)))
    a.commit(5, {})
    models.append(models[-1])
    assert a.compact_durable(4)
    before = b.bytes_read
    b.ensure_epoch(5)
    assert b.bytes_read - before > 500_000
    assert b.epoch == 5 and dict(b.items()) == models[6]


def test_restore_when_ahead_rolls_back_local_and_durable(dirs):
    make, local, dur = dirs
    s = make()
    for e in range(5):
        s.commit(e, delta_of(e))
    # crash, the driver replays epoch 3: the store must read as of epoch 2
    s.ensure_epoch(2)
    assert s.epoch == 2 and dict(s.items()) == models_upto(2)[3]
    assert s.durable.latest_epoch(0) == 2
    s.commit(3, {b"replayed": b"yes"})  # the replay is recorded, not ignored
    assert s.get(b"replayed") == b"yes"
    fresh = DurableState(dur)
    assert fresh.load(0)[0] == apply(models_upto(2)[3], {b"replayed": b"yes"})


def test_durable_written_but_local_commit_lost(dirs):
    """A kill between the durable write and the local transaction leaves local behind by one epoch."""
    make, local, dur = dirs
    s = make()
    s.commit(0, delta_of(0))
    s.durable.write_delta(0, 1, delta_of(1))  # what commit(1) had done before the kill
    assert s.epoch == 0
    s.ensure_epoch(1)
    assert dict(s.items()) == models_upto(1)[2]
    s.commit(1, delta_of(1))  # the replay's commit is a no-op
    assert s.epoch == 1


def test_bad_keys_are_rejected_before_anything_is_written(dirs):
    make, *_ = dirs
    s = make()
    for bad in (b"", b"x" * 600):
        with pytest.raises(ValueError):
            s.commit(0, {b"ok": b"1", bad: b"2"})
    assert s.epoch == -1 and s.durable.latest_epoch(0) == -1 and s.get(b"ok") is None


def test_commit_refuses_a_local_copy_behind_the_durable_one(dirs):
    make, local, dur = dirs
    a = make(os.path.join(local, "a"))
    a.bulk_load(-1, [(b"base", b"1")])
    fresh = make(os.path.join(local, "b"))
    with pytest.raises(StoreError):  # never restored: committing would lose the base
        fresh.commit(0, {b"k": b"v"})
    fresh.ensure_epoch(-1)
    a.commit(0, {b"k": b"a0"})
    a.commit(1, {b"k": b"a1"})
    with pytest.raises(StoreError):  # at -1 while epoch 0 is durable: its reads were stale
        fresh.commit(2, {b"k": b"stale"})
    assert fresh.durable.load(0)[0] == {b"base": b"1", b"k": b"a1"}
    fresh.ensure_epoch(1)
    fresh.commit(2, {b"k": b"b2"})
    assert fresh.get(b"k") == b"b2" and a.durable.load(0) == ({b"base": b"1", b"k": b"b2"}, 2)


def test_cannot_reach_unknown_epoch(dirs):
    make, *_ = dirs
    s = make()
    s.commit(0, {b"a": b"1"})
    with pytest.raises(StoreError):
        s.ensure_epoch(3)
    with pytest.raises(StoreError):
        make(durable=False).ensure_epoch(3)


def test_corrupt_env_is_rebuilt_from_durable(dirs):
    make, local, dur = dirs
    s = make()
    s.commit(0, {b"a": b"1"})
    s.commit(1, {b"b": b"2"})
    s.close()
    with open(os.path.join(local, "p0", "data.mdb"), "r+b") as f:
        f.write(os.urandom(8192))
    s2 = make()
    assert s2.epoch == -1
    s2.ensure_epoch(1)
    assert dict(s2.items()) == {b"a": b"1", b"b": b"2"}


def test_open_store_caches_per_process(tmp_path):
    a = open_store(str(tmp_path / "l"), 0, str(tmp_path / "d"))
    try:
        assert open_store(str(tmp_path / "l"), 0, str(tmp_path / "d")) is a
        b = open_store(str(tmp_path / "l"), 1, str(tmp_path / "d"))
        assert b is not a and b.durable is a.durable
        a.commit(0, {b"k": b"v"})
        assert a.durable.load(0) == ({b"k": b"v"}, 0)
    finally:
        a.close()


# ---- several processes on one environment -------------------------------------------------------

READER = r"""
import hashlib, sys, time
from charon.state.lmdbstore import open_store
s = open_store(sys.argv[1], 0, None)
for _ in range(int(sys.argv[2])):
    with s.reading():
        h = hashlib.sha256()
        for k, v in s.scan(b""):
            h.update(k); h.update(v)
        print(s.epoch, h.hexdigest(), s.get(b"k00042"), flush=True)
if len(sys.argv) > 3:
    s.commit(int(sys.argv[3]), {b"k00042": b"from-child"})
    print("committed", flush=True)
"""


def digest(items) -> str:
    h = hashlib.sha256()
    for k, v in items:
        h.update(k)
        h.update(v)
    return h.hexdigest()


def test_two_processes_read_the_same_env(tmp_path):
    local = str(tmp_path)
    s = LmdbStore(local, 0)
    try:
        state = {b"k%05d" % i: b"v%d" % i for i in range(20000)}
        s.commit(0, state)
        expected = f"0 {digest(sorted(state.items()))} b'v42'"
        s.begin_read()  # the parent reads concurrently too
        cmd = [sys.executable, "-c", READER, local, "20"]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, env=ENV) for _ in range(2)]
        assert digest(s.scan(b"")) == digest(sorted(state.items()))
        for p in procs:
            out, _ = p.communicate(timeout=120)
            lines = out.decode().splitlines()
            assert p.returncode == 0 and len(lines) == 20
            assert set(lines) == {expected}
        # a child commits: the parent's open snapshot is unchanged, a new one sees the commit
        p = subprocess.run([sys.executable, "-c", READER, local, "1", "1"], capture_output=True, env=ENV,
                           timeout=120)
        assert p.returncode == 0 and p.stdout.decode().splitlines()[-1] == "committed"
        assert s.get(b"k00042") == b"v42" and s.epoch == 0
        s.end_read()
        assert s.get(b"k00042") == b"from-child" and s.epoch == 1
    finally:
        s.close()


# ---- crash safety: a committing, compacting process SIGKILLed at random moments -----------------

WORKER = r"""
import random, sys
from charon.state.lmdbstore import open_store
local, dur, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
def delta(e):
    r = random.Random(seed * 1_000_003 + e)
    return {b"k%05d" % r.randrange(20000): (None if r.random() < 0.1 else b"%d:%d" % (e, i))
            for i in range(r.randint(20, 200))}
s = open_store(local, 0, dur)
s.ensure_epoch(s.durable.latest_epoch(0))
e = s.epoch + 1
print("ready", flush=True)
while True:
    s.commit(e, delta(e))
    if e % 4 == 0:
        s.compact_durable(e - 2)
    print("e", e, flush=True)
    e += 1
"""


def model_delta(seed: int, e: int) -> dict:
    r = random.Random(seed * 1_000_003 + e)
    return {b"k%05d" % r.randrange(20000): (None if r.random() < 0.1 else b"%d:%d" % (e, i))
            for i in range(r.randint(20, 200))}


def test_sigkill_during_commits_and_compactions(tmp_path):
    local, dur, seed = str(tmp_path / "local"), str(tmp_path / "durable"), 3
    base = {b"k%05d" % i: b"base" * 8 for i in range(0, 20000, 2)}
    s = LmdbStore(local, 0, DurableState(dur))
    s.bulk_load(-1, base.items())
    s.close()
    models = [base]  # models[e + 1] = state after epoch e
    rng = random.Random(2)
    last, kills, behind, wiped = -1, 0, 0, 0
    for i in range(15):
        p = subprocess.Popen([sys.executable, "-c", WORKER, local, dur, str(seed)], stdout=subprocess.PIPE,
                             env=ENV)
        assert p.stdout.readline().strip() == b"ready"
        # on a loaded machine an fsync can take long: kill only after this run committed something
        line = p.stdout.readline()
        while line and not line.startswith(b"e "):
            line = p.stdout.readline()
        assert line, "the worker died"
        time.sleep(rng.uniform(0.0, 0.3))
        p.send_signal(signal.SIGKILL)
        p.communicate()
        assert p.returncode == -signal.SIGKILL
        kills += 1
        d = DurableState(dur)
        durable_state, d_epoch = d.load(0)
        while len(models) <= d_epoch + 1:
            models.append(apply(models[-1], model_delta(seed, len(models) - 1)))
        assert durable_state == models[d_epoch + 1]
        s = LmdbStore(local, 0, d)
        l_epoch = s.epoch
        # durable before local: the local copy is at the durable epoch or one commit behind
        assert d_epoch - 1 <= l_epoch <= d_epoch
        assert dict(s.items()) == models[l_epoch + 1]
        behind += l_epoch < d_epoch
        assert d_epoch >= last
        last = d_epoch
        s.close()
        if i % 4 == 3:  # the executor lost its local disk: the next worker restores fully
            shutil.rmtree(local)
            wiped += 1
    assert kills >= 10 and last > 10
    print(f"{kills} kills, local behind durable after {behind}, wiped {wiped}, reached epoch {last}")


# ---- bytes per commit are proportional to the delta, not the state ------------------------------

def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("wchar:"))


def _commit_cost(root: str, n_state: int) -> tuple[int, int, int, int]:
    s = LmdbStore(os.path.join(root, "local"), 0, DurableState(os.path.join(root, "durable")))
    try:
        s.bulk_load(-1, ((b"user:%08d" % i, b"%0100d" % i) for i in range(n_state)))
        r = random.Random(5)
        delta: dict[bytes, bytes | None] = {b"user:%08d" % r.randrange(n_state): b"u" * 100
                                            for _ in range(500)}
        delta.update({b"new:%08d" % i: b"n" * 100 for i in range(500)})
        w0, b0 = _wchar(), s.bytes_written
        s.commit(0, delta)
        w1, b1 = _wchar(), s.bytes_written
        state_bytes = os.path.getsize(os.path.join(root, "local", "p0", "data.mdb"))
        delta_file = os.path.getsize(os.path.join(root, "durable", "p0", "delta-000000000000.arrow"))
        assert s.get(b"new:00000042") == b"n" * 100
        return b1 - b0, w1 - w0, state_bytes, delta_file
    finally:
        s.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
def test_bytes_written_per_commit_track_the_delta_not_the_state(tmp_path):
    small = _commit_cost(str(tmp_path / "small"), 10_000)
    big = _commit_cost(str(tmp_path / "big"), 1_000_000)
    for name, c in (("10k", small), ("1M", big)):
        print(f"{name} state: counted {c[0]} B, write(2) {c[1]} B, env file {c[2]} B, delta file {c[3]} B")
    assert big[2] > 50 * small[2] / 2  # the states really differ ~100x in size
    assert 0.8 < big[0] / small[0] < 1.25  # counted bytes: same delta, same cost
    assert 0.8 < big[3] / small[3] < 1.25  # the durable delta file does not depend on the state
    # bytes actually handed to write(2) (LMDB pages + delta file + manifest): B-tree pages touched by the
    # delta, a small fraction of the 1M-key state, never a copy of it
    assert big[1] < 0.1 * big[2]
    assert big[1] < 1000 * 3 * 4096


# -- reads never roll back (issue 9 item 2, repros/r7_read_state_truncates.py) --------------------------------
def test_state_read_of_an_older_epoch_never_rolls_back(tmp_path):
    """Epoch 1 is finalized on the partition but not yet recorded when a read of epoch 0 (the last recorded)
    runs its task: the read sees epoch 0's value and leaves the local and durable copies at epoch 1, so the
    next epoch's rounds find epoch 1 (before the fix the read truncated delta 1 and epoch 2 failed)."""
    from charon.runtime.spark.layout import executor_local_dir
    from charon.runtime.spark.tasks import read_entities

    ckpt = str(tmp_path / "ckpt")
    durable_root = os.path.join(ckpt, "state")
    root = executor_local_dir(None, ckpt)
    store = open_store(root, 0, durable_root)
    store.ensure_epoch(-1)
    k = store_key("a", "k")
    store.commit(0, {k: b"v0"})
    store.commit(1, {k: b"v1"})
    got = dict(read_entities("unused:app", None, durable_root, ckpt, 0, [(0, [k, store_key("a", "none")])]))
    assert got == {k: b"v0", store_key("a", "none"): None}
    assert store.epoch == 1 and DurableState(durable_root).manifest(0).epoch == 1
    store.ensure_epoch(1)  # epoch 2's first round
    assert store.get(k) == b"v1"
    shutil.rmtree(root, ignore_errors=True)


def test_read_at_catches_up_and_reads_older_epochs_from_the_durable_copy(dirs):
    make, local, dur = dirs
    d = DurableState(dur)
    writer = make()
    writer.ensure_epoch(-1)
    models = models_upto(5)
    for e in range(6):
        writer.commit(e, delta_of(e))
    keys = sorted({k for e in range(6) for k in delta_of(e)}) + [b"absent"]
    reader = make(local_path=local + "-reader")  # a fresh executor: catches up from the durable copy
    assert reader.read_at(3, keys) == {k: models[4].get(k) for k in keys}
    assert reader.epoch == 3
    for e in (2, 0, -1):  # the writer's copy is ahead: read as of e, nothing moves back
        assert writer.read_at(e, keys) == {k: models[e + 1].get(k) for k in keys}
        assert writer.epoch == 5 and d.manifest(0).epoch == 5
    d.compact(0, 4)
    with pytest.raises(StoreError, match="compacted"):
        writer.read_at(2, keys)
    assert writer.read_at(5, keys) == {k: models[6].get(k) for k in keys}
    assert reader.catch_up(1) == 3  # never backward
