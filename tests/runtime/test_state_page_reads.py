"""Paged state reads (:mod:`charon.runtime.control.reads`): pages in key order (UTF-8 bytes) across partitions, each
entity once, with a prefix, from the live stores and from the durable copy at an epoch (an older one compacted
away is EpochNotRetained); a page of the live stores pulls its own rows, not the operator's."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from charon import serde
from charon.core.routing import partition_of, store_key
from charon.runtime.contract import EpochNotRetained
from charon.runtime.control.reads import decode_entities, key_range, page_stores, read_durable, read_stores
from charon.state.durable import DurableState
from charon.state.store import MemoryStore

OP = "acct"
# \x01 and multi-byte characters: byte order, not code-unit order, and a key that is another's prefix
KEYS = st.text(alphabet="ab\x01\xe9\U0001f600z", min_size=1, max_size=5)
ITEMS = st.dictionaries(st.sampled_from("xy"), st.integers(0, 9))
ENTITIES = st.dictionaries(KEYS, st.tuples(st.integers(-99, 99), ITEMS), max_size=40)


def _rows(model: dict[str, tuple[int, dict[str, int]]], other: int = 0) -> dict[bytes, bytes]:
    rows = {}
    for key, (value, items) in model.items():
        rows[store_key(OP, key)] = serde.encode(value)
        for name, v in items.items():
            rows[store_key(OP, key, "\x01" + name)] = serde.encode(v)
    for key in "abcdefghij":  # another operator's rows are never shown
        rows[store_key("other", key)] = serde.encode(other)
    return rows


def _stores(rows: dict[bytes, bytes], partitions: int) -> list[MemoryStore]:
    stores = [MemoryStore() for _ in range(partitions)]
    deltas: list[dict[bytes, bytes | None]] = [{} for _ in range(partitions)]
    for k, v in rows.items():
        op, key, _ = k.decode().split("\0", 2)
        deltas[partition_of(op, key, partitions)][k] = v
    for s, d in zip(stores, deltas, strict=True):
        s.commit(0, d)
    return stores


def _expected(model: dict[str, tuple[int, dict[str, int]]], prefix: str) -> list[str]:
    return sorted((k for k in model if k.startswith(prefix)), key=lambda k: k.encode())


def _walk(read, limit: int, prefix: str) -> Iterator[list[str]]:
    """Every page's keys in order, following the last key of a full page (what the admin route's next is)."""
    after = None
    while True:
        got = read(limit + 1, after, prefix)
        keys = sorted(decode_entities(got, OP), key=lambda k: k.encode())
        yield keys[:limit]
        if len(keys) <= limit:
            return
        after = keys[limit - 1]


@settings(max_examples=60, deadline=None)
@given(model=ENTITIES, limit=st.integers(1, 7), partitions=st.integers(1, 4), prefix=st.sampled_from(["", "a", "\xe9"]))
def test_live_pages_cover_every_entity_once_in_byte_order(model, limit, partitions, prefix) -> None:
    stores = _stores(_rows(model), partitions)
    pages = list(_walk(lambda n, after, p: read_stores(stores, OP, None, n, after, p), limit, prefix))
    flat = [k for page in pages for k in page]
    assert flat == _expected(model, prefix)
    assert all(len(p) == limit for p in pages[:-1])
    whole = decode_entities(read_stores(stores, OP, None, 10_000, None, prefix), OP)
    assert {k: (e["value"], e["items"]) for k, e in whole.items()} == {
        k: v for k, v in model.items() if k.startswith(prefix)}


@settings(max_examples=30, deadline=None)
@given(model=ENTITIES, later=ENTITIES, dropped=st.sets(KEYS, max_size=10), limit=st.integers(1, 7),
       prefix=st.sampled_from(["", "b"]))
def test_durable_pages_at_each_epoch_and_a_compacted_one_is_not_retained(model, later, dropped, limit,
                                                                         prefix) -> None:
    parts = 2
    new = {k: v for k, v in {**model, **later}.items() if k not in dropped}
    before, after_rows = _rows(model), _rows(new, other=1)  # epoch 1 writes in every partition
    with tempfile.TemporaryDirectory() as root:
        d = DurableState(root, fsync=False)
        for pid in range(parts):
            mine = {k: v for k, v in before.items() if partition_of(*k.decode().split("\0")[:2], parts) == pid}
            d.write_base(pid, 0, sorted(mine.items()))
            delta: dict[bytes, bytes | None] = {}
            for k in set(before) | set(after_rows):
                if partition_of(*k.decode().split("\0")[:2], parts) == pid and before.get(k) != after_rows.get(k):
                    delta[k] = after_rows.get(k)  # None: a delete
            d.write_delta(pid, 1, delta)
        for epoch, m in ((0, model), (1, new)):
            pages = list(_walk(lambda n, a, p, e=epoch: read_durable(d, parts, OP, e, None, n, a, p), limit, prefix))
            assert [k for page in pages for k in page] == _expected(m, prefix), epoch
        assert all(d.compact(pid, 1) for pid in range(parts))
        with pytest.raises(EpochNotRetained):
            read_durable(d, parts, OP, 0, None, limit, None, prefix)


class _Counting(MemoryStore):
    """A live store that counts the rows a read pulled from it."""

    pulled = 0

    def range(self, lo: bytes, hi: bytes) -> Iterator[tuple[bytes, bytes]]:
        for row in super().range(lo, hi):
            _Counting.pulled += 1
            yield row


@settings(max_examples=40, deadline=None)
@given(model=ENTITIES, max_bytes=st.integers(1, 120), partitions=st.integers(1, 3))
def test_a_page_holds_at_most_max_bytes_of_rows_and_paging_still_covers_every_entity(model, max_bytes,
                                                                                      partitions) -> None:
    stores = _stores(_rows(model), partitions)
    seen: list[str] = []
    after = None
    while True:
        rows, more = page_stores(stores, OP, 1000, after, "", max_bytes)
        keys = sorted(decode_entities(rows, OP), key=lambda k: k.encode())
        size = sum(len(k) + len(v) for k, v in rows.items())
        assert size <= max_bytes or len(keys) == 1, (size, keys)  # a bigger entity comes alone
        seen += keys
        if not more:
            break
        assert keys, "a page stopped by its bytes holds at least one entity"
        after = keys[-1]
    assert seen == _expected(model, "")


def test_a_live_page_pulls_its_own_rows_not_the_operators() -> None:
    n, partitions, limit = 40_000, 4, 10
    stores = [_Counting() for _ in range(partitions)]
    deltas: list[dict[bytes, bytes | None]] = [{} for _ in range(partitions)]
    for i in range(n):
        key = f"k{i:06d}"
        deltas[partition_of(OP, key, partitions)][store_key(OP, key)] = serde.encode(i)
    for s, d in zip(stores, deltas, strict=True):
        s.commit(0, d)
    _Counting.pulled = 0
    got = decode_entities(read_stores(stores, OP, None, limit + 1, "k020000", ""), OP)
    assert sorted(got) == [f"k{i:06d}" for i in range(20_001, 20_001 + limit + 1)]
    assert _Counting.pulled <= limit + 1 + 2 * partitions, _Counting.pulled  # the page, one look-ahead a partition


def test_key_range_bounds() -> None:
    lo, hi = key_range(OP, "ab", "a")
    assert lo == b"acct\0ab\x01" and hi == b"acct\0b"
    assert key_range(OP, None, "") == (b"acct\0", b"acct\x01")
    assert key_range(OP, "a", "b")[0] == b"acct\0b"  # after sorts before the prefix: the prefix's first key


def test_durable_pages_across_the_record_batches_of_a_big_base(tmp_path) -> None:
    n = 70_000  # more than one record batch (BATCH_ROWS) in the base file
    d = DurableState(str(tmp_path), fsync=False)
    d.write_base(0, 0, sorted((store_key(OP, f"k{i:06d}"), serde.encode(i)) for i in range(n)))
    d.write_delta(0, 1, {store_key(OP, "k065535"): None, store_key(OP, "k065536x"): serde.encode(-1),
                         store_key(OP, "k065537"): serde.encode(7)})
    got = decode_entities(read_durable(d, 1, OP, 1, None, 5, "k065534", ""), OP)
    assert sorted(got) == ["k065536", "k065536x", "k065537", "k065538", "k065539"]
    assert got["k065536x"]["value"] == -1 and got["k065537"]["value"] == 7
    before = decode_entities(read_durable(d, 1, OP, 0, None, 3, "k065534", ""), OP)
    assert {k: e["value"] for k, e in before.items()} == {"k065535": 65535, "k065536": 65536, "k065537": 65537}
