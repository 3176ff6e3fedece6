"""Atomic output streams (issue 12 item 1), in-process: ``ctx.emit`` events commit with their transaction,
one atom per epoch and stream, in serial order; the stream log is idempotent across crashes."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.core.context import MAX_EMITS
from charon.errors import InvalidKey
from charon.log.streams import StreamLog
from charon.testing import check_epoch

TESTS = Path(__file__).resolve().parents[1] / "support"
sys.path.insert(0, str(TESTS))
from streams_app import app as ledger  # noqa: E402

# -- generated: random call graphs that emit, raise and conflict, checked against the serial oracle ----------
gen = Operator("g")
STREAMS = ["a", "b", "c.d"]


class Boom(Exception):
    pass


@gen.function
async def node(ctx: Context, plan: list) -> int:
    """Emits before and after its calls, writes depending on what it read, raises on a value."""
    thr, delta, fail_if, pre, post, children = plan
    x = ctx.get(default=0)
    for i, s in enumerate(pre):
        ctx.emit(s, [ctx.key, x, "pre", i])
    total = x
    if x > thr:
        ctx.put(x + delta)
    for mode, key, sub in children:
        if mode == "dyn":
            key = f"{key}{x % 2}"
        if mode in ("call", "dyn"):
            total += await ctx.call(gen, key, "node", sub)
        elif mode == "gather":
            total += sum(await ctx.gather(*(ctx.call(gen, k, "node", p) for k, p in sub)))
        else:
            ctx.send(gen, key, "node", sub)
    for i, s in enumerate(post):
        ctx.emit(s, {"k": ctx.key, "t": total, "i": i})
    if fail_if is not None and x == fail_if:
        raise Boom("b")
    if x <= thr and delta % 3 == 0:
        ctx.put(x + 1)
    return total


gen_app = Application("gen", [gen])
KEYS = [f"k{i}" for i in range(5)]


def _plan(rng: random.Random, depth: int, used: set) -> list:
    children: list = []
    if depth > 0:
        for _ in range(rng.randint(0, 2)):
            mode = rng.choice(["call", "call", "send", "dyn", "gather"])
            if mode == "gather":
                ks = [k for k in rng.sample(KEYS, 2) if k not in used]
                used.update(ks)
                children.append([mode, "", [[k, _plan(rng, depth - 1, used)] for k in ks]])
            else:
                k = rng.choice(KEYS)
                if k not in used:
                    used.add(k)
                    children.append([mode, k, _plan(rng, depth - 1, used)])
    emits = [lambda: [rng.choice(STREAMS) for _ in range(rng.randint(0, 2))] for _ in range(2)]
    return [rng.randint(-1, 4), rng.randint(1, 6), rng.choice([None, None, rng.randint(0, 6)]), emits[0](), emits[1](),
            children]


@pytest.mark.parametrize("seed", range(120))
def test_atoms_equal_the_serial_execution(seed: int) -> None:
    """Each epoch's atom equals the events of its committed transactions run serially in the reported
    order (aborted, deferred and re-run transactions contribute nothing), and the stream log holds
    exactly the concatenation of the atoms, per stream, with dense offsets."""
    rng = random.Random(seed)
    rt = InProcessRuntime(gen_app, partitions=rng.choice([1, 2, 3, 4]))
    rt.load("g", {k: rng.randint(0, 5) for k in KEYS})
    expected: dict[str, list[tuple[int, bytes]]] = {}
    n = 0
    results = []
    for _ in range(4):
        reqs = []
        for _ in range(rng.randint(1, 8)):
            n += 1
            k = rng.choice(KEYS)
            reqs.append(Request(f"r{n}", "g", k, "node", serde.encode([_plan(rng, 2, {k})]), ts=float(n)))
        before = rt.snapshot()
        results.append(rt.run_epoch(reqs))
        check_epoch(gen_app, before, rt.snapshot(), results[-1])
    while rt.coordinator.deferred:
        before = rt.snapshot()
        results.append(rt.run_epoch([]))
        check_epoch(gen_app, before, rt.snapshot(), results[-1])
    committed = {t for r in results for t, rep in r.replies.items() if rep.ok}
    for r in results:
        for tid, s, v in r.events:
            assert tid in committed and r.replies[tid].ok
            expected.setdefault(s, []).append((r.epoch, v))
    for s in STREAMS:
        got = rt.streams.read(s, 0, 10_000).events
        assert [(e.epoch, e.value) for e in got] == expected.get(s, [])
        assert [e.offset for e in got] == list(range(len(got)))
    rt.close()


def _ledger_requests(rng: random.Random, epoch: int, n: int) -> list[Request]:
    accts = [f"a{i}" for i in range(6)]
    out = []
    for i in range(n):
        src, dst = rng.sample(accts, 2)
        out.append(Request(f"e{epoch}-{i}", "acct", src, "transfer",
                           serde.encode([dst, rng.randint(1, 60), f"e{epoch}-{i}"]), float(epoch)))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_aborted_transactions_events_never_appear(seed: int) -> None:
    """Random transfers, many aborting on low balances: the payments and credits streams hold exactly the
    committed transfers, each once, in the epochs' serial order; money is conserved."""
    rng = random.Random(seed)
    rt = InProcessRuntime(ledger, partitions=rng.choice([1, 3]))
    rt.load("acct", {f"a{i}": 50 for i in range(6)})
    ok: list[str] = []
    aborted: set[str] = set()
    for e in range(6):
        res = rt.run_epoch(_ledger_requests(rng, e, rng.randint(5, 25)))
        for tid in res.order:
            rep = res.replies[tid]
            (ok.append if rep.ok else aborted.add)(rep.request_id)
    while rt.coordinator.deferred:
        for tid in (res := rt.run_epoch([])).order:
            rep = res.replies[tid]
            (ok.append if rep.ok else aborted.add)(rep.request_id)
    assert aborted and ok, "the workload must both commit and abort"
    payments = [serde.decode(e.value)["tag"] for e in rt.streams.read("payments", 0, 10_000).events]
    credits = [serde.decode(e.value)[0] for e in rt.streams.read("credits", 0, 10_000).events]
    assert payments == ok  # the serial order: epoch by epoch, by position
    assert credits == ok
    assert sum(rt.entities("acct").values()) == 300


