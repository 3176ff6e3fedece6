"""Routing: entities map to key groups (a fixed 256), key groups to partitions; store key layout."""

from __future__ import annotations

import zlib
from functools import lru_cache

KEY_GROUPS = 256


@lru_cache(maxsize=1 << 20)
def key_group(operator: str, key: str) -> int:
    """The key group of an entity: stable across processes and Python versions (crc32, not hash())."""
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
