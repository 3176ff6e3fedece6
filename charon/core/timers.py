"""Timers and delayed calls: the one owner of how timers are stored, indexed and fired.

``ctx.send_after(seconds, op, key, fn, *args)`` / ``ctx.send_at(t, ...)`` register a *timer*: a
transactional write of one item of the registering (*owner*) entity, so a timer registered by a transaction
that aborts never exists, and a cancel (``ctx.cancel_timer(id)``, a delete of that item) conflicts with
whatever else touches the owner like any other write.

Store layout (keys as in :mod:`charon.core.routing`):

* ``owner_op \\0 owner_key \\0 \\x02 <id>`` -> the encoded :class:`Timer` (the source of truth; listing an
  entity's timers is a prefix scan);
* ``\\x00timers \\0 <due> \\0 <id>`` -> the same record, in the owner's partition: the index ordered by due time
  (``<due>`` is fixed-width, so byte order is time order). It is derived from the items at the end of every
  epoch (:func:`index_delta`), never written by functions, so it takes no part in conflict detection.
  Operator names cannot contain NUL, so neither key space collides with user state.

Firing (the coordinator, :class:`charon.core.epoch.EpochCoordinator`): every epoch gets a deterministic time
``T`` (``Sequencer.advance``: the maximum of the previous epoch's time and the time the runtime logged for the
epoch). If a timer may be due (``next_due <= T``), a *collect* round asks every partition for its timers with
``due <= T`` (earliest first, at most ``limit`` per partition); the partition deletes them at the start of the
epoch (before any of the epoch's transactions: a cancel in that epoch finds them gone) and each fires as its
own transaction, TIDs assigned in (due, id) order before the epoch's requests, with request id
``__charon_timer:<id>`` and ``ctx.now() == T``. State before the epoch and ``T`` decide all of this, so a
replayed epoch fires the same timers with the same TIDs.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from typing import Any

import msgspec

from charon.core.routing import entity_prefix, store_key
from charon.messages import Request

ITEM_PREFIX = "\x02"  # store item prefix of an entity's timers (user items use "\x01")
INDEX_OP = "\x00timers"  # reserved operator of the due-time index
INDEX_PREFIX = INDEX_OP.encode() + b"\0"
REQUEST_PREFIX = "__charon_timer:"  # request id of a fired timer's transaction (reserved at the gateway)
MAX_DUE = 1e12  # seconds since the Unix epoch (year 33658); keeps the index key fixed-width
#: Default cap on the timers one partition fires per epoch (the rest fire in the next epochs).
MAX_TIMERS_PER_EPOCH = 10_000


class Timer(msgspec.Struct, frozen=True, array_like=True):
    """A pending timer: call ``operator/key.function(*args)`` as its own transaction once ``due`` has passed.

    ``owner`` is the (operator, key) of the entity that registered it (where it is listed and cancelled).
    ``args`` is msgpack-encoded, as in :class:`charon.messages.Request`.
    """

    id: str
    due: float
    owner_operator: str
    owner_key: str
    operator: str
    key: str
    function: str
    args: bytes

    def request(self, now: float) -> Request:
        """The transaction this timer fires as, in an epoch of time ``now``."""
        return Request(REQUEST_PREFIX + self.id, self.operator, self.key, self.function, self.args, now)


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Timer)


def encode(t: Timer) -> bytes:
    return _ENC.encode(t)


def decode(raw: bytes) -> Timer:
    return _DEC.decode(raw)


def make_id(tid: int, inv: str, n: int) -> str:
    """Timer ``n`` (1, 2, ...) registered by invocation ``inv`` of transaction ``tid``: unique, and the same
    on every run of that invocation (dry run, replay, fallback, an epoch replayed after a crash)."""
    if len(inv) > 32:  # deep call chains: keep the id (a store item name) short
        inv = "h" + hashlib.blake2b(inv.encode(), digest_size=8).hexdigest()
    return f"t{tid}-{inv}-{n}"


def check_due(t: Any) -> float:
    """A valid due time (seconds since the Unix epoch, like ``ctx.now()``); raise ValueError otherwise."""
    if isinstance(t, bool) or not isinstance(t, int | float):
        raise ValueError(f"a timer's time must be a number of seconds, got {type(t).__name__}")
    due = float(t)
    if not math.isfinite(due) or not 0.0 <= due <= MAX_DUE:
        raise ValueError(f"a timer's time must be within [0, {MAX_DUE:g}] seconds since the Unix epoch, got {due}")
    return due


def item_key(owner_op: str, owner_key: str, timer_id: str) -> bytes:
    """Store key of a timer's item (the record) under its owner entity."""
    return store_key(owner_op, owner_key, ITEM_PREFIX + timer_id)