def test_stream_log_atoms_offsets_and_idempotence(tmp_path: Path) -> None:
    log = StreamLog(tmp_path / "s.sqlite", durable=False)
    assert log.append_atom(0, [("x", b"1"), ("y", b"2"), ("x", b"3")])
    assert not log.append_atom(0, [("x", b"9")])  # a replayed epoch appends nothing
    assert log.append_atom(2, [("x", b"4")])
    assert not log.append_atom(1, [("x", b"8")])  # nor does an older one
    assert log.append_atom(3, [("x", b"5"), ("x", b"6"), ("x", b"7")])
    assert log.streams() == {"x": 6, "y": 1}
    assert log.atom_ends("x", 0) == [2, 3, 6]
    r = log.read("x", 0, max_events=2)  # whole atoms, up to the limit
    assert [e.value for e in r.events] == [b"1", b"3"] and r.next_offset == 2
    r = log.read("x", 2, max_events=2)  # the next atom fits, the one after would not
    assert [e.value for e in r.events] == [b"4"] and r.next_offset == 3
    r = log.read("x", 3, max_events=1)  # at least one whole atom, whatever its size
    assert [e.offset for e in r.events] == [3, 4, 5] and [e.epoch for e in r.events] == [3, 3, 3]
    r = log.read("x", 4)  # resuming inside an atom gives its rest
    assert [e.value for e in r.events] == [b"6", b"7"] and r.next_offset == 6 == r.end_offset
    assert log.read("x", 6).events == [] and log.read("nothing", 0).events == []
    assert not log.wait("x", 6, timeout=0.05) and log.wait("x", 5, timeout=0.05)
    with pytest.raises(InvalidKey):
        log.read("bad/name", 0)
    log.close()


