"""Generated applications for testing the engine against the serial oracle (hypothesis and seeded).

The application is fixed and importable (``charon.testing.workloads:app``, so Spark workers and the simulator can
load it); what varies is the *program* each transaction runs. ``node.run(err, prog)`` interprets ``prog``, a
list of ops, through its context: reads, state-dependent writes and aborts, calls whose target is chosen
from state, calls created early and awaited late (in any order), sends, gathers, ``ctx.random()`` and
``ctx.now()`` decisions, item writes and scans, re-entrant calls to the caller's own entity, and a caller
catching its callee's exception (the engine aborts the whole transaction: any raise aborts).

Concurrency discipline (so every program has one serial meaning): code on the synchronous chain (the
root, its synchronous callees, calls created early) may read and write anything except the counter items
``c*``; concurrently running branches (sends, gathered calls and everything they call) only add to counter
items (one atomic read-modify-write, which commutes), raise on ``ctx.random()`` and make further
concurrent calls. Counters are read only by a transaction's root before it calls anything (``["scan_all"]``),
so every value a program sees is defined by the serial order.

:func:`programs`, :func:`transactions`, :func:`workloads` are hypothesis strategies;
:func:`random_workload` draws the same shapes from a seeded ``random.Random`` (the simulator's path).
"""

from __future__ import annotations

import contextlib
import random as _random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from charon import serde
from charon.core.context import Context
from charon.messages import Request
from charon.operator import Application, Operator

node = Operator("node")


class Boom(Exception):
    """Generated abort (type 0)."""


class Overdrawn(Exception):
    """Generated abort (type 1)."""


class Rejected(ValueError):
    """Generated abort (type 2)."""


ERRORS: tuple[type[Exception], ...] = (Boom, Overdrawn, Rejected)
KEYS = ("a", "b", "c", "d")
ITEMS = ("i0", "i1", "i2")
COUNTERS = ("c0", "c1")
TIMES = (1.0, 2.0, 3.0)


def _num(x: Any) -> int:
    """A small deterministic number summarizing a reply (ints summed, lists recursively)."""
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, int):
        return x
    if isinstance(x, list):
        return sum(_num(y) for y in x)
    return 0


