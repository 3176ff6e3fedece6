"""Entity keys, item names and operator names: one validator (charon.core.routing), applied by the engine's
request validation and by the context (repros r6_nul_keys and r8_long_key_poison)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.core.epoch import EpochCoordinator
from charon.core.partition import PartitionUnit
from charon.core.routing import (
    MAX_ITEM_BYTES,
    MAX_KEY_BYTES,
    MAX_OPERATOR_BYTES,
    STORE_KEY_LIMIT,
    check_item,
    check_key,
    check_operator_name,
    split_store_key,
    store_key,
)
from charon.errors import BadArguments, InvalidKey
from charon.runtime.node.inprocess import LocalExchange
from charon.state.durable import DurableState
from charon.state.lmdbstore import LmdbStore
from charon.testing import check_epoch

op = Operator("a")


@op.function
async def put(ctx: Context, v: int) -> int:
    ctx.put(v)
    return v


@op.function
async def items(ctx: Context) -> list:
    return ctx.scan_items()


@op.function
async def put_item(ctx: Context, name: str, v: int) -> None:
    ctx.put_item(name, v)


@op.function
async def put_char_item(ctx: Context, code: int) -> None:
    ctx.put_item(chr(code), 1)


@op.function
async def scan(ctx: Context, prefix: str) -> list:
    return ctx.scan_items(prefix)


@op.function
async def call_put(ctx: Context, key: str, v: int) -> int:
    ctx.put(v)  # must be rolled back with the whole transaction
    return await ctx.call(op, key, put, v)


@op.function
async def send_put(ctx: Context, key: str, v: int) -> None:
    ctx.put(v)
    ctx.send(op, key, put, v)


app = Application("keys", [op])


def req(rid: str, key: str, fn: str, *args: object, ts: float = 1.0) -> Request:
    return Request(rid, "a", key, fn, serde.encode(list(args)), ts=ts)


def test_nul_key_is_rejected_and_does_not_alias() -> None:
    """r6: entity "x\\0\\x01y" used to appear as an item of entity "x"."""
    rt = InProcessRuntime(app, partitions=1)
    before = rt.snapshot()
    res = rt.run_epoch([req("w", "x\0\x01y", "put", 42), req("r", "x", "items", ts=2.0)])
    by_rid = {r.request_id: r for r in res.replies.values()}
    assert not by_rid["w"].ok and by_rid["w"].error_type == "InvalidKey"
    assert by_rid["r"].ok and serde.decode(by_rid["r"].value) == []
    assert rt.entities("a") == {}
    check_epoch(app, before, rt.snapshot(), res)


@pytest.mark.parametrize(
    "key",
    ["k" * (MAX_KEY_BYTES + 1), "é" * (MAX_KEY_BYTES // 2 + 1), "bad\ud800", "", "nul\0"],
    ids=["long", "long-utf8", "surrogate", "empty", "nul"],
)
def test_invalid_request_keys_abort_before_running(key: str) -> None:
    rt = InProcessRuntime(app, partitions=2)
    res = rt.run_epoch([req("q", key, "put", 1)])
    (rep,) = res.replies.values()
    assert not rep.ok and rep.error_type == "InvalidKey", rep
    assert rt.entities("a") == {}


def test_long_key_never_reaches_lmdb_after_reply(tmp_path: os.PathLike[str]) -> None:
    """r8: a 600-byte key used to get an early reply and then fail the finalize round on LMDB, forever."""
    durable = DurableState(os.path.join(tmp_path, "state"))
    stores = [LmdbStore(os.path.join(tmp_path, "local"), p, durable) for p in range(2)]
    for s in stores:
        s.bulk_load(-1, [])
    sent: list = []
    for _attempt in (1, 2):  # the original run, then a replay of the same epoch
        units = [PartitionUnit(p, 2, app, s) for p, s in enumerate(stores)]
        coord = EpochCoordinator(app, LocalExchange(units), on_replies=sent.extend)
        coord.run_epoch(0, [(0, req("q", "k" * 600, "put", 1)), (0, req("ok", "fine", "put", 5))])
    assert {(r.request_id, r.ok, r.error_type) for r in sent} == {("q", False, "InvalidKey"), ("ok", True, "")}


@pytest.mark.parametrize(
    "fn,args",
    [
        ("put_item", ("x\0y", 1)),
        ("put_item", ("i" * (MAX_ITEM_BYTES + 1), 1)),
        ("put_char_item", (0xDCFF,)),
        ("scan", ("p\0",)),
        ("call_put", ("k" * 600, 1)),
        ("call_put", ("k\0", 1)),
        ("send_put", ("k\0\x01z", 1)),
    ],
    ids=["item-nul", "item-long", "item-surrogate", "scan-nul", "call-long", "call-nul", "send-nul"],
)
def test_bad_names_inside_functions_abort_the_transaction(fn: str, args: tuple) -> None:
    rt = InProcessRuntime(app, partitions=2)
    before = rt.snapshot()
    res = rt.run_epoch([req("q", "caller", fn, *args)])
    (rep,) = res.replies.values()
    assert not rep.ok and rep.error_type == "InvalidKey", rep
    assert rt.snapshot() == before
    check_epoch(app, before, rt.snapshot(), res)


def test_longest_valid_names_fit_lmdb(tmp_path: os.PathLike[str]) -> None:
    long_op = Operator("o" * MAX_OPERATOR_BYTES)

    @long_op.function
    async def fill(ctx: Context) -> None:
        ctx.put(1)
        ctx.put_item("i" * MAX_ITEM_BYTES, 2)

    lapp = Application("long", [long_op])
    durable = DurableState(os.path.join(tmp_path, "state"))
    store = LmdbStore(os.path.join(tmp_path, "local"), 0, durable)
    store.bulk_load(-1, [])
    sent: list = []
    coord = EpochCoordinator(lapp, LocalExchange([PartitionUnit(0, 1, lapp, store)]), on_replies=sent.extend)
    key = "é" * (MAX_KEY_BYTES // 2)
    coord.run_epoch(0, [(0, Request("q", long_op.name, key, "fill", serde.encode([]), ts=1.0))])
    assert [(r.ok, r.error_type) for r in sent] == [(True, "")]


def test_operator_names_are_bounded_at_definition() -> None:
    with pytest.raises(ValueError):
        Operator("o" * (MAX_OPERATOR_BYTES + 1))
    for bad in ("", "a/b", "a\0b", "\ud800"):
        with pytest.raises(ValueError):
            Operator(bad)


_text = st.text(st.characters(codec="utf-8"), max_size=80)


@given(_text, _text, _text)
def test_valid_names_make_unambiguous_store_keys_within_the_limit(o: str, k: str, i: str) -> None:
    try:
        check_operator_name(o)
        check_key(k)
        check_item(i)
    except InvalidKey:
        assert "\0" in o + k + i or "/" in o or not o or not k or len(o.encode()) > MAX_OPERATOR_BYTES
        return
    skey = store_key(o, k, "\x01" + i)
    assert len(skey) <= STORE_KEY_LIMIT
    assert split_store_key(skey) == (o, k, "\x01" + i)


def test_unserializable_return_values_abort_typed() -> None:
    deep_op = Operator("deep")

    @deep_op.function
    async def nest(ctx: Context, n: int) -> list:
        v: list = []
        for _ in range(n):
            v = [v]
        return v

    dapp = Application("deep", [deep_op])
    rt = InProcessRuntime(dapp, partitions=1)
    res = rt.run_epoch([Request("d", "deep", "k", "nest", serde.encode([5000]), ts=1.0)])
    (rep,) = res.replies.values()
    assert not rep.ok and rep.error_type == "SerializationError", rep


@op.function
async def call_coded(ctx: Context, codes: list, v: object) -> object:
    """Call ``put`` on the entity whose key has these code points (a key msgpack could not carry: surrogates)."""
    return await ctx.call(op, "".join(map(chr, codes)), put, v)


@op.function
async def call_raw(ctx: Context, key: object) -> object:
    return await ctx.call(op, key, put, 1)


_codes = st.lists(st.one_of(st.integers(32, 126), st.sampled_from([0, 1, 0xE9, 0x20AC, 0xD800, 0xDFFF, 0x1F600])),
                  max_size=4)
_keys = st.one_of(_codes, st.tuples(st.integers(MAX_KEY_BYTES - 2, MAX_KEY_BYTES + 1), _codes).map(
    lambda t: [ord("k")] * t[0] + t[1]))
_i64 = st.integers(-(2**63), 2**63 - 1)  # what msgpack carries
_values = st.one_of(_i64, st.booleans(), st.floats(allow_nan=False), st.text(max_size=3),
                    st.none(), st.lists(_i64, max_size=2))
_context_rt = InProcessRuntime(app, partitions=2)


def _outcome(fn: str, *args: object) -> tuple[bool, str]:
    (rep,) = _context_rt.run_epoch([req("q", "caller", fn, *args)]).replies.values()
    return rep.ok, rep.error_type


def _accepts(check: Any, *args: object) -> bool:
    try:
        check(*args)
    except (InvalidKey, BadArguments):
        return False
    return True


@given(_keys, _values)
def test_a_call_inside_a_function_accepts_exactly_what_the_validators_accept(codes: list, v: object) -> None:
    """``ctx.call`` and the coordinator's request validation check the key and the arguments through inline
    copies of the fast paths of :func:`check_key` and ``Function.check_args``; they must accept exactly what
    those accept (and the rest must raise the same typed error)."""
    key = "".join(map(chr, codes))
    key_ok, args_ok = _accepts(check_key, key), _accepts(app.resolve("a", "put").check_args, [v])
    expected = (True, "") if key_ok and args_ok else (False, "InvalidKey" if not key_ok else "BadArguments")
    assert _outcome("call_coded", codes, v) == expected, (key, v)
    # the coordinator's request validation has its own inline copies: a request straight to put
    (rep,) = _context_rt.run_epoch([req("q", key, "put", v)]).replies.values()
    assert (rep.ok, rep.error_type) == expected, (key, v)


@given(st.one_of(_i64, st.none(), st.lists(st.text(max_size=2), max_size=2), st.binary(max_size=3),
                 st.floats(allow_nan=False)))
def test_a_call_with_a_key_that_is_no_string_is_a_typed_error(key: object) -> None:
    ok, error = _outcome("call_raw", key)
    assert not ok and error == "InvalidKey", (key, error)
