"""Effects soundness over the real path (issue 31 item 6; ../shared/repros r3_effect_squat and r11_effect_big_result):
a ``charon run`` node and a ``charon effects work --url`` worker process, real HTTP.

* r3: a client sending the continuation's request id ``fx.<app>.<tid>.<inv>.<n>.done`` (predictable from its reply)
  is refused with 400 ``ReservedRequestId`` on every route taking an ``Idempotency-Key`` (and by the Python client
  before sending), so the real continuation runs, once.
* r11: a handler's value of 2 MB (above the gateway's 1 MiB ``max_body``) reaches the continuation through the
  worker's route (``POST /effects/continue/...``); a value above the value limit reaches it as a typed failure
  (``ValueTooLarge``): no continuation is lost."""

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
from nodeproc import wait_healthy

from charon import errors
from charon.client import Client
from charon.server.serve import free_port

TESTS = Path(__file__).resolve().parents[1] / "support"
VALUE_LIMIT = 3_000_000  # CHARON_MAX_VALUE_BYTES of both processes (the default 4 MiB works the same)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "CHARON_MAX_VALUE_BYTES": str(VALUE_LIMIT)}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    data = tmp_path_factory.mktemp("fxsound") / "node"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs = data.parent
    engine = subprocess.Popen([sys.executable, "-m", "charon.cli", "run", "fx_soundness_app:app", "--data-dir",
                               str(data), "--port", str(port), "--partitions", "1"], env=_env(),
                              stdout=subprocess.DEVNULL, stderr=open(logs / "engine.log", "wb"))  # noqa: SIM115
    worker = None
    try:
        wait_healthy(engine, url, log=logs / "engine.log")
        worker = subprocess.Popen([sys.executable, "-m", "charon.cli", "effects", "work", "fx_soundness_app:app",
                                   "--url", url, "--data-dir", str(data), "--backoff", "0.05"], env=_env(),
                                  stdout=subprocess.DEVNULL, stderr=open(logs / "worker.log", "wb"))  # noqa: SIM115
        yield url, data
    finally:
        for p in (worker, engine):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _state(url: str, key: str, want: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    with Client(url, timeout=30, retries=5) as c:
        while True:
            s = c.state("orders", key)
            if isinstance(s, dict) and s.get("state") == want:
                return s
            assert time.monotonic() < deadline, f"orders/{key} is {s!r}, not {want!r}"
            time.sleep(0.05)


def _effects(data: Path) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "charon.cli", "effects", "list", "--data-dir", str(data), "--json"],
                         capture_output=True, text=True, timeout=60, env=_env(), check=True)
    return json.loads(out.stdout)["effects"]


def test_r3_no_client_takes_a_continuation_id(node: tuple[str, Path]) -> None:
    url, data = node
    with Client(url, timeout=30) as c:
        placed = c.invoke_result("orders", "o1", "place", 100)
        eid = placed.value
        assert eid == f"fx.fxsound.{placed.tid}.0.1"  # predictable from the reply's tid: hence reserved
        squat = eid + ".done"
        # the Python client refuses before sending, on every call taking a request id
        for call in (lambda: c.invoke("orders", "zz", "noop", request_id=squat),
                     lambda: c.submit("orders", "zz", "noop", request_id=squat),
                     lambda: c.invoke_batch([["orders", "zz", "noop", []]], batch_id=squat)):
            with pytest.raises(errors.CharonError) as refused:
                call()
            assert type(refused.value).__name__ == "ReservedRequestId"
    # the gateway refuses it from any client, before anything reaches the log: /invoke (the direct lane and the
    # ASGI route), /batch, and the other ids the engine mints (timers, portals, wires, admin updates)
    for rid in (squat, "fx.anything", "__charon_timer:t1", "__charon.portal.x", "__charon_admin:u"):
        for path, body in (("/invoke/orders/zz/noop", {"args": []}),
                           ("/invoke/orders/zz/noop?mode=async", {"args": []}),
                           ("/batch", {"calls": [["orders", "zz", "noop", []]]})):
            r = httpx.post(url + path, json=body, headers={"Idempotency-Key": rid}, timeout=30)
            assert r.status_code == 400, (rid, path, r.status_code, r.text)
            assert r.json()["error"]["type"] == "ReservedRequestId", r.text
    # the clients' route is not the workers': /effects/continue takes nothing but a continuation id
    r = httpx.post(url + "/effects/continue/orders/zz/noop", json={"args": []},
                   headers={"Idempotency-Key": "mine-1"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequest", r.text
    # the real continuation ran, once: the card was charged and the order is paid
    s = _state(url, "o1", "paid")
    assert s["runs"] == 1, s
    with Client(url, timeout=30) as c:
        assert c.result_of(squat).value is None  # the engine's own continuation holds the id
    row = next(e for e in _effects(data) if e["id"] == eid)
    assert (row["status"], row["outcome"], row["continuation_error"]) == ("done", "ok", ""), row


def test_r11_any_handler_value_reaches_the_continuation(node: tuple[str, Path]) -> None:
    url, data = node
    with Client(url, timeout=30) as c:
        eid = c.invoke("orders", "b1", "big", 2_000_000)  # 2 MB: above the gateway's 1 MiB max_body
        eid_over = c.invoke("orders", "b2", "big", VALUE_LIMIT + 10)  # above the value limit itself
    s = _state(url, "b1", "done")
    assert (s["ok"], s["len"], s["runs"]) == (True, 2_000_000, 1), s
    s = _state(url, "b2", "done")  # refused at the handler: the continuation gets the typed failure
    assert (s["ok"], s["error_type"], s["runs"]) == (False, "ValueTooLarge", 1), s
    rows = {e["id"]: e for e in _effects(data)}
    assert (rows[eid]["status"], rows[eid]["outcome"], rows[eid]["continuation_error"]) == ("done", "ok", "")
    # the larger body limit is that route's alone, and bounded (2 x the value limit + 1 MiB)
    big = b'{"args": ["' + b"y" * 2_000_000 + b'"]}'
    r = httpx.post(url + "/invoke/orders/zz/peek", content=big, headers={"Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 413, r.text
    huge = b'{"args": ["' + b"y" * (2 * VALUE_LIMIT + (1 << 20)) + b'"]}'
    r = httpx.post(url + "/effects/continue/orders/zz/on_big", content=huge, timeout=60,
                   headers={"Content-Type": "application/json", "Idempotency-Key": "fx.fxsound.1.0.9.done"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "PayloadTooLarge", r.text
    assert (rows[eid_over]["status"], rows[eid_over]["outcome"]) == ("done", "failed"), rows[eid_over]