class _Interp:
    """Executes one program through a context; ``v`` is the register decisions depend on."""

    def __init__(self, ctx: Context, err: int) -> None:
        self.ctx, self.err, self.v = ctx, err, 0
        self.out: list = []

    def fail(self, why: str) -> Exception:
        return ERRORS[self.err % len(ERRORS)](f"{self.ctx.key}: {why}")

    async def block(self, ops: list) -> None:
        for op in ops:
            await self.step(op)

    async def step(self, op: list) -> None:  # noqa: C901 - one branch per op
        ctx, kind = self.ctx, op[0]
        if kind == "get":
            self.v = ctx.get(default=0)
            self.out.append(self.v)
        elif kind == "put":
            ctx.put(self.v + op[1])
            ctx.emit("puts", [ctx.key, self.v + op[1]])  # every program's events: the oracle checks each atom
        elif kind == "del":
            ctx.delete()
        elif kind == "put_if":
            if self.v > op[1]:
                ctx.put(self.v + op[2])
        elif kind == "raise_if":
            if self.v > op[1]:
                raise self.fail(f"{self.v} > {op[1]}")
        elif kind == "iget":
            self.v = ctx.get_item(op[1], 0)
            self.out.append(self.v)
        elif kind == "iput":
            ctx.put_item(op[1], self.v + op[2])
        elif kind == "idel":
            ctx.delete_item(op[1])
        elif kind == "scan":
            got = ctx.scan_items("i", op[1], op[2])
            self.v = sum(_num(x) for _, x in got)
            self.out.append([n for n, _ in got])
        elif kind == "scan_all":  # root only, before any call: counters included
            self.out.append(ctx.scan_items())
        elif kind == "add":  # the one op concurrent branches may write with: an atomic increment
            ctx.put_item(op[1], ctx.get_item(op[1], 0) + op[2])
            ctx.emit("adds", [ctx.key, op[1], op[2]])
        elif kind == "raise_r":
            if ctx.random() < op[1]:
                raise self.fail("random")
        elif kind == "call":
            self.took(await ctx.call(node, op[1], "run", self.err, op[2]))
        elif kind == "dcall":  # the target depends on the state read
            keys = op[1]
            self.took(await ctx.call(node, keys[self.v % len(keys)], "run", self.err, op[2]))
        elif kind == "early":  # created, then other work, then awaited
            c = ctx.call(node, op[1], "run", self.err, op[2])
            await self.block(op[3])
            self.took(await c)
        elif kind == "early2":  # two created, other work, awaited in order or reversed
            c1 = ctx.call(node, op[1], "run", self.err, op[2])
            c2 = ctx.call(node, op[3], "run", self.err, op[4])
            await self.block(op[5])
            if op[6]:
                r2 = await c2
                r1 = await c1
            else:
                r1 = await c1
                r2 = await c2
            self.took([r1, r2])
        elif kind == "send":
            ctx.send(node, op[1], "run", self.err, op[2])
        elif kind == "timer":  # a delayed call: its own transaction once the epoch's time passes
            self.out.append(ctx.send_after(op[1], node, op[2], "run", self.err, op[3]))
        elif kind == "gather":
            self.took(await ctx.gather(*(ctx.call(node, k, "run", self.err, p) for k, p in op[1])))
        elif kind == "try":  # catching a callee's exception: the engine aborts anyway
            try:
                self.took(await ctx.call(node, op[1], "run", self.err, op[2]))
            except Exception:  # noqa: BLE001 - the point of the op
                self.out.append("caught")
        elif kind == "rand":
            await self.block(op[2] if ctx.random() < op[1] else op[3])
        elif kind == "now":
            await self.block(op[2] if ctx.now() > op[1] else op[3])
        else:  # pragma: no cover - generator bug
            raise AssertionError(f"unknown op {op!r}")

    def took(self, reply: Any) -> None:
        self.out.append(reply)
        self.v = (self.v + _num(reply)) % 97


@node.function
async def run(ctx: Context, err: int, prog: list) -> list:
    """Interpret ``prog`` on this entity; returns what it observed."""
    it = _Interp(ctx, err)
    await it.block(prog)
    return it.out


app = Application("workloads", [node])

# -- program shapes ------------------------------------------------------------------------------------------
#: Program features; a generator can be restricted to a subset (e.g. to isolate a defect).
FEATURES = frozenset({"early", "early2", "try", "send", "gather", "dcall", "rand", "now", "scan", "items", "del"})
#: Opt-in program features (not in FEATURES, so that the default generators draw as before).
OPTIONAL_FEATURES = frozenset({"timer"})


@dataclass
class Shape:
    """Bounds of generated programs."""

    depth: int = 3
    ops: int = 4
    features: frozenset[str] = FEATURES
    keys: tuple[str, ...] = KEYS
    extra: dict = field(default_factory=dict)


class _Source:
    """Choice source: hypothesis ``draw`` or a seeded ``random.Random`` behind one interface."""

    def __init__(self, draw: Any = None, rng: _random.Random | None = None) -> None:
        self.draw, self.rng = draw, rng

    def int(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi)) if self.draw else self.rng.randint(lo, hi)  # type: ignore[union-attr]

    def pick(self, seq: Any) -> Any:
        seq = list(seq)
        return self.draw(st.sampled_from(seq)) if self.draw else self.rng.choice(seq)  # type: ignore[union-attr]


