"""Consistent state reads for the control surface: an operator's rows from the live stores at an epoch boundary
(:func:`read_stores`) or from the durable copy as of one epoch (:func:`read_durable`: every partition at the same
epoch, never mixing two; an epoch older than the durable copy's base is refused with :class:`EpochNotRetained`).

A read of every entity is a page: the first ``limit`` entities in key order (UTF-8 bytes) after the key
``after`` whose keys start with ``prefix``, merged across partitions. Each partition is read from the page's
first key on, lazily (the live stores are sorted; the durable copy's files are sorted and entered by binary
search: :meth:`DurableState.iter_range`), so a page costs its own rows, not the operator's.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from typing import Any

from charon import serde
from charon.core.routing import entity_prefix, partition_of, split_store_key, store_key
from charon.runtime.contract import EpochNotRetained, StateTooLarge
from charon.state.durable import DurableState, DurableStateError
from charon.state.store import MemoryStore

__all__ = ["check_entities", "decode_entities", "entity_count", "key_range", "node_retained_epochs", "page_durable",
           "page_stores", "read_durable", "read_stores", "retained_from"]



def decode_entities(rows: dict[bytes, bytes], operator: str) -> dict[str, dict[str, Any]]:
    """``{key: {"value": v, "items": {name: v}}}`` of ``operator`` from store rows (other operators ignored)."""
    out: dict[str, dict[str, Any]] = {}
    for k, v in rows.items():
        op, key, item = split_store_key(k)
        if op != operator or (item and not item.startswith("\x01")):  # the engine's own entries (timers): not shown
            continue
        ent = out.setdefault(key, {"value": None, "items": {}})
        if item == "":
            ent["value"] = serde.decode(v)
        else:
            ent["items"][item[1:]] = serde.decode(v)
    return out


def _wanted(operator: str, keys: list[str] | None, partitions: int) -> dict[int, list[str]] | None:
    if keys is None:
        return None
    by_pid: dict[int, list[str]] = {}
    for k in keys:
        by_pid.setdefault(partition_of(operator, k, partitions), []).append(k)
    return by_pid


def _pick(state: Any, operator: str, keys: list[str]) -> dict[bytes, bytes]:
    """Rows of the entities ``keys`` of ``operator`` from one partition's state."""
    rows: dict[bytes, bytes] = {}
    for key in keys:
        prefix = entity_prefix(operator, key)
        main = state.get(store_key(operator, key))
        if main is not None:
            rows[store_key(operator, key)] = main
        for k, v in _scan(state, prefix + b"\x01"):
            rows[k] = v
    return rows


def _scan(state: Any, prefix: bytes) -> Any:
    if isinstance(state, MemoryStore):
        return state.scan(prefix)
    return ((k, v) for k, v in state.items() if k.startswith(prefix))


def key_range(operator: str, after: str | None, prefix: str) -> tuple[bytes, bytes]:
    """The store keys ``[lo, hi)`` of ``operator``'s entities whose key starts with ``prefix`` and sorts after
    ``after`` (an entity's rows are ``operator\\0key\\0item``; a key never holds ``\\0``, so every row of an
    entity sorting after ``after`` is at or above ``operator\\0after\\x01``)."""
    head = f"{operator}\0{prefix}".encode()
    lo = head if after is None else max(head, f"{operator}\0{after}\x01".encode())
    top = head.rstrip(b"\xff")  # never empty: it holds the operator's \0
    return lo, top[:-1] + bytes([top[-1] + 1])


def _grouped(rows: Iterable[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, list[tuple[bytes, bytes]]]]:
    """``(entity key, its rows)`` from rows sorted by key."""
    cur: bytes | None = None
    group: list[tuple[bytes, bytes]] = []
    for k, v in rows:
        ent = k.split(b"\0", 2)[1]
        if ent != cur:
            if cur is not None:
                yield cur, group
            cur, group = ent, []
        group.append((k, v))
    if cur is not None:
        yield cur, group


