"""A real deployment for tests: ``charon run bank:app`` (tests/support/repros/bank.py) in its own process group, with
helpers to wait for /health, find its JVM and measure a trickle of invokes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from charon.server.serve import free_port

REPROS = Path(__file__).resolve().parent / "repros"
TOKEN = "s3cret"
H = {"Authorization": f"Bearer {TOKEN}"}


class Deployment:
    def __init__(self, engine: str, data_dir: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.err = data_dir.parent / f"charon-{self.port}.err"
        full = {**os.environ, "PYTHONPATH": str(REPROS), "PYSPARK_PYTHON": sys.executable,
                "PYSPARK_DRIVER_PYTHON": sys.executable, **(env or {})}
        cmd = [sys.executable, "-c", "from charon.cli import app; app()", "run", "bank:app", "--engine", engine,
               "--port", str(self.port), "--token", TOKEN, "--data-dir", str(data_dir)]
        self.proc = subprocess.Popen(cmd, cwd=REPROS, env=full, stdout=subprocess.DEVNULL,
                                     stderr=open(self.err, "w"), start_new_session=True)
        self.http = httpx.Client(base_url=self.url, headers=H, timeout=120)

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def wait_ok(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited {self.proc.returncode}: {self.stderr()[-2000:]}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"not healthy in {timeout} s: {self.stderr()[-2000:]}")

    def children(self, word: str) -> list[psutil.Process]:
        """The server's live descendants whose command line holds `word` (one that exits meanwhile is not one)."""
        found = []
        for c in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if word in " ".join([c.name(), *c.cmdline()]):
                    found.append(c)
            except psutil.NoSuchProcess:
                continue
        return found

    def java(self) -> list[psutil.Process]:
        """The server's live JVMs."""
        found = []
        for c in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if c.name() == "java":
                    found.append(c)
            except psutil.NoSuchProcess:
                continue
        return found

    def peak_rss(self) -> int:
        """The server process's peak resident set (VmHWM), bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    def seed(self, keys: list[str], amount: int = 1, uid: str = "seed") -> None:
        r = self.http.post("/admin/update", json={"id": uid, "operator": "account", "function": "deposit",
                                                  "args": [amount], "keys": keys}, timeout=300)
        assert r.status_code == 200, r.text

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


class Trickle:
    """One ``incr`` on account ``w`` every ``every`` seconds (sequential): (start, latency s, status) each."""

    def __init__(self, url: str, every: float = 0.1, key: str = "w") -> None:
        self.samples: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._client = httpx.Client(base_url=url, headers=H, timeout=60)
        self._thread = threading.Thread(target=self._run, args=(every, key), daemon=True)

    def _run(self, every: float, key: str) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                st = self._client.post(f"/invoke/account/{key}/incr").status_code
            except httpx.HTTPError:
                st = 0
            self.samples.append((t0, time.monotonic() - t0, st))
            time.sleep(max(0.0, every - (time.monotonic() - t0)))

    def __enter__(self) -> Trickle:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=90)
        self._client.close()

    def committed(self) -> int:
        return sum(1 for s in self.samples if s[2] == 200)

    def window(self, t0: float, t1: float) -> list[tuple[float, float, int]]:
        return [s for s in self.samples if t0 <= s[0] < t1]


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")