def _sync_prog(src: _Source, shape: Shape, depth: int, root: bool = False, ro: bool = False) -> list:
    """A program for the synchronous chain; ``ro``: reads only (with calls to read-only programs)."""
    f = shape.features
    if ro:
        kinds = ["get", "get", "iget", "raise_if"] + (["scan"] if "scan" in f else [])
        kinds += ["call"] * (depth > 0)
        return [_sync_op(src, shape, depth, src.pick(kinds), ro) for _ in range(src.int(1, shape.ops))]
    kinds = ["get", "get", "put", "put_if", "put_if", "raise_if", "add", "iget", "iput"]
    if "del" in f:
        kinds += ["del", "idel"]
    if "scan" in f:
        kinds.append("scan")
    if depth > 0:
        kinds += ["call", "call"]
        kinds += [k for k in ("early", "early2", "try", "send", "gather", "dcall", "rand", "now", "timer") if k in f]
    ops: list = []
    if root and src.int(0, 3) == 0:
        ops.append(["scan_all"])
    for _ in range(src.int(0, shape.ops)):
        ops.append(_sync_op(src, shape, depth, src.pick(kinds)))
    return ops


def _sync_op(src: _Source, shape: Shape, depth: int, kind: str, ro: bool = False) -> list:
    key = lambda: src.pick(shape.keys)  # noqa: E731
    if kind in ("get", "del"):
        return [kind]
    if kind == "put":
        return ["put", src.int(-2, 5)]
    if kind == "put_if":
        return ["put_if", src.int(0, 6), src.int(1, 5)]
    if kind == "raise_if":
        return ["raise_if", src.int(3, 12)]
    if kind == "add":
        return ["add", src.pick(COUNTERS), src.int(1, 3)]
    if kind in ("iget", "idel"):
        return [kind, src.pick(ITEMS)]
    if kind == "iput":
        return ["iput", src.pick(ITEMS), src.int(0, 4)]
    if kind == "scan":
        bounds = [None, *ITEMS]
        return ["scan", src.pick(bounds), src.pick(bounds)]
    sub = lambda: _sync_prog(src, shape, depth - 1, ro=ro)  # noqa: E731
    if kind == "call":
        return ["call", key(), sub()]
    if kind == "dcall":
        return ["dcall", [key() for _ in range(src.int(1, 3))], sub()]
    if kind == "try":
        return ["try", key(), sub()]
    between = lambda: [_sync_op(src, shape, 0, src.pick(["get", "put", "iget", "iput", "send", "add"]))  # noqa: E731
                       for _ in range(src.int(0, 3))] if "send" in shape.features else []
    if kind == "early":
        return ["early", key(), sub(), between()]
    if kind == "early2":
        return ["early2", key(), sub(), key(), sub(), between(), src.int(0, 1)]
    if kind == "send":
        return ["send", key(), _conc_prog(src, shape, depth - 1)]
    if kind == "gather":
        return ["gather", [[key(), _conc_prog(src, shape, depth - 1)] for _ in range(src.int(1, 3))]]
    if kind == "rand":
        return ["rand", src.pick([0.3, 0.5, 0.7]), sub(), sub()]
    if kind == "now":
        return ["now", src.pick([1.5, 2.5]), sub(), sub()]
    if kind == "timer":
        return ["timer", src.pick([0.0, 1.0]), key(), sub()]
    raise AssertionError(kind)


def _conc_prog(src: _Source, shape: Shape, depth: int) -> list:
    """A program safe to run concurrently with others of its transaction (see the module docstring)."""
    kinds = ["add", "add", "raise_r"]
    if depth > 0:
        kinds += [k for k in ("send", "gather") if k in shape.features] + ["call"]
        if "rand" in shape.features:
            kinds.append("rand")
    ops: list = []
    for _ in range(src.int(0, 3)):
        kind = src.pick(kinds)
        if kind == "add":
            ops.append(["add", src.pick(COUNTERS), src.int(1, 3)])
        elif kind == "raise_r":
            ops.append(["raise_r", src.pick([0.05, 0.2])])
        elif kind in ("send", "call"):
            ops.append([kind, src.pick(shape.keys), _conc_prog(src, shape, depth - 1)])
        elif kind == "gather":
            ops.append(["gather", [[src.pick(shape.keys), _conc_prog(src, shape, depth - 1)]
                                   for _ in range(src.int(1, 3))]])
        else:
            ops.append(["rand", 0.5, _conc_prog(src, shape, depth - 1), _conc_prog(src, shape, depth - 1)])
    return ops


