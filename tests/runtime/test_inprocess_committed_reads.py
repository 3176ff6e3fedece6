"""Every read of committed output on the in-process runtime sees the last replied epoch, also while the service
loop has not yet run that epoch's deferred finalize (``InProcessRuntime._finish``).

The rule has one home: the ``stores`` and ``streams`` accessors run a pending finalize before handing anything
out. Each read path below (the runtime's accessors, inspect and SQL, an admin update's key listing, a
rescale, the next epoch's ``ctx`` reads, and the gateway's ``GET /state``, ``/streams``, ``/timers``,
``/admin/state`` and ``POST /admin/sql``) runs with a finalize pending and must see the write of the epoch
whose reply is out. A new public method must be classified here (a read path with its check, or not a read),
and only the engine's own methods may touch the unguarded ``_stores``/``_stream_log``."""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from charon import Application, Context, Operator, Request, serde
from charon.runtime.control.codeversions import ADMIN_PREFIX
from charon.runtime.node.inprocess import InProcessRuntime
from charon.server.gateway import create_app

TOKEN = "reads-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAR = 10_000_000.0  # a timer's delay: it never fires during the test

acct = Operator("acct")


@acct.function(public=True)
async def write(ctx: Context, n: int) -> int:
    """Set the value, an item, a timer and an event: every kind of committed output."""
    ctx.put(n)
    ctx.put_item("last", n)
    ctx.send_after(FAR, acct, ctx.key, write, n + 1)
    ctx.emit("writes", [ctx.key, n])
    return n


@acct.function(public=True)
async def read(ctx: Context) -> Any:
    """The committed value, as a transaction of the next epoch sees it."""
    return ctx.get()


@acct.function(public=True)
async def touch(ctx: Context) -> str:
    """An admin update's function: names the entity it ran on."""
    return ctx.key


app = Application("committed_reads", [acct])
_ids = itertools.count()
_clock = itertools.count(1)


def _pending(rt: InProcessRuntime, key: str, n: int) -> None:
    """One epoch writing ``n`` to a new entity ``key``, its reply delivered and its finalize left pending (as the
    service loop leaves it until the replies' waiters ran)."""
    res = rt._run_logged([Request(f"w{next(_ids)}", "acct", key, "write", serde.encode([n]))],
                         float(next(_clock)), defer=True)
    assert [serde.decode(r.value) for r in res.replies.values()] == [n]
    assert rt._unfinalized is not None, "the epoch's finalize is pending"


