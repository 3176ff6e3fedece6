"""The gateway processes of ``charon run --engine spark``: started, restarted and stopped by the driver's process.

The driver (the coordinator) keeps its interpreter for the epochs; HTTP is parsed in ``--gateways N`` processes of
their own. The driver binds every public port before anything starts (gateway ``i`` listens on ``port + i``) and
hands each socket to its gateway process, which is ``charon run MODULE:APP --engine remote`` over the driver's
logs (SQLite files in its data directory, or its NATS log) with ``--driver`` naming the driver's control channel
(the full gateway the driver serves on localhost, with the same tokens; :mod:`charon.server.forward`).

Supervision: a gateway process that exits (killed, crashed) is started again by :class:`GatewayProcesses`'s
monitor thread, at once the first time and with a back-off (up to ``MAX_BACKOFF_S``) while it keeps dying young.
The socket stays bound in the driver meanwhile, so clients connecting during the restart wait in its backlog
instead of being refused. A gateway process watches its parent (:func:`watch_parent`) and stops when the driver
is gone, however the driver ended; the driver stops its gateways first when it shuts down (while its engine still
answers their waiting requests).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import httpx

__all__ = ["GatewayProcesses", "watch_parent"]

_log = logging.getLogger("charon.server")

MAX_BACKOFF_S = 5.0  # the longest wait before starting a gateway process that keeps dying young
YOUNG_S = 5.0  # a gateway process that exits sooner than this after its start died young
POLL_S = 0.1  # how often the monitor looks at its processes


class _Slot:
    """One gateway process: its socket, the process now, and its restart history."""

    def __init__(self, index: int, sock: socket.socket) -> None:
        self.index = index
        self.sock = sock
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.backoff = 0.0
        self.restarts = 0
        self.next_start = 0.0


class GatewayProcesses:
    """Run one gateway process per socket of ``sockets`` (each already bound and listening), as
    ``argv + ["--listen-fd", FD]`` with ``env``; restart any that exits until :meth:`stop`."""

    def __init__(self, sockets: Sequence[socket.socket], argv: list[str], env: dict[str, str]) -> None:
        self.slots = [_Slot(i, s) for i, s in enumerate(sockets)]
        self.argv = argv
        self.env = env
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None

    @property
    def ports(self) -> list[int]:
        return [int(s.sock.getsockname()[1]) for s in self.slots]

    def pids(self) -> list[int | None]:
        """The gateway processes' ids now (None while one is being restarted)."""
        with self._lock:
            return [None if s.proc is None or s.proc.poll() is not None else s.proc.pid for s in self.slots]

    def restarts(self) -> int:
        with self._lock:
            return sum(s.restarts for s in self.slots)

    def start(self) -> GatewayProcesses:
        with self._lock:
            for slot in self.slots:
                self._spawn(slot)
        self._monitor = threading.Thread(target=self._watch, name="charon-gateways", daemon=True)
        self._monitor.start()
        return self

    def _spawn(self, slot: _Slot) -> None:
        fd = slot.sock.fileno()
        slot.proc = subprocess.Popen([*self.argv, "--listen-fd", str(fd)], env=self.env, pass_fds=(fd,),
                                     stdin=subprocess.DEVNULL)
        slot.started = time.monotonic()

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_S):
            with self._lock:
                if self._stopping.is_set():
                    return
                now = time.monotonic()
                for slot in self.slots:
                    proc = slot.proc
                    if proc is not None and proc.poll() is not None:
                        young = now - slot.started < YOUNG_S
                        slot.backoff = min(MAX_BACKOFF_S, max(0.2, slot.backoff * 2)) if young else 0.0
                        slot.next_start = now + slot.backoff
                        _log.warning("gateway %d (pid %d, port %d) exited with %s; starting it again in %.1f s",
                                     slot.index, proc.pid, slot.sock.getsockname()[1], proc.returncode, slot.backoff,
                                     extra={"event": "gateway_exited", "gateway": slot.index, "pid": proc.pid,
                                            "returncode": proc.returncode})
                        slot.proc = None
                    if slot.proc is None and now >= slot.next_start:
                        try:
                            self._spawn(slot)
                            slot.restarts += 1
                        except OSError as exc:  # e.g. out of processes: try again after the back-off
                            slot.backoff = min(MAX_BACKOFF_S, max(0.2, slot.backoff * 2))
                            slot.next_start = now + slot.backoff
                            _log.error("gateway %d could not be started: %s", slot.index, exc,
                                       extra={"event": "gateway_start_failed", "gateway": slot.index})

    def wait_ready(self, timeout: float, stop: threading.Event | None = None) -> bool:
        """Whether every gateway answers ``/health`` with 200 within ``timeout`` seconds (False once ``stop`` is
        set or :meth:`stop` was called)."""
        deadline = time.monotonic() + timeout
        pending = list(self.ports)
        with httpx.Client(timeout=2.0) as http:
            while pending:
                if self._stopping.is_set() or (stop is not None and stop.is_set()) or time.monotonic() > deadline:
                    return False
                port = pending[0]
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        pending.pop(0)
                        continue
                time.sleep(0.05)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every gateway process (SIGTERM: each finishes what it serves; SIGKILL after ``timeout``) and
        close the sockets. Idempotent."""
        self._stopping.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join()
        with self._lock:
            procs = [s.proc for s in self.slots if s.proc is not None]
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for proc in procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            for slot in self.slots:
                slot.proc = None
                slot.sock.close()


def watch_parent(parent: int, interval: float = 0.2) -> threading.Thread:
    """In a gateway process: stop this process (SIGTERM to itself, then a hard exit after 5 s) once ``parent``
    (the driver's process) is gone, however it ended (a SIGKILL leaves no chance to stop its children)."""

    def run() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        print(f"charon: the driver (pid {parent}) is gone: this gateway stops", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5.0)
        os._exit(0)

    thread = threading.Thread(target=run, name="charon-parent-watch", daemon=True)
    thread.start()
    return thread
