"""Partition state stores: the protocol the core reads through, and the in-memory store."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from sortedcontainers import SortedDict


class PartitionStore(Protocol):
    """Committed state of one partition, as of the end of epoch ``epoch``."""

    @property
    def epoch(self) -> int: ...

    def get(self, key: bytes) -> bytes | None: ...

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]: ...

    def commit(self, epoch: int, delta: dict[bytes, bytes | None]) -> None: ...


class MemoryStore:
    """A sorted in-memory store (the in-process runtime's state); ``commit`` is idempotent per epoch."""

    def __init__(self) -> None:
        self.data: SortedDict = SortedDict()
        self.epoch = -1

    def get(self, key: bytes) -> bytes | None:
        value: bytes | None = self.data.get(key)  # SortedDict is untyped
        return value

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        data = self.data
        for k in data.irange(minimum=prefix):
            if not k.startswith(prefix):
                break
            yield k, data[k]

    def commit(self, epoch: int, delta: dict[bytes, bytes | None]) -> None:
        if epoch <= self.epoch:
            return
        data = self.data
        for k, v in delta.items():
            if v is None:
                data.pop(k, None)
            else:
                data[k] = v
        self.epoch = epoch

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        return iter(self.data.items())