def test_stream_log_retention_drops_whole_old_atoms(tmp_path: Path) -> None:
    log = StreamLog(tmp_path / "s.sqlite", durable=False, retain_events=4)
    for epoch, n in enumerate([2, 2, 3, 1, 6]):
        log.append_atom(epoch, [("x", bytes([epoch]))] * n)
        r = log.read("x", 0, 100)
        assert len(r.events) <= max(4, n) and r.events[-1].epoch == epoch
        assert r.first_offset == r.events[0].offset and r.end_offset == r.events[-1].offset + 1
    assert [e.epoch for e in log.read("x", 0, 100).events] == [4] * 6  # the newest atom stays whole
    assert log.end_offset("x") == 14
    log.close()


def test_invalid_stream_name_aborts_the_transaction() -> None:
    op = Operator("o")

    @op.function
    async def bad(ctx: Context, name: str) -> None:
        ctx.put(1)
        ctx.emit(name, 1)

    rt = InProcessRuntime(Application("o", [op]), partitions=1)
    res = rt.run_epoch([Request("r1", "o", "k", "bad", serde.encode(["no spaces"]), 0.0),
                        Request("r2", "o", "k2", "bad", serde.encode(["ok-name.1"]), 0.0)])
    reps = {r.request_id: r for r in res.replies.values()}
    assert not reps["r1"].ok and reps["r1"].error_type == "InvalidKey"
    assert reps["r2"].ok and [s for _, s, _ in res.events] == ["ok-name.1"]
    assert rt.read_state("o", "k") is None


def test_events_per_invocation_are_bounded() -> None:
    op = Operator("o")

    @op.function
    async def many(ctx: Context, n: int) -> None:
        for i in range(n):
            ctx.emit("s", i)

    rt = InProcessRuntime(Application("o", [op]), partitions=1)
    res = rt.run_epoch([Request("r1", "o", "k", "many", serde.encode([MAX_EMITS]), 0.0),
                        Request("r2", "o", "k2", "many", serde.encode([MAX_EMITS + 1]), 0.0)])
    reps = {r.request_id: r for r in res.replies.values()}
    assert reps["r1"].ok and len(res.events) == MAX_EMITS
    assert not reps["r2"].ok and reps["r2"].error_type == "CallGraphLimitExceeded"


async def test_subscribe_sees_atoms_as_they_commit() -> None:
    rt = InProcessRuntime(ledger, partitions=2, epoch_max_ms=0.5)
    rt.load("acct", {"a": 100, "b": 0})
    got: list = []

    async def consume() -> None:
        async for ev in rt.subscribe("credits", from_offset=1):
            got.append((ev.offset, serde.decode(ev.value)))
            if len(got) == 4:
                return

    async with rt:
        task = asyncio.create_task(consume())
        for i in range(5):
            await rt.invoke("acct", "a", "transfer", "b", 10, f"t{i}")
        await asyncio.wait_for(task, 10)
    assert got == [(i, [f"t{i}", "b", 10]) for i in range(1, 5)]


_CRASH_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/../runtime")
from streams_app import app
from test_streams import durable_epoch
from charon.runtime.node.inprocess import InProcessRuntime
rt = InProcessRuntime(app, partitions=3, data_dir=sys.argv[2], compact_every=2)
rt.load("acct", {f"a{i}": 50 for i in range(6)})
for e in range(6):
    rt.run_epoch(durable_epoch(e))
    rt.node.flush()
"""


def durable_epoch(e: int) -> list[Request]:
    """A fixed workload for the crash test (deterministic per epoch)."""
    return _ledger_requests(random.Random(e), e, 8)


@pytest.mark.parametrize("point", ["logged", "delta0", "record"])
def test_sigkill_of_the_durable_producer_keeps_each_atom_once(tmp_path: Path, point: str) -> None:
    """SIGKILL of a durable node at steps around epoch 3 (before it ran; its atom written but the checkpoint
    not; checkpointed): after recovery the streams equal an uninterrupted run's, each atom once."""
    env = {**os.environ, "CHARON_CRASH_AT": f"node:{point}:3"}
    p = subprocess.run([sys.executable, "-c", _CRASH_SCRIPT, str(TESTS), str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    ref = InProcessRuntime(ledger, partitions=3)
    ref.load("acct", {f"a{i}": 50 for i in range(6)})
    rt = InProcessRuntime(ledger, partitions=3, data_dir=str(tmp_path))
    try:
        assert rt.epoch == 4
        for e in range(4):
            ref.run_epoch(durable_epoch(e))
        for e in range(4, 6):
            ref.run_epoch(durable_epoch(e))
            rt.run_epoch(durable_epoch(e))
        for s in ("payments", "credits"):
            want = [(e.offset, e.epoch, e.value) for e in ref.streams.read(s, 0, 10_000).events]
            got = [(e.offset, e.epoch, e.value) for e in rt.streams.read(s, 0, 10_000).events]
            assert got == want and len(want) > 10
        assert rt.snapshot() == ref.snapshot()
    finally:
        rt.close()


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=25), retain=st.integers(1, 20),
       limit=st.integers(1, 12))
