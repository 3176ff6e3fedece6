"""Slow-loris: 1,100 slow connections against a gateway process limited to 1,024 open files must not starve
a normal request (the connection cap sheds the longest-waiting request heads; heads time out)."""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from charon.server.serve import free_port

SERVER = """
import sys
from charon import Application, Context, Operator
from charon.server.serve import serve
from charon.runtime.node.inprocess import InProcessRuntime

c = Operator("c")

@c.function(public=True)
async def incr(ctx: Context, n: int) -> int:
    v = ctx.get(default=0) + n
    ctx.put(v)
    return v

serve(InProcessRuntime(Application("loris", [c]), partitions=1), "127.0.0.1", int(sys.argv[1]), None)
"""


def _limit_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def test_slow_connections_do_not_starve_a_normal_request(tmp_path: Path) -> None:
    (tmp_path / "loris_server.py").write_text(SERVER)
    port = free_port()
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "loris_server.py"), str(port)],
        preexec_fn=_limit_files, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    slow: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        for _ in range(1_100):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"POST /invoke/c/k/incr HTTP/1.1\r\nHost: x\r\n")  # an unfinished request head
            slow.append(s)
        for s in slow[-50:]:  # the newest keep trickling header bytes
            try:
                s.sendall(b"X-Slow: 1\r\n")
            except OSError:
                pass
        t0 = time.monotonic()
        r = httpx.post(url + "/invoke/c/k/incr", json={"args": [1]}, timeout=10)
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["value"] == 1, r.text
        print(f"normal request among 1,100 slow connections: {took * 1000:.0f} ms")
        assert took < 3.0, f"a normal request took {took:.2f} s among 1,100 slow connections"
        assert proc.poll() is None
    finally:
        for s in slow:
            s.close()
        proc.terminate()
        proc.wait(15)
        log.close()