async def _http(rt: InProcessRuntime, method: str, path: str, body: Any = None) -> Any:
    transport = httpx.ASGITransport(app=create_app(rt, token=TOKEN))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        r = await client.request(method, path, headers=AUTH, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _sees(rt: InProcessRuntime, key: str, n: int) -> bool:
    return rt.read_state("acct", key) == n


async def _next_epoch_ctx(rt: InProcessRuntime, key: str, n: int) -> bool:
    res = rt._run_logged([Request(f"r{next(_ids)}", "acct", key, "read", serde.encode([]))], float(next(_clock)))
    return [serde.decode(r.value) for r in res.replies.values()] == [n]


async def _inspect(rt: InProcessRuntime, key: str, n: int) -> bool:
    _, rows = await rt.inspect("acct", [key])
    return serde.encode(n) in rows.values()


async def _sql(rt: InProcessRuntime, key: str, n: int) -> bool:
    out = await rt.sql(f"SELECT value FROM acct WHERE key = '{key}' AND item = ''")
    return out["rows"] == [[n]]


async def _run_alone(rt: InProcessRuntime, key: str, n: int) -> bool:
    uid = f"u{next(_ids)}"
    await rt.run_alone(uid, "acct", "touch")  # every entity of acct as of the boundary
    rep = rt.get_reply(f"{ADMIN_PREFIX}{uid}:{key}")
    return rep is not None and serde.decode(rep.value) == key


async def _rescale(rt: InProcessRuntime, key: str, n: int) -> bool:
    await rt.rescale(rt.partitions + 1)  # not serving: at once; re-places what the stores hold
    return rt._stores[0] is rt.stores[0] and _sees(rt, key, n)


async def _http_state(rt: InProcessRuntime, key: str, n: int) -> bool:
    return (await _http(rt, "GET", f"/state/acct/{key}"))["value"] == n


async def _http_stream(rt: InProcessRuntime, key: str, n: int) -> bool:
    events = (await _http(rt, "GET", "/streams/writes?from_offset=0&limit=1000"))["events"]
    return [key, n] in [e["value"] for e in events]


async def _http_timers(rt: InProcessRuntime, key: str, n: int) -> bool:
    timers = (await _http(rt, "GET", f"/timers/acct/{key}"))["timers"]
    return [t["args"] for t in timers] == [[n + 1]]


async def _http_admin_state(rt: InProcessRuntime, key: str, n: int) -> bool:
    doc = await _http(rt, "GET", f"/admin/state/acct?key={key}")
    return doc["entities"] == {key: n} and doc["items"] == {key: {"last": n}}


async def _http_admin_sql(rt: InProcessRuntime, key: str, n: int) -> bool:
    doc = await _http(rt, "POST", "/admin/sql", {"sql": f"SELECT value FROM acct WHERE key = '{key}' AND item = ''"})
    return doc["rows"] == [[n]]


Check = Callable[[InProcessRuntime, str, int], "bool | Awaitable[bool]"]

#: public read paths of committed output -> a check that the pending epoch's write is seen
READ_PATHS: dict[str, Check] = {
    "read_state": _sees,
    "read_items": lambda rt, k, n: rt.read_items("acct", k) == {"last": n},
    "timers": lambda rt, k, n: [serde.decode(t.args) for t in rt.timers("acct", k)] == [[n + 1]],
    "pending_timers": lambda rt, k, n: [k, n + 1] in [[t.key, *serde.decode(t.args)] for t in rt.pending_timers()],
    "entities": lambda rt, k, n: rt.entities("acct").get(k) == n,
    "snapshot": lambda rt, k, n: serde.encode(n) in rt.snapshot().values() and any(
        k.encode() in sk for sk in rt.snapshot()),
    "state_digest": lambda rt, k, n: rt.state_digest() == _digest_after_finish(rt),
    "streams": lambda rt, k, n: [k, n] in [serde.decode(e.value) for e in rt.streams.read("writes", 0, 1000).events],
    "stores": lambda rt, k, n: any(s.get(b"acct\x00" + k.encode() + b"\x00") == serde.encode(n) for s in rt.stores),
    "inspect": _inspect,
    "sql": _sql,
    "run_alone": _run_alone,
    "rescale": _rescale,
    "ctx reads (next epoch)": _next_epoch_ctx,
    "GET /state": _http_state,
    "GET /streams": _http_stream,
    "GET /timers": _http_timers,
    "GET /admin/state": _http_admin_state,
    "POST /admin/sql": _http_admin_sql,
}

#: public names of InProcessRuntime that read no committed state (or only replies, decided before the finalize)
NOT_READS = {
    "app", "partitions", "epoch_max_txns", "epoch_max_ms", "sizer", "gc_tuning", "gc_threshold", "warmup_txns",
    "node", "units", "coordinator", "epoch", "epoch_stats", "replayed_epochs", "failed", "rescale_pauses", "gate",
    "input_log", "durable", "close", "load", "load_items", "run_epoch", "drain", "start", "health", "stop",
    "get_reply", "enqueue", "submit", "submit_batch", "invoke", "subscribe", "update_code", "version_at",
    "code_update_modes", "pause", "resume", "control_status", "controller", "engine", "direct_enqueue", "backlog",
    "finish_lock", "retire_previous", "run_parked", "set_previous", "switch_app",
    "dead_letters", "in_engine", "verdict_book", "watchdog", "determinism_check",
    "inspector",  # the invocation inspector: records fed as replies go out (their reply, call graph), never state
    "fatal_callback",  # the on_fatal hook (charon run's exit), not state
    "declaring",  # the start's upserts of the schedules declared in code: a task, not state
    "effects_executor", "run_effects", "settle_effects",  # the in-process effect executor: its own store, not state
}
#: the engine's own methods, the only ones allowed the unguarded stores and stream log
ENGINE_ONLY = {"__init__", "_units", "_recover", "_probe", "_probe_run", "stores", "streams", "_stream_log",
               "_open_streams", "_rescale_now",
               "_run_logged", "_run_epoch_locked", "_finish", "_finalized", "close"}


def _digest_after_finish(rt: InProcessRuntime) -> str:
    rt._finish()
    return rt.state_digest()


def _public_names() -> set[str]:
    rt = InProcessRuntime(app, partitions=2, warmup_txns=0)
    return {n for n in set(dir(InProcessRuntime)) | set(vars(rt)) if not n.startswith("_")}


@pytest.mark.parametrize("path", list(READ_PATHS))
async def test_a_read_right_after_a_reply_sees_the_replied_epoch(path: str) -> None:
    rt = InProcessRuntime(app, partitions=2, warmup_txns=0)
    _pending(rt, "old", 1)
    rt._finish()
    _pending(rt, "fresh", 7)
    seen = READ_PATHS[path](rt, "fresh", 7)
    if inspect.isawaitable(seen):
        seen = await seen
    assert seen, f"{path} did not see the replied epoch's writes"
    assert rt._unfinalized is None


def test_every_public_name_is_a_classified_read_path_or_no_read() -> None:
    names = _public_names()
    tested = {p for p in READ_PATHS if p.isidentifier()}
    unknown = names - tested - NOT_READS
    assert not unknown, f"classify these in {__file__}: a read path (with a check) or not a read: {sorted(unknown)}"
    assert not tested - names and not NOT_READS - names, "stale names in the classification"


def test_only_the_engine_touches_the_unguarded_stores() -> None:
    src = textwrap.dedent(inspect.getsource(InProcessRuntime))
    tree = ast.parse(src)
    offenders = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or fn.name in ENGINE_ONLY:
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and node.attr in ("_stores", "_stream_log", "_streams"):
                offenders.append(f"{fn.name} uses self.{node.attr}")
    assert not offenders, offenders


def test_the_check_fails_when_a_read_bypasses_the_guard() -> None:
    """The checks above can fail: the unguarded stores miss the pending epoch's write."""
    rt = InProcessRuntime(app, partitions=2, warmup_txns=0)
    _pending(rt, "fresh", 7)
    raw = [s.get(b"acct\x00fresh\x00") for s in rt._stores]
    assert raw == [None, None]
    assert _sees(rt, "fresh", 7)
