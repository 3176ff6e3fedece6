"""A real ``nats-server -js`` for tests: started on a free port with a temporary store directory."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

NATS_SERVER = shutil.which("nats-server") or ("/usr/sbin/nats-server" if os.path.exists("/usr/sbin/nats-server")
                                              else None)


def require_nats_server() -> str:
    """The nats-server binary, or skip (Debian package ``nats-server``; ``.ci/run`` installs it)."""
    if NATS_SERVER is None:
        pytest.skip("nats-server is not installed (apt-get install nats-server; .ci/run installs it)")
    return NATS_SERVER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NatsServer:
    """One JetStream server process; :meth:`kill` (SIGKILL) and :meth:`start` again keep its store."""

    def __init__(self, store: Path, port: int | None = None, extra: list[str] | None = None) -> None:
        self.binary = require_nats_server()
        self.store = store
        self.port = port or free_port()
        self.extra = extra or []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> NatsServer:
        self.store.mkdir(parents=True, exist_ok=True)
        log = open(self.store / "server.log", "ab")
        self.proc = subprocess.Popen(
            [self.binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store), *self.extra],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"nats-server exited: see {self.store / 'server.log'}"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    if s.recv(4096).startswith(b"INFO"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("nats-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class NatsCluster:
    """Three JetStream servers routed into one cluster (free client and route ports, a store each); :attr:`url`
    lists them all, for a log with ``?replicas=3``."""

    def __init__(self, root: Path, size: int = 3) -> None:
        routes = [free_port() for _ in range(size)]
        all_routes = ",".join(f"nats://127.0.0.1:{p}" for p in routes)
        self.servers = [
            NatsServer(root / f"n{i}", extra=["--server_name", f"n{i}", "--cluster_name", "charon",
                                              "--cluster", f"nats://127.0.0.1:{routes[i]}", "--routes", all_routes])
            for i in range(size)]

    def url(self, deployment: str, replicas: int = 3) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.servers)
        return f"nats://{hosts}/{deployment}?replicas={replicas}"

    def start(self) -> NatsCluster:
        for s in self.servers:
            s.start()
        return self

    def kill(self) -> None:
        for s in self.servers:
            s.kill()
