"""DurableState: base + per-epoch deltas under a checkpoint directory (real files, no mocks)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from charon.state.durable import DurableState, DurableStateError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def apply(state: dict, delta: dict) -> dict:
    out = dict(state)
    for k, v in delta.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def test_load_merges_base_and_deltas_upto(tmp_path):
    d = DurableState(str(tmp_path))
    d.write_base(0, -1, [(b"a", b"1"), (b"b", b"2")])
    d.write_delta(0, 0, {b"a": None, b"c": b"3"})
    d.write_delta(0, 1, {b"b": b"22"})
    assert d.load(0) == ({b"b": b"22", b"c": b"3"}, 1)
    assert d.load(0, 0) == ({b"b": b"2", b"c": b"3"}, 0)
    assert d.load(0, -1) == ({b"a": b"1", b"b": b"2"}, -1)
    # asking beyond what was recorded reports the epoch actually reached
    assert d.load(0, 7) == ({b"b": b"22", b"c": b"3"}, 1)
    assert d.latest_epoch(0) == 1
    # partitions are independent
    assert d.load(1) == ({}, -1)
    assert d.latest_epoch(1) == -1


def test_write_delta_is_idempotent(tmp_path):
    d = DurableState(str(tmp_path))
    d.write_delta(0, 0, {b"k": b"first"})
    path = os.path.join(str(tmp_path), "p0", "delta-000000000000.arrow")
    st1 = os.stat(path)
    d.write_delta(0, 0, {b"k": b"second"})  # replayed epoch: a no-op
    assert d.load(0) == ({b"k": b"first"}, 0)
    assert os.stat(path).st_ino == st1.st_ino
    assert d.manifest(0).deltas == [0]


def test_empty_delta_advances_epoch_without_a_file(tmp_path):
    d = DurableState(str(tmp_path))
    d.write_delta(0, 0, {b"k": b"v"})
    d.write_delta(0, 1, {})
    d.write_delta(0, 2, {})
    assert d.latest_epoch(0) == 2
    assert d.files(0) == ["delta-000000000000.arrow"]
    assert d.load(0, 2) == ({b"k": b"v"}, 2)


def test_deltas_after_and_compaction(tmp_path):
    d = DurableState(str(tmp_path))
    d.write_base(0, -1, [(b"x", b"0")])
    for e in range(6):
        d.write_delta(0, e, {f"k{e}".encode(): str(e).encode(), b"x": None if e == 3 else b"%d" % e})
    got = d.deltas_after(0, 2, 4)
    assert got is not None
    deltas, reached = got
    assert [e for e, _ in deltas] == [3, 4] and reached == 4
    assert deltas[0][1] == {b"k3": b"3", b"x": None}

    before = d.load(0)
    assert d.compact(0, 3)
    m = d.manifest(0)
    assert m.base_epoch == 3 and m.deltas == [4, 5] and m.epoch == 5
    # superseded files are gone: one base and the two later deltas remain
    files = d.files(0)
    assert len(files) == 3 and files[0].startswith("base-000000000003-")
    assert d.load(0) == before
    assert d.deltas_after(0, 2, 5) is None  # compacted away: caller must reload fully
    assert d.deltas_after(0, 3, 5) is not None
    with pytest.raises(DurableStateError):
        d.load(0, 2)
    assert not d.compact(0, 3)  # nothing left to merge


def test_truncate_after(tmp_path):
    d = DurableState(str(tmp_path))
    for e in range(5):
        d.write_delta(0, e, {b"k": str(e).encode()})
    d.truncate_after(0, 2)
    assert d.latest_epoch(0) == 2
    assert d.load(0) == ({b"k": b"2"}, 2)
    assert d.files(0) == [f"delta-{e:012d}.arrow" for e in range(3)]
    d.write_delta(0, 3, {b"k": b"again"})  # the replayed epoch is recorded anew
    assert d.load(0) == ({b"k": b"again"}, 3)
    d.compact(0, 2)
    with pytest.raises(DurableStateError):
        d.truncate_after(0, 1)


keys = st.binary(min_size=0, max_size=4)
deltas_st = st.lists(st.dictionaries(keys, st.none() | st.binary(max_size=6), max_size=12), max_size=12)


def test_a_writer_of_an_older_gang_is_fenced_on_a_directory(tmp_path):
    """A resident gang claims its partitions (DurableState.claim) on a local directory as on object storage: a task
    of a lost gang (its own handle, as in its own process) that rewinds or writes after a newer gang claimed is
    refused, and the recorded epochs stay; the driver's unfenced compaction keeps the fence."""
    from charon.storage.contract import StorageConflict

    old = DurableState(str(tmp_path))
    old.claim(0, 10)
    for e in range(3):
        old.write_delta(0, e, {b"k": str(e).encode()})
    new = DurableState(str(tmp_path))
    assert new.claim(0, 20).epoch == 2
    new.write_delta(0, 3, {b"k": b"3"})
    with pytest.raises(StorageConflict):  # the zombie's rewind (ensure_epoch of an epoch it was sent)
        old.truncate_after(0, 0)
    with pytest.raises(StorageConflict):
        old.write_delta(0, 4, {b"k": b"zombie"})
    with pytest.raises(StorageConflict):  # a gang that starts late is refused at once
        DurableState(str(tmp_path)).claim(0, 15)
    assert new.load(0) == ({b"k": b"3"}, 3)
    assert sorted(n for n in os.listdir(tmp_path / "p0") if n.startswith("delta-")) == [
        f"delta-{e:012d}.arrow" for e in range(4)]
    driver = DurableState(str(tmp_path))
    driver.compact(0, 2)
    assert driver.manifest(0).fence == 20 and new.load(0) == ({b"k": b"3"}, 3)
    new.truncate_after(0, 2)  # the gang's own replay (the driver decided nothing after 2 is committed)
    assert new.load(0) == ({b"k": b"2"}, 2)


