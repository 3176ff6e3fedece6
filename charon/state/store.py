"""Partition state stores: the protocol the core reads through, and the in-memory store."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from sortedcontainers import SortedDict


class PartitionStore(Protocol):
    """Committed state of one partition, as of the end of epoch ``epoch``."""

    @property
    def epoch(self) -> int: ...

    def get(self, key: bytes) -> bytes | None: ...

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]: ...

    def commit(self, epoch: int, delta: dict[bytes, bytes | None]) -> None: ...


# SortedDict is a dict whose own __setitem__ also indexes a new key: an existing key's value is set as a dict's
_dict_set, _dict_update, _dict_keys = dict.__setitem__, dict.update, dict.keys


class MemoryStore:
    """A sorted in-memory store (the in-process runtime's state); ``commit`` is idempotent per epoch."""

    #: ``get(key)``: the value, or None (the data's own ``dict.get``, bound once: a read on the engine's hot
    #: path then costs no Python frame; ``data`` is never replaced)
    get: Callable[[bytes], bytes | None]

    def __init__(self) -> None:
        self.data: SortedDict = SortedDict()
        self.get = self.data.get
        self.epoch = -1

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        data = self.data
        for k in data.irange(minimum=prefix):
            if not k.startswith(prefix):
                break
            yield k, data[k]

    def range(self, lo: bytes, hi: bytes) -> Iterator[tuple[bytes, bytes]]:
        """The rows with ``lo <= key < hi``, in key order (lazily: a page costs its own rows, not the store's)."""
        data = self.data
        for k in data.irange(minimum=lo, maximum=hi, inclusive=(True, False)):
            yield k, data[k]

    def commit(self, epoch: int, delta: dict[bytes, bytes | None]) -> None:
        if epoch <= self.epoch:
            return
        data = self.data
        if delta.keys() <= _dict_keys(data) and None not in delta.values():
            _dict_update(data, delta)  # existing keys only (the common case): the sorted index stays as it is
        else:
            for k, v in delta.items():
                if v is None:
                    data.pop(k, None)
                elif k in data:
                    _dict_set(data, k, v)
                else:
                    data[k] = v  # a new key: SortedDict indexes it
        self.epoch = epoch

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        return iter(self.data.items())
