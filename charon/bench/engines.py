"""Engines for the benchmark scripts (``benchmarks/``): start one, wait until it serves, seed it, load it.

One copy of what every script that measures through HTTP needs:

- :func:`start_node`: the durable node as a user runs it (a :class:`Node`, a context manager that stops it),
  ``charon run APP --engine inprocess|spark|remote`` in its own process and working directory (a data
  directory under it unless ``data_dir=None``), returned once ``GET /health`` answers 200 (:func:`wait_healthy`).
  ``src=CHECKOUT`` runs another checkout's ``charon`` package (a before/after in one run); ``log`` keeps the
  node's output in a file (default: discarded).
- :func:`seed_accounts`: one ``POST /admin/update`` depositing ``amount`` on every account ``a0 .. a{n-1}``
  (the YCSB-T state every HTTP benchmark starts from).
- :class:`HttpConnection` and :class:`ConnectionPool`: a lean keep-alive HTTP/1.1 client for load generators
  (a request is one write, a reply one header read and one body read; httpx's own CPU, ~1 ms per request,
  would cap one client process below what the server serves), with :func:`transfer_request` building a YCSB-T
  transfer with its ``Idempotency-Key``.

In this process, ``async with InProcessRuntime(app, ...)`` starts and stops the in-process runtime; the Spark
runtime as a target is :func:`charon.bench.spark.spark_target` (its driver in a child process).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

#: how long a node may take to answer /health: Spark starts a JVM and a streaming query
HEALTH_TIMEOUT_S = {"spark": 300.0}
DEFAULT_HEALTH_TIMEOUT_S = 60.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    from charon.server.serve import free_port as _free_port

    return _free_port()


def node_command(app: str, *, engine: str = "inprocess", port: int, token: str | None = None,
                 data_dir: str | None = None, args: Sequence[str] = (), python: str | None = None) -> list[str]:
    """``charon run`` through the interpreter (``-c``: the ``charon`` package on its path decides which code
    runs, so ``PYTHONPATH=CHECKOUT`` runs that checkout's)."""
    cmd = [python or sys.executable, "-c", "from charon.cli import main; main()", "run", app, "--engine", engine,
           "--port", str(port)]
    if token is not None:
        cmd += ["--token", token]
    if data_dir is not None:
        cmd += ["--data-dir", data_dir]
    return [*cmd, *args]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = DEFAULT_HEALTH_TIMEOUT_S,
                 interval: float = 0.1) -> None:
    """Return once ``GET {url}/health`` answers 200; raise if ``proc`` exits first or ``timeout`` passes."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {timeout:g} s")
        time.sleep(interval)


def seed_accounts(url: str, token: str | None, keys: int | Iterable[str], amount: int, *, operator: str = "account",
                  function: str = "deposit", request_id: str = "seed", timeout: float = 300.0) -> None:
    """One ``POST /admin/update``: ``function(amount)`` on every key (``keys``: a count of ``a0 .. a{n-1}``)."""
    import httpx

    names = [f"a{i}" for i in range(keys)] if isinstance(keys, int) else list(keys)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = httpx.post(f"{url}/admin/update", headers=headers, timeout=timeout,
                   json={"id": request_id, "operator": operator, "function": function, "args": [amount],
                         "keys": names})
    r.raise_for_status()


def stop_process(proc: subprocess.Popen | None, timeout: float = 60.0) -> None:
    """SIGTERM (a node shuts down cleanly on it), then SIGKILL to its process group after ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.wait(10)


