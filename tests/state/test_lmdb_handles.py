"""The suite's process closes what its in-process deployments opened (tests/conftest.py), and the resident gang
reads from a descriptor past 1023 (where select() refused: the last CI's resident failures)."""

from __future__ import annotations

import os
import resource
import socket

import pytest

from charon.runtime.spark.resident import _readable
from charon.state import lmdbstore


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_close_opened_since_closes_exactly_what_was_opened_after(tmp_path) -> None:
    kept = lmdbstore.open_store(str(tmp_path / "kept"), 0)
    before = lmdbstore.opened()
    n0 = _fds()
    for pid in range(4):
        lmdbstore.open_store(str(tmp_path / "later"), pid)
    assert _fds() > n0
    assert lmdbstore.close_opened_since(before) == 4
    assert _fds() == n0 and lmdbstore.opened() == before
    assert kept.get(b"k") is None  # the store opened before is still open (a closed env would raise)
    kept.close()


def test_a_socket_past_descriptor_1023_is_polled() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"the descriptor limit ({hard}) allows none past 1023")
    if soft < 2048:  # room for descriptors past 1023 (the hard limit allows it on Linux)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    a, b = socket.socketpair()
    hold = [os.dup(a.fileno()) for _ in range(1030 - _fds())]  # push the next descriptor past 1023
    try:
        high = socket.socket(fileno=os.dup(a.fileno()))
        assert high.fileno() > 1023
        assert not _readable(high, 0.01)
        b.sendall(b"x")
        assert _readable(high, 1.0)
        high.close()
    finally:
        for fd in hold:
            os.close(fd)
        a.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
