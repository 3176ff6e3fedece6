"""A real external HTTP service for the effect tests (run as its own process: ``python effects_service.py PORT DB``).

``POST /apply {"key", ...}`` records an attempt for the idempotency key ``key``, then (unless told to fail or hang)
applies the call once per key (a repeat answers the first answer) and answers ``{"applied": n, ...body}``.
``{"decline": true}`` in the body is applied as a permanent refusal (402, recorded once like a success).
``POST /control {"fail_rate": p, "fail_next": n, "hang_next": n, "hang_s": s}`` sets the failure modes;
``GET /stats`` answers ``{"attempts": {key: n}, "applied": {key: body}}``. Everything is in SQLite (synchronous
FULL): a SIGKILLed service restarted on the same file remembers what it applied.
"""

from __future__ import annotations

import json
import random
import sqlite3
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DB_LOCK = threading.Lock()
MODE = {"fail_rate": 0.0, "fail_next": 0, "hang_next": 0, "hang_s": 30.0}


def open_db(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE IF NOT EXISTS attempts (key TEXT PRIMARY KEY, n INTEGER NOT NULL)")
    db.execute("CREATE TABLE IF NOT EXISTS applied (seq INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT UNIQUE, "
               "body TEXT NOT NULL, status INTEGER NOT NULL)")
    return db


class Handler(BaseHTTPRequestHandler):
    db: sqlite3.Connection

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, status: int, doc: object) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        with DB_LOCK:
            attempts = dict(self.db.execute("SELECT key, n FROM attempts").fetchall())
            applied = {k: json.loads(b) for k, b in self.db.execute("SELECT key, body FROM applied").fetchall()}
        self._answer(200, {"attempts": attempts, "applied": applied, "mode": MODE})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
        if self.path == "/control":
            MODE.update(body)
            return self._answer(200, MODE)
        key = body["key"]
        with DB_LOCK:
            self.db.execute("INSERT INTO attempts (key, n) VALUES (?, 1) ON CONFLICT (key) DO UPDATE SET n = n + 1",
                            (key,))
            hang = MODE["hang_next"] > 0
            fail = not hang and (MODE["fail_next"] > 0 or random.random() < MODE["fail_rate"])
            if hang:
                MODE["hang_next"] -= 1
            elif MODE["fail_next"] > 0:
                MODE["fail_next"] -= 1
        if hang:
            time.sleep(MODE["hang_s"])
            return self._answer(503, {"error": "hung"})
        if fail:
            return self._answer(503, {"error": "injected failure"})
        status = 402 if body.get("decline") else 200
        with DB_LOCK:
            self.db.execute("INSERT OR IGNORE INTO applied (key, body, status) VALUES (?, ?, ?)",
                            (key, json.dumps(body), status))
            seq, first, st = self.db.execute("SELECT seq, body, status FROM applied WHERE key = ?", (key,)).fetchone()
        return self._answer(st, {"applied": seq, **json.loads(first)})


def main() -> None:
    port, path = int(sys.argv[1]), sys.argv[2]
    Handler.db = open_db(path)
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()


class Service:
    """The service as a separate process, for tests: start, SIGKILL, restart on the same database."""

    def __init__(self, db_path: str, port: int | None = None) -> None:
        import socket

        self.db_path = db_path
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: object = None

    def start(self) -> Service:
        import subprocess

        self.proc = subprocess.Popen([sys.executable, __file__, str(self.port), self.db_path],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"  # type: ignore[attr-defined]
        return self

    def kill(self) -> None:
        import signal

        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
            self.proc.wait()  # type: ignore[attr-defined]
            self.proc = None

    def control(self, **mode: float) -> None:
        import httpx

        httpx.post(self.url + "/control", json=mode, timeout=10).raise_for_status()

    def stats(self) -> dict:
        import httpx

        return httpx.get(self.url + "/stats", timeout=10).json()
