"""The repros' app of common mistakes (tests/support/repros/mistakes_app.py) over real HTTP, on a `charon run` process:
a call created and never awaited, and values outside the value model (sets, datetimes, objects) in state,
arguments and return values, are typed aborts naming the function, not silent drops or conversions; the
oracle agrees. (The non-determinism cases, ``rnd``/``clock``/``setiter``, are in test_determinism_check.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from charon import serde
from charon.messages import Request
from charon.testing import serial_execute

REPROS = Path(__file__).resolve().parents[1] / "support" / "repros"
TOKEN = "t"
H = {"Authorization": f"Bearer {TOKEN}"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class App:
    """`charon run mistakes_app:app --engine inprocess` (volatile) in its own process."""

    def __init__(self, *extra: str) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from charon.cli import main; main()", "run", "mistakes_app:app", "--engine",
             "inprocess", "--port", str(self.port), "--token", TOKEN, "--partitions", "2", *extra],
            cwd=REPROS, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**{k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"},
                 "PYTHONPATH": os.pathsep.join([str(REPROS), str(REPROS.parents[2])])},  # this checkout's charon
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.proc.stderr.read()  # type: ignore[union-attr]
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)

    def invoke(self, fn: str, key: str = "k", args: list | None = None) -> dict:
        r = httpx.post(f"{self.url}/invoke/acc/{key}/{fn}", json={"args": args or []}, headers=H, timeout=30)
        body = r.json()
        err = body.get("error") or {}
        return {**body, "status": r.status_code, "error_type": err.get("type"), "error": err.get("message")}

    def state(self, op: str, key: str) -> object:
        r = httpx.get(f"{self.url}/state/{op}/{key}", headers=H, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["value"]

    def close(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = App("--data-dir", str(tmp_path_factory.mktemp("mistakes")))
    yield srv
    srv.close()


def _oracle(fn: str, args: list | None = None) -> tuple:
    sys.path.insert(0, str(REPROS))
    try:
        from mistakes_app import app
    finally:
        sys.path.remove(str(REPROS))
    return serial_execute(app, {}, 1, Request("q", "acc", "k", fn, serde.encode(args or [])))


def test_unawaited_call_is_a_typed_abort_over_http(server: App) -> None:
    r = server.invoke("no_await")
    assert r["status"] != 200, r  # was 200 "done", the call silently dropped
    assert r["error_type"] == "UnawaitedCall", r
    assert "acc.no_await on key 'k'" in r["error"] and "ctx.call(other, 'x', bump)" in r["error"], r
    assert server.state("other", "x") is None  # nothing of the transaction applied
    ok, err = _oracle("no_await")
    assert not ok and err[0] == "UnawaitedCall" and err[1] == r["error"]


@pytest.mark.parametrize(("fn", "kind"), [("put_set", "set"), ("put_dt", "datetime"), ("ret_set", "set"),
                                          ("bad_arg", "set"), ("put_obj", "Thing")])
def test_values_outside_the_value_model_are_refused_over_http(server: App, fn: str, kind: str) -> None:
    r = server.invoke(fn, key=f"k-{fn}")
    assert r["status"] != 200, r  # was 200: the set/datetime silently became a list/timestamp
    assert r["error_type"] == "SerializationError", r
    assert kind in r["error"], r
    assert server.state("acc", f"k-{fn}") is None  # nothing stored
    ok, err = _oracle(fn)
    assert not ok and err[0] == "SerializationError"


def test_charon_run_pins_the_hash_seed(server: App) -> None:
    """`charon run` re-executes itself with PYTHONHASHSEED=0 (unless set): a set of strings iterates in the same
    order in every run of the process, so a replay after a restart reproduces the replies already sent."""
    names = [f"name-{i}" for i in range(12)]
    code = f"import json; print(json.dumps(list(set({names!r}))))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    seed0 = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONHASHSEED": "0"}, capture_output=True,
                           text=True, check=True).stdout
    r = server.invoke("setiter", key="seed", args=[names])
    assert r["status"] == 200, r
    assert r["value"] == json.loads(seed0), (r["value"], seed0)