def _page(sources: list[Iterable[tuple[bytes, bytes]]], limit: int,
          max_bytes: int | None = None) -> tuple[dict[bytes, bytes], bool]:
    """The rows of the first ``limit`` entities of the partitions' sorted rows (an entity lives in one
    partition), pulled lazily: the partitions are read no further than the page. With ``max_bytes`` the page
    stops before the entity that would take its rows (keys and values) past it (the first entity always comes):
    ``(rows, True)`` then, as more entities follow."""
    rows: dict[bytes, bytes] = {}
    size = 0
    merged = heapq.merge(*(_grouped(s) for s in sources), key=lambda e: e[0])
    for n, (_, group) in enumerate(merged):
        if n >= limit:
            break
        more = sum(len(k) + len(v) for k, v in group)
        if max_bytes is not None and n and size + more > max_bytes:
            return rows, True
        rows.update(group)
        size += more
    return rows, False


def read_stores(stores: list[MemoryStore], operator: str, keys: list[str] | None, limit: int,
                after: str | None = None, prefix: str = "") -> dict[bytes, bytes]:
    """The committed rows of ``operator`` in live stores (call it at an epoch boundary): the entities ``keys``,
    or the page of at most ``limit`` entities after ``after`` starting with ``prefix``."""
    if keys is None:
        return page_stores(stores, operator, limit, after, prefix)[0]
    rows: dict[bytes, bytes] = {}
    for pid, wanted in sorted((_wanted(operator, keys, len(stores)) or {}).items()):
        rows.update(_pick(stores[pid], operator, wanted))
    return rows


def page_stores(stores: list[MemoryStore], operator: str, limit: int, after: str | None = None, prefix: str = "",
                max_bytes: int | None = None) -> tuple[dict[bytes, bytes], bool]:
    """A page of ``operator``'s entities in the live stores: ``(rows, stopped at max_bytes)``."""
    lo, hi = key_range(operator, after, prefix)
    return _page([s.range(lo, hi) for s in stores], limit, max_bytes)


def entity_count(rows: dict[bytes, bytes]) -> int:
    return len({k.split(b"\0", 2)[1] for k in rows})


def read_durable(
    durable: DurableState, partitions: int, operator: str, epoch: int, keys: list[str] | None, limit: int,
    after: str | None = None, prefix: str = "",
) -> dict[bytes, bytes]:
    """The rows of ``operator`` as of ``epoch`` from the durable copy (every partition at the same epoch): the
    entities ``keys``, or a page as :func:`read_stores`."""
    if keys is None:
        return page_durable(durable, partitions, operator, epoch, limit, after, prefix)[0]
    rows: dict[bytes, bytes] = {}
    try:
        for pid, wanted in sorted((_wanted(operator, keys, partitions) or {}).items()):
            state, _ = durable.load(pid, epoch)
            rows.update(_pick(state, operator, wanted))
    except DurableStateError as exc:
        raise EpochNotRetained(f"the state as of epoch {epoch} is no longer retained: {exc}") from None
    return rows


def page_durable(
    durable: DurableState, partitions: int, operator: str, epoch: int, limit: int, after: str | None = None,
    prefix: str = "", max_bytes: int | None = None,
) -> tuple[dict[bytes, bytes], bool]:
    """A page of ``operator``'s entities as of ``epoch`` in the durable copy: ``(rows, stopped at max_bytes)``."""
    lo, hi = key_range(operator, after, prefix)
    window = max(16, min(limit, 4096))
    try:
        return _page([durable.iter_range(pid, epoch, lo, hi, window) for pid in range(partitions)], limit,
                     max_bytes)
    except DurableStateError as exc:
        raise EpochNotRetained(f"the state as of epoch {epoch} is no longer retained: {exc}") from None


def node_retained_epochs(durable: DurableState, partitions: int) -> list[int]:
    """The epochs the node's durable copy can still show: its checkpoints (a checkpoint covers several epochs,
    written as one delta named after its last epoch) since the oldest base, ascending."""
    found: set[int] = set()
    floor = -1
    for pid in range(partitions):
        m = durable.manifest(pid)
        floor = max(floor, m.base_epoch)
        found.update(m.deltas)
        found.add(m.base_epoch)
    return sorted(e for e in found if e >= floor and e >= 0)


def retained_from(durable: DurableState, partitions: int) -> int:
    return max((durable.manifest(pid).base_epoch for pid in range(partitions)), default=-1)


def check_entities(raw: dict[str, dict[bytes, bytes]], max_entities: int) -> None:
    for op, rows in raw.items():
        if entity_count(rows) > max_entities:
            raise StateTooLarge(f"operator {op!r} holds more than {max_entities} entities (sql_max_entities);"
                                         " use `charon sql` (Spark SQL over the data directory) for big states")