def test_open_store_gives_each_writer_generation_its_own_handle(tmp_path):
    """Two gangs' tasks in one process (the simulator's zombie) write through separate durable handles, so the
    older one stays fenced; a newer generation retires the older one's cached store."""
    from charon.state.lmdbstore import open_store

    durable = str(tmp_path / "durable")
    a = open_store(str(tmp_path / "local"), 0, durable, 10)
    assert open_store(str(tmp_path / "local"), 0, durable, 10) is a
    b = open_store(str(tmp_path / "local"), 0, durable, 20)
    assert b is not a and b.durable is not a.durable
    assert open_store(str(tmp_path / "local"), 0, durable, 10) is not a  # retired: a fresh handle, unclaimed
    assert open_store(str(tmp_path / "local"), 0, durable) is open_store(str(tmp_path / "local"), 0, durable)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.dictionaries(keys, st.binary(max_size=6), max_size=20),
    deltas=deltas_st,
    cuts=st.lists(st.integers(-1, 12), max_size=4),
)
def test_compaction_is_equivalent(base, deltas, cuts):
    with tempfile.TemporaryDirectory() as root:
        d = DurableState(root, fsync=False)
        d.write_base(0, -1, base.items())
        models = [base]
        for e, delta in enumerate(deltas):
            d.write_delta(0, e, delta)
            models.append(apply(models[-1], delta))
        last = len(deltas) - 1
        assert d.load(0) == (models[-1], last)
        for c in cuts:
            base_epoch = d.manifest(0).base_epoch
            d.compact(0, c)
            # every version at or after the base is still loadable and unchanged
            for e in range(max(base_epoch, d.manifest(0).base_epoch), last + 1):
                assert d.load(0, e) == (models[e + 1], e)
        assert d.load(0) == (models[-1], last)
        referenced = {d.manifest(0).base} | {f"delta-{e:012d}.arrow" for e in d.manifest(0).deltas}
        assert set(d.files(0)) <= referenced | {None}


# ---- crash safety: a writer SIGKILLed at random moments ---------------------------------------------

WORKER = r"""
import random, sys
from charon.state.durable import DurableState
root, seed = sys.argv[1], int(sys.argv[2])
def delta(e):
    r = random.Random(seed * 1_000_003 + e)
    return {b"k%05d" % r.randrange(20000): (None if r.random() < 0.1 else b"%d:%d" % (e, i))
            for i in range(r.randint(20, 200))}
d = DurableState(root)
e = d.latest_epoch(0) + 1
print("ready", flush=True)
while True:
    d.write_delta(0, e, delta(e))
    if e % 3 == 0:
        print("c", e, flush=True)
        d.compact(0, e - 1)
        print("d", e, flush=True)
    print("e", e, flush=True)
    e += 1
"""


def model_delta(seed: int, e: int) -> dict:
    r = random.Random(seed * 1_000_003 + e)
    return {b"k%05d" % r.randrange(20000): (None if r.random() < 0.1 else b"%d:%d" % (e, i))
            for i in range(r.randint(20, 200))}