def test_stream_log_retention_and_reads_generated(sizes: list[int], retain: int, limit: int) -> None:
    """Random atom sizes and bounds: the retained events are a suffix of whole atoms, within the bound
    (or exactly the newest atom when it alone is larger), and paging from 0 returns each retained event
    once, in offset order, cut at atom boundaries."""
    with tempfile.TemporaryDirectory() as d:
        log = StreamLog(os.path.join(d, "s.sqlite"), durable=False, retain_events=retain)
        bounds = []
        end = 0
        for epoch, n in enumerate(sizes):
            assert log.append_atom(epoch, [("x", f"{epoch}.{i}".encode()) for i in range(n)])
            bounds.append((end, end + n))
            end += n
        ends = log.atom_ends("x", -1)
        first = log.read("x", 0, 1).first_offset
        assert first in {s for s, _ in bounds} and ends == [e for s, e in bounds if s >= first]
        kept = end - first
        assert kept <= retain or (len(ends) == 1 and kept == sizes[-1])
        off, seen = 0, []
        while off < end:
            page = log.read("x", off, limit)
            assert page.next_offset in ends and page.events
            seen += [e.offset for e in page.events]
            off = page.next_offset
        assert seen == list(range(first, end))
        log.close()


def test_a_copy_of_the_atoms_restores_the_same_offsets(tmp_path: Path) -> None:
    """``epoch_atoms`` reads the atoms after an epoch (None past its byte bound); ``put_atoms`` stores them in another
    log at their offsets, once per epoch, after a retention gap too, and never over events the log has."""
    from charon.log.streams import EpochAtoms

    src = StreamLog(tmp_path / "src.sqlite", retain_events=4)
    for epoch in (1, 2, 4, 7):
        src.append_atom(epoch, [("s", b"%d" % epoch), ("s", b"x"), *([("t", b"t")] if epoch != 2 else [])])
    atoms = src.epoch_atoms(-1, 1 << 20)
    assert atoms is not None and [a.epoch for a in atoms] == [1, 4, 7]  # 1 and 2 dropped from s by retention ...
    assert atoms[0] == EpochAtoms(1, [("t", 0, [b"t"])])
    assert atoms[1] == EpochAtoms(4, [("s", 4, [b"4", b"x"]), ("t", 1, [b"t"])])  # ... the offsets kept
    assert [a.epoch for a in src.epoch_atoms(4, 1 << 20) or []] == [7]
    assert src.epoch_atoms(-1, 7) is not None and src.epoch_atoms(-1, 6) is None and src.epoch_atoms(7, 0) == []
    dst = StreamLog(tmp_path / "dst.sqlite")
    assert dst.put_atoms(EpochAtoms(2, [("s", 2, [b"2", b"x"]), ("t", 0, [b"t"])]))
    assert [dst.put_atoms(a) for a in [EpochAtoms(1, []), *atoms, atoms[1]]] == [False, False, True, True, False]
    assert [(e.offset, e.epoch, e.value) for e in dst.read_range("s", 0, 10)] == [
        (2, 2, b"2"), (3, 2, b"x"), (4, 4, b"4"), (5, 4, b"x"), (6, 7, b"7"), (7, 7, b"x")]
    assert dst.streams() == src.streams() == {"s": 8, "t": 3}
    assert dst.append_atom(8, [("s", b"8")]) and dst.end_offset("s") == 9
    with pytest.raises(ValueError, match="inside the log"):
        dst.put_atoms(EpochAtoms(9, [("s", 5, [b"again"])]))
    assert dst.last_epoch() == 8  # the refused copy wrote nothing
