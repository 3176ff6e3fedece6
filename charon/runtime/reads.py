"""Consistent state reads for the control surface: an operator's rows from the live stores at an epoch boundary
(:func:`read_stores`) or from the durable copy as of one epoch (:func:`read_durable`: every partition at the same
epoch, never mixing two; an epoch older than the durable copy's base is refused with :class:`EpochNotRetained`).
"""

from __future__ import annotations

from typing import Any

from charon import serde
from charon.core.routing import entity_prefix, partition_of, split_store_key, store_key
from charon.runtime.contract import EpochNotRetained, StateTooLarge
from charon.state.durable import DurableState, DurableStateError
from charon.state.store import MemoryStore

__all__ = ["check_entities", "decode_entities", "entity_count", "node_retained_epochs", "read_durable", "read_stores",
           "retained_from"]


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


def _pick(state: Any, operator: str, keys: list[str] | None, limit: int) -> dict[bytes, bytes]:
    """Rows of ``operator`` (only ``keys`` if given) from one partition's state; at most ``limit`` entities."""
    rows: dict[bytes, bytes] = {}
    if keys is not None:
        for key in keys:
            prefix = entity_prefix(operator, key)
            main = state.get(store_key(operator, key))
            if main is not None:
                rows[store_key(operator, key)] = main
            for k, v in _scan(state, prefix + b"\x01"):
                rows[k] = v
        return rows
    seen: set[bytes] = set()
    for k, v in _scan(state, f"{operator}\0".encode()):
        ent = k.split(b"\0", 2)[1]
        if ent not in seen:
            if len(seen) >= limit:
                continue
            seen.add(ent)
        rows[k] = v
    return rows


def _scan(state: Any, prefix: bytes) -> Any:
    if isinstance(state, MemoryStore):
        return state.scan(prefix)
    return ((k, v) for k, v in state.items() if k.startswith(prefix))


def read_stores(stores: list[MemoryStore], operator: str, keys: list[str] | None, limit: int) -> dict[bytes, bytes]:
    """The committed rows of ``operator`` in live stores (call it at an epoch boundary)."""
    wanted = _wanted(operator, keys, len(stores))
    rows: dict[bytes, bytes] = {}
    for pid, s in enumerate(stores):
        if wanted is not None and pid not in wanted:
            continue
        rows.update(_pick(s, operator, None if wanted is None else wanted[pid], limit - entity_count(rows)))
    return rows


def entity_count(rows: dict[bytes, bytes]) -> int:
    return len({k.split(b"\0", 2)[1] for k in rows})


def read_durable(
    durable: DurableState, partitions: int, operator: str, epoch: int, keys: list[str] | None, limit: int
) -> dict[bytes, bytes]:
    """The rows of ``operator`` as of ``epoch`` from the durable copy (every partition at the same epoch)."""
    wanted = _wanted(operator, keys, partitions)
    rows: dict[bytes, bytes] = {}
    for pid in range(partitions):
        if wanted is not None and pid not in wanted:
            continue
        try:
            state, _ = durable.load(pid, epoch)
        except DurableStateError as exc:
            raise EpochNotRetained(f"the state as of epoch {epoch} is no longer retained: {exc}") from None
        rows.update(_pick(state, operator, None if wanted is None else wanted[pid], limit - entity_count(rows)))
    return rows


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