@dataclass
class Workload:
    """Initial state and epochs of transactions ``(key, err, prog, ts)``; plus the run's placement."""

    initial: dict[str, int]
    items: dict[str, dict[str, int]]
    epochs: list[list[tuple[str, int, list, float]]]
    partitions: int = 2
    live: bool = True

    def requests(self, epoch: int, prefix: str = "") -> list[Request]:
        return [Request(f"{prefix}e{epoch}t{i}", "node", k, "run", serde.encode([err, prog]), ts=ts)
                for i, (k, err, prog, ts) in enumerate(self.epochs[epoch])]

    def initial_state(self) -> list[tuple[str, str, Any]]:
        """(key, item, value) rows: item ``""`` is the main value."""
        rows = [(k, "", v) for k, v in self.initial.items()]
        rows += [(k, name, v) for k, its in self.items.items() for name, v in its.items()]
        return rows


def _root_prog(src: _Source, shape: Shape) -> list:
    """A transaction's program: a query, a query that writes only if what it read says so, or anything."""
    mode = src.int(0, 4)
    if mode == 0:
        return _sync_prog(src, shape, shape.depth, True, ro=True)
    if mode == 1:
        return [*_sync_prog(src, shape, shape.depth, True, ro=True), _sync_op(src, shape, 0, "put_if")]
    return _sync_prog(src, shape, shape.depth, True)


def _workload(src: _Source, shape: Shape, epochs: tuple[int, int], txns: tuple[int, int]) -> Workload:
    initial = {k: src.int(0, 9) for k in shape.keys if src.int(0, 2)}
    items = {k: {n: src.int(0, 5) for n in ITEMS if src.int(0, 1)} for k in shape.keys if src.int(0, 2) == 0}
    eps = []
    for _ in range(src.int(*epochs)):
        eps.append([(src.pick(shape.keys), src.int(0, len(ERRORS) - 1), _root_prog(src, shape), src.pick(TIMES))
                    for _ in range(src.int(*txns))])
    return Workload(initial, items, eps, src.pick([1, 2, 4]), bool(src.int(0, 1)))


@st.composite
def programs(draw: Any, shape: Shape = Shape()) -> list:
    """A root program."""
    return _sync_prog(_Source(draw), shape, shape.depth, True)


@st.composite
def workloads(draw: Any, shape: Shape = Shape(), epochs: tuple[int, int] = (1, 3),
              txns: tuple[int, int] = (1, 8)) -> Workload:
    """Initial state, epochs of transactions, partitions (1/2/4) and live coroutines on/off."""
    return _workload(_Source(draw), shape, epochs, txns)


def random_workload(rng: _random.Random, shape: Shape = Shape(), epochs: tuple[int, int] = (1, 3),
                    txns: tuple[int, int] = (1, 8)) -> Workload:
    """The same distribution as :func:`workloads`, from a seeded generator."""
    return _workload(_Source(rng=rng), shape, epochs, txns)