def test_sigkill_during_deltas_and_compactions(tmp_path):
    root, seed = str(tmp_path), 7
    d = DurableState(root)
    base = {b"k%05d" % i: b"base" * 8 for i in range(0, 20000, 2)}
    d.write_base(0, -1, sorted(base.items()))
    models = [base]  # models[e + 1] = state after epoch e
    rng = random.Random(1)
    env = dict(os.environ, PYTHONPATH=ROOT)
    reached_prev, in_compaction, kills = -1, 0, 0
    for _ in range(15):
        p = subprocess.Popen([sys.executable, "-c", WORKER, root, str(seed)], stdout=subprocess.PIPE, env=env)
        assert p.stdout.readline().strip() == b"ready"
        # on a loaded machine an fsync can take long: kill only after this run committed something
        line = p.stdout.readline()
        while line and not line.startswith(b"e "):
            line = p.stdout.readline()
        assert line, "the worker died"
        time.sleep(rng.uniform(0.0, 0.3))
        p.send_signal(signal.SIGKILL)
        out = p.communicate()[0].split(b"\n")
        assert p.returncode == -signal.SIGKILL
        kills += 1
        lines = [ln for ln in out if ln]
        in_compaction += bool(lines) and lines[-1].startswith(b"c")
        state, reached = d.load(0)
        assert reached == d.latest_epoch(0) >= reached_prev
        while len(models) <= reached + 1:
            models.append(apply(models[-1], model_delta(seed, len(models) - 1)))
        assert state == models[reached + 1]
        reached_prev = reached
    assert kills >= 10
    assert reached_prev > 10, "the writer made progress between kills"
    print(f"{kills} kills, {in_compaction} during a compaction, reached epoch {reached_prev}")
    # debris of killed writers does not accumulate beyond temp files; a final compaction cleans the rest
    d.compact(0, reached_prev)
    names = os.listdir(os.path.join(root, "p0"))
    bases = [n for n in names if n.startswith("base-")]
    assert len(bases) == 1, names
    # a delta written after the last recorded epoch by a killed writer may remain: the replay of that
    # epoch overwrites it atomically, and nothing reads it before
    stray = [n for n in names if n.startswith("delta-")]
    assert all(int(n[6:18]) > reached_prev for n in stray), names
    assert d.load(0) == (models[reached_prev + 1], reached_prev)


COMPACTOR = r"""
import sys, time
from charon.state.durable import DurableState
d = DurableState(sys.argv[1])
print("ready", flush=True)
n = 0
deadline = time.time() + 60
while time.time() < deadline:
    n += d.compact(0, d.latest_epoch(0))
    if n >= 5 and d.latest_epoch(0) >= int(sys.argv[2]):
        break
print(n, flush=True)
"""


def test_compaction_in_another_process_races_with_writes(tmp_path):
    root, seed, last = str(tmp_path), 11, 80
    d = DurableState(root)
    d.write_base(0, -1, [(b"k%05d" % i, b"b") for i in range(0, 20000, 3)])
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-c", COMPACTOR, root, str(last)], stdout=subprocess.PIPE, env=env)
    assert p.stdout.readline().strip() == b"ready"
    model = d.load(0)[0]
    for e in range(last + 1):
        delta = model_delta(seed, e)
        d.write_delta(0, e, delta)
        model = apply(model, delta)
        if e % 10 == 0:
            assert d.load(0) == (model, e)  # readers retry when a compaction swaps files under them
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and int(out) >= 2, "the compactor ran concurrently more than once"
    assert d.load(0) == (model, last)
    assert d.manifest(0).base_epoch > 0


def test_a_fenced_delta_whose_write_fails_leaves_no_file_and_no_manifest_entry(tmp_path, monkeypatch):
    """Under a fence the delta is written straight to its name (no temporary file): a write that fails midway
    (disk full, an interrupt) removes the partial file and records nothing; the same epoch written again then
    succeeds and reads back whole."""
    from charon.state import durable as mod

    d = DurableState(str(tmp_path))
    d.claim(0, 7)
    d.write_delta(0, 1, {b"a": b"1"})
    real = mod._write_table

    def torn(f, rows, meta):
        f.write(b"partial arrow bytes")
        raise OSError("disk full")

    monkeypatch.setattr(mod, "_write_table", torn)
    with pytest.raises(OSError, match="disk full"):
        d.write_delta(0, 2, {b"b": b"2"})
    assert not os.path.exists(os.path.join(str(tmp_path), "p0", "delta-000000000002.arrow"))
    assert d.manifest(0).epoch == 1 and d.manifest(0).deltas == [1]
    monkeypatch.setattr(mod, "_write_table", real)
    d.write_delta(0, 2, {b"b": b"2"})
    assert d.manifest(0).epoch == 2
    assert d.holds(0, 7) and not d.holds(0, 8)
