"""Quarantine: a transaction that kills the process running it (``os._exit``, a crash in a C extension, memory
exhaustion) must not keep a durable node in a crash loop.

The node replays its logged epochs at every restart, so such a transaction would kill every restart. Recovery
therefore counts its attempts per epoch (``recovery.json`` in the data directory, written before each replayed
epoch runs): when the epoch about to be replayed already killed an earlier recovery, it is *probed* before it
runs. A forked child runs the epoch on a copy of the state while reporting, through a pipe, which transaction's
code runs; a child that dies (or outlives its deadline) names the transaction it was running. That transaction
gets a ``Quarantined`` verdict (recorded before the epoch replays, see :mod:`charon.runtime.verdicts`) and the
probe repeats until the epoch completes in the child. Then the epoch replays for real, the quarantined
transactions refused up front; their clients get the typed ``Quarantined`` reply and ``charon dead-letters``
lists them. The decision is taken before anything depends on it, so it is replay-exact like any verdict.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from charon.core.epoch import EpochCoordinator, Verdict
from charon.core.partition import Frame, Outgoing, PartitionUnit
from charon.runtime.verdicts import VerdictBook, letter
from charon.state.durable import write_file_atomic

FILE = "recovery.json"
MAX_PROBES = 8  # transactions quarantined in one epoch at most (then the replay runs as it is)


class RecoveryAttempts:
    """Which epoch recovery was replaying when the process last died, and how many times."""

    def __init__(self, data_dir: str) -> None:
        self.path = os.path.join(data_dir, FILE)
        self.epoch, self.attempts = -1, 0
        try:
            with open(self.path) as f:
                doc = json.load(f)
            self.epoch, self.attempts = int(doc["epoch"]), int(doc["attempts"])
        except (OSError, ValueError, KeyError, TypeError):
            pass

    def failed_before(self, epoch: int) -> bool:
        """Whether an earlier recovery died replaying ``epoch``."""
        return self.epoch == epoch and self.attempts > 0

    def starting(self, epoch: int) -> None:
        """Recovery is about to replay ``epoch``: count the attempt (durably, before it runs). The epochs before
        the one an earlier recovery died in completed then: they are not counted (nor written)."""
        if epoch < self.epoch:
            return
        n = self.attempts + 1 if epoch == self.epoch else 1
        write_file_atomic(self.path, json.dumps({"epoch": epoch, "attempts": n}).encode())
        self.epoch, self.attempts = epoch, n

    def done(self) -> None:
        """Recovery completed: nothing to count any more."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.epoch, self.attempts = -1, 0


class Culprit(NamedTuple):
    """What a probing child was running when it died: the transaction and the function."""

    request_id: str
    root: str  # the transaction's "operator.function"
    operator: str
    function: str
    key: str
    fallback: bool