#: Settings for CI: derandomized (the same examples every run), no per-example deadline.
CI = settings(deadline=None, derandomize=True, max_examples=1000, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("charon-ci", CI)


# -- the engine's abort rule in the oracle ----------------------------------------------------------------------


def oracle_aborts_caught_callee() -> bool:
    """Whether ``charon.testing``'s oracle already aborts when a caller catches its callee's exception."""
    from charon.testing import oracle

    req = Request("probe", "node", "a", "run", serde.encode([0, [["try", "b", [["raise_if", -1]]]]]), ts=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ok, _ = oracle.serial_execute(app, {}, 1, req)
    return not ok


@contextlib.contextmanager
def engine_abort_rule() -> Iterator[None]:
    """While active, silence the oracle's diagnostic for a caught callee error: the generated programs catch
    callee errors on purpose (``charon.testing`` itself models the engine's abort rule)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*caught a callee's exception")
        yield



def load(rt: Any, w: Workload) -> None:
    """Install a workload's initial state into an in-process runtime."""
    rt.load(node, w.initial)
    for k, its in w.items.items():
        rt.load_items(node, k, its)


def check_inprocess(w: Workload, max_drain: int = 20) -> list:
    """Run ``w`` on the in-process runtime, checking every epoch against the serial oracle and, across
    epochs, that every request is accounted for exactly once (committed, aborted, or deferred and finished
    later), that the replies delivered through the runtime's reply path equal the epochs' results, and that
    the final state equals serial execution of the reported order. Returns the epoch results."""
    from charon.core import partition

    saved = partition.KEEP_LIVE_COROUTINES
    partition.KEEP_LIVE_COROUTINES = w.live
    try:
        with engine_abort_rule():
            return _check_inprocess(w, max_drain)
    finally:
        partition.KEEP_LIVE_COROUTINES = saved


def _check_inprocess(w: Workload, max_drain: int) -> list:
    from charon.runtime.node.inprocess import InProcessRuntime
    from charon.testing.oracle import check_epoch, serial_execute

    rt = InProcessRuntime(app, partitions=w.partitions)
    load(rt, w)
    delivered: dict[str, Any] = {}
    deliver = rt.coordinator.on_replies

    def on_replies(replies: list) -> None:
        for r in replies:
            assert r.request_id not in delivered, f"{r.request_id} delivered twice: {delivered[r.request_id]}, {r}"
            delivered[r.request_id] = r
        assert deliver is not None
        deliver(replies)

    rt.coordinator.on_replies = on_replies
    oracle = rt.snapshot()
    submitted: set[str] = set()
    accounted: dict[str, Any] = {}
    results = []
    e = 0
    while e < len(w.epochs) or rt.coordinator.deferred:
        assert e < len(w.epochs) + max_drain, f"deferred transactions never finish: {rt.coordinator.deferred}"
        reqs = w.requests(e) if e < len(w.epochs) else []
        submitted.update(r.request_id for r in reqs)
        waiting = {r.request_id for _, r in rt.coordinator.deferred}
        before = rt.snapshot()
        res = rt.run_epoch(reqs)
        results.append(res)
        check_epoch(app, before, rt.snapshot(), res)
        ran = {r.request_id for r in res.requests.values()}
        assert waiting <= ran, f"epoch {e}: deferred requests lost: {waiting - ran}"
        for tid in res.order:
            rid = res.requests[tid].request_id
            assert rid not in accounted, f"{rid} has two outcomes"
            accounted[rid] = res.replies[tid]
            ok, out = serial_execute(app, oracle, tid, res.requests[tid])
            assert ok == res.replies[tid].ok, f"cumulative oracle: {rid} engine {res.replies[tid]} oracle {out!r}"
        for tid in res.deferred:
            assert res.requests[tid].request_id not in accounted, f"tid {tid} deferred after an outcome"
        assert sorted(res.deferred) == sorted(t for t, _ in rt.coordinator.deferred)
        e += 1
    assert set(accounted) == submitted, f"unaccounted: {submitted - set(accounted)}"
    assert delivered == accounted, "replies delivered through the runtime differ from the epochs' results"
    for rid, rep in accounted.items():
        assert rt.get_reply(rid) == rep
    assert rt.snapshot() == dict(sorted(oracle.items())), "final state differs from serial execution"
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m charon.testing.workloads --seeds N [--start S]``: seeded workloads checked in-process; ``--seed N``
    shows one workload and its outcome. A failure prints one line that reproduces it."""
    import argparse
    import time

    ap = argparse.ArgumentParser(prog="python -m charon.testing.workloads", description=main.__doc__)
    ap.add_argument("--seeds", type=int, default=1000)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args(argv)
    seeds = [a.seed] if a.seed is not None else range(a.start, a.start + a.seeds)
    failed, t0 = 0, time.perf_counter()
    for seed in seeds:
        w = random_workload(_random.Random(seed))
        if a.seed is not None:
            print(repr(w))
        try:
            check_inprocess(w)
        except AssertionError as exc:
            failed += 1
            msg = " ".join(str(exc).split())[:300]
            print(f"FAIL seed {seed}: {msg} | reproduce: python -m charon.testing.workloads --seed {seed}", flush=True)
    print(f"{len(seeds)} workloads: {failed} failed, {time.perf_counter() - t0:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