@dataclass
class Node:
    """A started ``charon run``: its process, URL and working directory (removed by :meth:`stop`)."""

    proc: subprocess.Popen
    url: str
    token: str | None
    workdir: Path
    data_dir: Path | None
    command: list[str]
    keep_workdir: bool = False
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def seed(self, keys: int | Iterable[str], amount: int, *, timeout: float = 300.0) -> None:
        """:func:`seed_accounts` on this node."""
        seed_accounts(self.url, self.token, keys, amount, timeout=timeout)

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 60.0) -> None:
        stop_process(self.proc, timeout)
        if self._log is not None:
            self._log.close()
            self._log = None
        if not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start_node(app: str = "charon.apps.ycsb:app", *, engine: str = "inprocess", token: str | None = None,
               port: int | None = None, durable: bool = True, data_dir: str | os.PathLike | None = None,
               args: Sequence[str] = (), src: str | os.PathLike | None = None, env: dict[str, str | None] | None = None,
               log: str | os.PathLike | None = None, workdir: str | os.PathLike | None = None,
               health_timeout: float | None = None, python: str | None = None) -> Node:
    """``charon run APP`` in its own process (a new session), returned once healthy; stopped if it never is.

    ``durable``: ``--data-dir`` ``data_dir`` (default ``WORKDIR/data``); without it the node's own default.
    ``src``: put that checkout first on ``PYTHONPATH`` (the node runs its ``charon``). ``env``: variables to set
    (``None``: to remove).
    ``log``: a file for the node's stdout and stderr (a bare name is put in the working directory).
    ``workdir``: the node's working directory (default: a new temporary one, removed by :meth:`Node.stop`)."""
    wd = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix=f"charon-bench-{engine}-"))
    wd.mkdir(parents=True, exist_ok=True)
    dd = (Path(data_dir) if data_dir is not None else wd / "data") if durable else None
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = node_command(app, engine=engine, port=port, token=token, data_dir=str(dd) if dd else None, args=args,
                       python=python)
    penv = dict(os.environ)
    penv.setdefault("PYSPARK_PYTHON", python or sys.executable)
    penv.setdefault("PYSPARK_DRIVER_PYTHON", python or sys.executable)
    if src is not None:
        penv["PYTHONPATH"] = str(Path(src).resolve())
    for k, v in (env or {}).items():
        if v is None:
            penv.pop(k, None)
        else:
            penv[k] = v
    out: IO[bytes] | None = None
    if log is not None:
        lp = Path(log) if os.sep in str(log) else wd / log
        out = open(lp, "wb")  # noqa: SIM115 - lives as long as the node
    # cwd: `python -c` puts the working directory first on sys.path; it must not shadow ``src``
    proc = subprocess.Popen(cmd, cwd=wd, env=penv, stdout=out or subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if out else subprocess.DEVNULL, start_new_session=True)
    n = Node(proc, url, token, wd, dd, cmd, keep_workdir=workdir is not None, _log=out)
    try:
        wait_healthy(url, proc, health_timeout or HEALTH_TIMEOUT_S.get(engine, DEFAULT_HEALTH_TIMEOUT_S))
    except BaseException:
        n.stop()
        raise
    return n


# ------------------------------------------------------------------------------------- the lean HTTP client


def transfer_request(host: bytes, token: bytes, debtor: int, creditor: int, amount: int, key: bytes) -> bytes:
    """``POST /invoke/account/a<debtor>/transfer`` with ``{"args": ["a<creditor>", amount]}``, a bearer token and
    ``Idempotency-Key: key``, as one HTTP/1.1 keep-alive request."""
    body = b'{"args":["a%d",%d]}' % (creditor, amount)
    return (b"POST /invoke/account/a%d/transfer HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: application/json\r\nIdempotency-Key: %s\r\nContent-Length: %d\r\n\r\n"
            % (debtor, host, token, key, len(body))) + body


def split_url(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    return host, int(port)


class HttpConnection:
    """One keep-alive HTTP/1.1 connection: :meth:`send` writes a whole request and reads its reply's status and
    body (``Content-Length`` framing, as Charon's gateway answers)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> HttpConnection:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def send(self, request: bytes) -> tuple[int, bytes]:
        assert self.reader is not None and self.writer is not None, "open() first"
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        j = head.lower().index(b"content-length:")
        body = await self.reader.readexactly(int(head[j + 15:head.index(b"\r\n", j)]))
        return status, body

    async def reopen(self) -> None:
        """After an error: a fresh connection (the old one's state is unknown)."""
        self.close()
        await self.open()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class ConnectionPool:
    """``size`` :class:`HttpConnection` to one server, opened together; ``async with`` closes them all. A load
    generator gives each worker task its own (``pool.connections[i]``) or borrows one with :meth:`connection`."""

    def __init__(self, url: str, size: int) -> None:
        self.host, self.port = split_url(url)
        self.connections = [HttpConnection(self.host, self.port) for _ in range(size)]
        self._free: asyncio.Queue[HttpConnection] = asyncio.Queue()

    async def open(self) -> ConnectionPool:
        await asyncio.gather(*(c.open() for c in self.connections))
        for c in self.connections:
            self._free.put_nowait(c)
        return self

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[HttpConnection]:
        c = await self._free.get()
        try:
            yield c
        finally:
            self._free.put_nowait(c)

    def close(self) -> None:
        for c in self.connections:
            c.close()

    async def __aenter__(self) -> ConnectionPool:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        self.close()
