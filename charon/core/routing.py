"""Routing: entities map to key groups (a fixed 256), key groups to partitions; store key layout.

Names (the one owner of their rules)
------------------------------------
A store key is ``operator \\0 key \\0 \\x01 item`` encoded as UTF-8 (the main value has item ``""`` and no
``\\x01``). It is unambiguous, and fits every store (LMDB accepts keys of at most 511 bytes), because:

- operator names, entity keys and item names are ``str`` that encode as UTF-8 (no lone surrogates);
- none contains NUL;
- operator names are 1..:data:`MAX_OPERATOR_BYTES` bytes, entity keys 1..:data:`MAX_KEY_BYTES` bytes and
  item names 0..:data:`MAX_ITEM_BYTES` bytes, so the longest store key is
  ``64 + 256 + 184 + 3 = 507`` bytes.

:func:`check_operator_name`, :func:`check_key` and :func:`check_item` enforce them (raising
:class:`~charon.errors.InvalidKey`); the gateway, the engine's request validation and the context's calls
and item accessors all use these three.
"""

from __future__ import annotations

import re
import zlib

from charon.errors import InvalidKey

KEY_GROUPS = 256
MAX_OPERATOR_BYTES = 64
MAX_KEY_BYTES = 256
MAX_ITEM_BYTES = 184
STORE_KEY_LIMIT = 511  # LMDB's default maximum key size

assert MAX_OPERATOR_BYTES + MAX_KEY_BYTES + MAX_ITEM_BYTES + 3 <= STORE_KEY_LIMIT


def _check(kind: str, name: object, lo: int, hi: int) -> str:
    if type(name) is not str:
        raise InvalidKey(f"{kind} must be a string, got {type(name).__name__}")
    try:
        n = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidKey(f"{kind} is not valid Unicode (lone surrogate): {name[:40]!r}") from None
    if "\0" in name:
        raise InvalidKey(f"{kind} contains NUL: {name[:40]!r}")
    if not lo <= n <= hi:
        raise InvalidKey(f"{kind} must be {lo}..{hi} bytes of UTF-8, got {n}")
    return name


def check_operator_name(name: object) -> str:
    """Return ``name`` if it is a valid operator name (also no ``/``); raise InvalidKey otherwise."""
    _check("operator name", name, 1, MAX_OPERATOR_BYTES)
    if "/" in name:  # type: ignore[operator]
        raise InvalidKey(f"operator name contains '/': {name!r}")
    return name  # type: ignore[return-value]


def check_key(key: object) -> str:
    """Return ``key`` if it is a valid entity key; raise InvalidKey otherwise."""
    if type(key) is str and key.isascii() and 0 < len(key) <= MAX_KEY_BYTES and "\0" not in key:
        return key  # ASCII: one byte per character, no surrogates (the common case, without encoding it)
    return _check("entity key", key, 1, MAX_KEY_BYTES)


def check_item(name: object) -> str:
    """Return ``name`` if it is a valid item name (or item-name prefix); raise InvalidKey otherwise."""
    return _check("item name", name, 0, MAX_ITEM_BYTES)


MAX_STREAM_BYTES = 64
_STREAM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def check_stream(name: object) -> str:
    """Return ``name`` if it is a valid output-stream name (``[A-Za-z0-9][A-Za-z0-9_.-]*``, at most
    :data:`MAX_STREAM_BYTES`: safe in a URL path); raise InvalidKey otherwise."""
    if type(name) is not str:
        raise InvalidKey(f"stream name must be a string, got {type(name).__name__}")
    if len(name) > MAX_STREAM_BYTES or not _STREAM_NAME.fullmatch(name):
        raise InvalidKey(f"stream name must match [A-Za-z0-9][A-Za-z0-9_.-]* (at most {MAX_STREAM_BYTES}): "
                         f"{name[:80]!r}")
    return name


def key_group(operator: str, key: str) -> int:
    """The key group of an entity: stable across processes and Python versions (crc32, not hash()).

    Computed each time: a bounded ``lru_cache`` in front of it (64K entries) measured slower in the engine (its
    hits reorder a linked list in memory that is cold by then; 10K-account YCSB-T ran 3-5% faster without it)."""
    return zlib.crc32(f"{operator}\0{key}".encode()) % KEY_GROUPS


def partition_of(operator: str, key: str, partitions: int) -> int:
    """The partition that owns an entity's state and runs its functions."""
    return key_group(operator, key) % partitions


def entity_prefix(operator: str, key: str) -> bytes:
    """Store-key prefix of all items of one entity."""
    return f"{operator}\0{key}\0".encode()


def store_key(operator: str, key: str, item: str = "") -> bytes:
    """Store key of one item of an entity; the entity's main value is item ``""``."""
    return f"{operator}\0{key}\0{item}".encode()


def split_store_key(skey: bytes) -> tuple[str, str, str]:
    """Inverse of :func:`store_key`."""
    op, key, item = skey.decode().split("\0", 2)
    return op, key, item