def probe(run_epoch: Callable[[], Any], coordinator: Callable[[], EpochCoordinator], deadline_s: float,
          ) -> Culprit | None:
    """Run ``run_epoch()`` in a forked child; None if it completed, else what it was running when it died or
    overran ``deadline_s`` (None as well when it died outside any function)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report every invocation step before it runs, then run the epoch
        os.close(r)
        _report_steps(coordinator(), w)
        code = 0
        try:
            run_epoch()
        except BaseException:  # noqa: BLE001 - the child's outcome is its exit code
            code = 1
        os._exit(code)
    os.close(w)
    last = b""
    buf = b""
    end = time.monotonic() + deadline_s
    status = 0
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                break
            ready, _, _ = select.select([r], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(r, 65536)
                if not chunk:
                    break  # the child closed the pipe: exited
                buf += chunk
                while len(buf) >= 4:
                    (n,) = struct.unpack(">I", buf[:4])
                    if len(buf) < 4 + n:
                        break
                    last, buf = buf[4:4 + n], buf[4 + n:]
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    if (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0) or not last:
        return None
    return Culprit(*json.loads(last))


def _report_steps(coord: EpochCoordinator, fd: int) -> None:
    """In the probing child only: every unit writes what it is about to run to ``fd`` before each step (the class
    is patched: this process ends with the probe)."""
    orig = PartitionUnit._run

    def run(unit: PartitionUnit, frame: Frame) -> Outgoing:
        req = coord.current.requests.get(frame.tid) if coord.current is not None else None
        if req is not None:
            doc = [req.request_id, f"{req.operator}.{req.function}", frame.op, frame.fn, frame.key, coord.phase == 1]
            data = json.dumps(doc).encode()
            os.write(fd, struct.pack(">I", len(data)) + data)
        return orig(unit, frame)

    PartitionUnit._run = run  # type: ignore[method-assign,assignment]  # a deliberate patch (see the docstring)


def quarantine_killers(epoch: int, run_epoch: Callable[[], Any], coordinator: Callable[[], EpochCoordinator],
                       book: VerdictBook, deadline_s: float) -> list[str]:
    """Probe ``epoch`` until it completes in a child; quarantine each transaction that killed one (recorded before
    the epoch replays). Returns the request ids quarantined."""
    out: list[str] = []
    for _ in range(MAX_PROBES):
        c = probe(run_epoch, coordinator, deadline_s)
        if c is None or c.request_id in book.verdicts:
            break  # it completes (or the same one again: the replay refuses it anyway)
        msg = (f"{c.operator}.{c.function} on key {c.key!r} stopped the engine's process while running (killed "
               "it, or held it past the probe's deadline) in its epoch and again at recovery; the transaction was "
               "set aside")
        book.record(letter(c.request_id, c.operator, c.function, c.key, Verdict("Quarantined", msg, c.fallback),
                           epoch, c.root))
        out.append(c.request_id)
    return out


# -- Spark: which transaction kills its Python worker --------------------------------------------------------------
@contextlib.contextmanager
def probing(probe_dir: str | None) -> Iterator[None]:
    """In a Spark task of an epoch being probed (it failed before): every invocation step writes ``S tid phase``
    before it runs and ``E`` after, unbuffered, to a file of this worker process under ``probe_dir``; a worker
    that dies leaves its file ending in ``S``: :func:`culprit_in` finds the transaction. (The class is patched for
    the task's duration: a Python worker runs one task at a time.)"""
    if probe_dir is None:
        yield
        return
    os.makedirs(probe_dir, exist_ok=True)
    fd = os.open(os.path.join(probe_dir, f"{os.getpid()}.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    run, replay = PartitionUnit._run, PartitionUnit._replay_cached

    def probed_run(unit: PartitionUnit, frame: Any) -> Any:
        os.write(fd, f"S {frame.tid} {0 if unit._recording else 1}\n".encode())
        try:
            return run(unit, frame)
        finally:
            os.write(fd, b"E\n")

    def probed_replay(unit: PartitionUnit, tid: int, cached: Any) -> bool:
        os.write(fd, f"S {tid} 1\n".encode())
        try:
            return replay(unit, tid, cached)
        finally:
            os.write(fd, b"E\n")

    # patched for the task's duration (the probing worker's steps), restored after
    PartitionUnit._run = probed_run  # type: ignore[method-assign,assignment]
    PartitionUnit._replay_cached = probed_replay  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        PartitionUnit._run, PartitionUnit._replay_cached = run, replay  # type: ignore[method-assign]
        os.close(fd)


def culprit_in(probe_dir: str) -> tuple[int, bool] | None:
    """The (tid, in its fallback) a probed worker was running when it died: the step the files ending in a started
    step name (None when none does, or when they name different steps: it cannot tell which killed its worker)."""
    dangling = []
    try:
        names = sorted(os.listdir(probe_dir))
    except FileNotFoundError:
        return None
    for name in names:
        with open(os.path.join(probe_dir, name), "rb") as f:
            lines = f.read().splitlines()
        if lines and lines[-1].startswith(b"S "):
            _, tid, phase = lines[-1].split()
            dangling.append((int(tid), phase == b"1"))
    found = set(dangling)  # Spark's task retries leave one file per dead worker: the same step each time
    return found.pop() if len(found) == 1 else None