def owner_prefix(owner_op: str, owner_key: str) -> bytes:
    """Store-key prefix of all timers of one owner entity."""
    return entity_prefix(owner_op, owner_key) + ITEM_PREFIX.encode()


def index_key(t: Timer) -> bytes:
    """The due-time index key of a timer (byte order = (due, id) order)."""
    return INDEX_PREFIX + f"{t.due:020.6f}".encode() + b"\0" + t.id.encode()


def is_item_key(k: bytes) -> bool:
    """Whether a store key is a timer's item (``op \\0 key \\0 \\x02 ...``)."""
    i = k.find(b"\0")
    if i <= 0 or k.startswith(INDEX_PREFIX):
        return False
    j = k.find(b"\0", i + 1)
    return j > 0 and k[j + 1:j + 2] == b"\x02"


def placed_by(k: bytes, v: bytes) -> tuple[str, str]:
    """The entity whose partition holds store key ``k`` (an index entry lives with its timer's owner)."""
    if k.startswith(INDEX_PREFIX):
        t = decode(v)
        return t.owner_operator, t.owner_key
    op, key, _ = k.decode().split("\0", 2)
    return op, key


def index_delta(get: Any, delta: dict[bytes, bytes | None]) -> dict[bytes, bytes | None]:
    """Index changes implied by an epoch's ``delta`` (``get`` reads the state before it)."""
    out: dict[bytes, bytes | None] = {}
    for k, v in delta.items():
        if not is_item_key(k):
            continue
        old = get(k)
        if old is not None:
            out[index_key(decode(old))] = None
        if v is not None:
            t = decode(v)
            out[index_key(t)] = v
    return out


def reindex(state: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """``state`` with its index rebuilt from the timer items (the oracle's model of the index)."""
    out = {k: v for k, v in state.items() if not k.startswith(INDEX_PREFIX)}
    for k, v in list(out.items()):
        if is_item_key(k):
            out[index_key(decode(v))] = v
    return dict(sorted(out.items()))


def due(scan: Iterable[tuple[bytes, bytes]], now: float, limit: int) -> tuple[list[Timer], float]:
    """From an index scan (ascending): the timers due at ``now`` (at most ``limit``) and the next due time
    of the rest (``inf``: none)."""
    fired: list[Timer] = []
    for _, v in scan:
        t = decode(v)
        if t.due > now or len(fired) >= limit:
            return fired, t.due
        fired.append(t)
    return fired, math.inf


def next_due(scan: Iterable[tuple[bytes, bytes]]) -> float:
    """The earliest due time in an index scan (``inf``: no timer)."""
    for _, v in scan:
        return decode(v).due
    return math.inf


def due_in_state(state: dict[bytes, bytes], now: float, limit: int, partition_of_key: Any) -> list[Timer]:
    """The oracle's model of a collect round: the timers due at ``now`` from the items of ``state``, earliest
    first, at most ``limit`` per partition (``partition_of_key(owner_op, owner_key)``), in (due, id) order."""
    by_part: dict[int, list[Timer]] = {}
    for k, v in state.items():
        if is_item_key(k):
            t = decode(v)
            if t.due <= now:
                by_part.setdefault(partition_of_key(t.owner_operator, t.owner_key), []).append(t)
    out: list[Timer] = []
    for ts in by_part.values():
        out.extend(sorted(ts, key=lambda t: (t.due, t.id))[:limit])
    return sorted(out, key=lambda t: (t.due, t.id))
