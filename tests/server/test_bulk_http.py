"""Bulk operations over real HTTP on the durable node (issue 34 item 5): ``charon run`` (a subprocess, durable in-
process engine, effects beside it) takes bulk cancels of promises and queued invocations, bulk pauses and deletes of
schedules and bulk retries of parked effects, by filter, a page per call with a dry run first; bad filters are typed
4xx; every call is audited; the input log replayed epoch by epoch decides every request alike. Then the node is
SIGKILLed during a bulk cancel: after the restart every promise is either cancelled exactly once (its continuation
ran once, with ``PromiseCancelled``) or still pending, and the audit's lines say which call was cut short; the
operation repeated under its id finishes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from nodeproc import kill, start_charon

from charon import serde
from charon.client import Client, GatewayError
from charon.log.sqlite import InputLog, OutputLog
from charon.runtime.node.inprocess import InProcessRuntime
from charon.runtime.node.storage import EPOCH_MARK
from charon.server.serve import free_port

SUPPORT = Path(__file__).resolve().parents[1] / "support"
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(SUPPORT))
TOKEN = "bulk-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(SUPPORT)]), "CHARON_TOKEN": TOKEN,
            "BULK_APP_FLAG": str(tmp / "service-up")}


def _start(tmp: Path, port: int) -> subprocess.Popen[bytes]:
    return start_charon(["run", "bulk_app:app", "--data-dir", str(tmp / "data"), "--partitions", "2", "--effects",
                         "--park-failed", "--log-format", "json"], port=port, env=_env(tmp),
                        log=tmp / f"node-{time.time():.3f}.log", group=True)


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGINT) -> None:
    kill(proc, sig, group=True)


def _wait(pred: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _audit(tmp: Path) -> list[dict[str, Any]]:
    lines = []
    for log in sorted(tmp.glob("node-*.log")):
        for raw in log.read_text().splitlines():
            if raw.startswith("{"):
                doc = json.loads(raw)
                if doc.get("logger") == "charon.admin" and doc.get("action") == "bulk":
                    lines.append({**doc, "log": log.name})
    return lines


def _bulk(url: str, resource: str, action: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = AUTH if key is None else {**AUTH, "Idempotency-Key": key}
    return httpx.post(f"{url}/admin/bulk/{resource}/{action}", json=body, headers=headers, timeout=90)


def _cli(url: str, *args: str) -> Any:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CHARON_URL": url, "CHARON_TOKEN": TOKEN}
    out = subprocess.run([sys.executable, "-m", "charon.cli", *args], env=env, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    return json.loads(out.stdout)


def test_bulk_operations_by_filter_over_http(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    node = _start(tmp_path, port)
    try:
        with Client(url, token=TOKEN, timeout=60, retries=2) as c:
            pids = {k: c.invoke("orders", k, "place", 3600.0) for k in
                    [f"eu-{i}" for i in range(10)] + [f"us-{i}" for i in range(10)]}

            # -- typed 4xx before anything reaches the log
            for resource, action, body, status, etype in [
                ("promises", "cancel", {"where": {"colour": "red"}}, 400, "BadRequest"),
                ("promises", "cancel", {"where": {"error_type": "X"}}, 400, "BadRequest"),
                ("promises", "cancel", {"where": {"since": 10, "until": 5}}, 400, "BadRequest"),
                ("promises", "cancel", {"where": {"since": "yesterday"}}, 400, "BadRequest"),
                ("promises", "cancel", {"limit": 0}, 400, "BadRequest"),
                ("promises", "cancel", {"limit": 1001}, 400, "BadRequest"),
                ("promises", "cancel", {"cursor": "not-a-promise"}, 400, "BadRequest"),
                ("invocations", "cancel", {"cursor": "abc"}, 400, "BadRequest"),
                ("promises", "cancel", {"dry_run": "yes"}, 400, "BadRequest"),
                ("promises", "cancel", {"surprise": 1}, 400, "BadRequest"),
                ("invocations", "pause", {}, 404, "NotFound"),
                ("timers", "cancel", {}, 404, "NotFound"),
            ]:
                r = _bulk(url, resource, action, body)
                assert (r.status_code, r.json()["error"]["type"]) == (status, etype), (resource, body, r.text)
            assert httpx.post(f"{url}/admin/bulk/promises/cancel", json={}, timeout=30).status_code == 401
            assert all(c.promise(p)["status"] == "pending" for p in pids.values())

            # -- promises: a dry run counts, then pages of 4 cancel the eu ones (each through its own cancel)
            dry = c.bulk("promises", "cancel", {"key_prefix": "eu-"}, dry_run=True, limit=1000)
            assert (dry["matched"], dry["done"], dry["next"], dry["dry_run"]) == (10, 0, None, True)
            assert all(c.promise(p)["status"] == "pending" for p in pids.values())
            total = c.bulk_all("promises", "cancel", {"key_prefix": "eu-", "operator": "orders",
                                                      "function": "decided"}, limit=4, reason="region closed")
            assert total["done"] == 10 and total["pages"] >= 5 and sorted(total["items"]) == sorted(
                p for k, p in pids.items() if k.startswith("eu-"))
            for k, p in pids.items():
                rec = c.promise(p)
                assert rec["status"] == ("cancelled" if k.startswith("eu-") else "pending"), (k, rec)

            def continued() -> bool:
                ents = c.read_state("orders", list(pids))["entities"]
                return all(ents[k]["runs"] == (1 if k.startswith("eu-") else 0) for k in pids)
            _wait(continued, "the cancelled promises' continuations")
            ents = c.read_state("orders", list(pids))["entities"]
            assert {ents[k]["outcome"]["error_type"] for k in pids if k.startswith("eu-")} == {"PromiseCancelled"}
            assert {ents[k]["outcome"]["error"] for k in pids if k.startswith("eu-")} == {"region closed"}
            again = c.bulk("promises", "cancel", {"key_prefix": "eu-"}, limit=1000)
            assert (again["matched"], again["done"]) == (0, 0)  # nothing pending matches any more
            t_us = c.promise(pids["us-0"])["created"]
            window = c.bulk("promises", "cancel", {"until": t_us - 3600}, dry_run=True, limit=1000)
            assert window["matched"] == 0  # a time range before every promise
            cli = _cli(url, "promises", "bulk", "cancel", "--key-prefix", "us-", "--dry-run", "--json")
            assert cli["matched"] == 10 and cli["done"] == 0

            # -- schedules: pause then delete by name prefix, the others untouched
            for name in ("rep-a", "rep-b", "rep-c", "keep"):
                c.create_schedule(name, "0 0 1 1 *", "ticks", name, "count")
            paused = c.bulk_all("schedules", "pause", {"key_prefix": "rep-"}, limit=2)
            assert paused["done"] == 3
            assert [c.schedule(n)["paused"] for n in ("rep-a", "rep-b", "rep-c", "keep")] == [True] * 3 + [False]
            deleted = _cli(url, "schedules", "bulk", "delete", "--key-prefix", "rep-", "--function", "count",
                           "--json")
            assert deleted["done"] == 3
            assert [s["name"] for s in c.schedules()["schedules"]] == ["keep"]

            # -- invocations waiting for admission: cancelled by the epoch that takes the cancel
            for i in range(6):
                r = httpx.post(f"{url}/invoke/lim/k/take?mode=async", json={"args": [1]}, timeout=30,
                               headers={**AUTH, "Idempotency-Key": f"take-{i}"})
                assert r.status_code in (200, 202), r.text
            _wait(lambda: c.limits()["held"] == 5, "five requests held by admission")
            dry = c.bulk("invocations", "cancel", {"function": "take", "key_prefix": "k"}, dry_run=True)
            assert (dry["matched"], dry["done"]) == (5, 0) and c.limits()["held"] == 5
            none = c.bulk("invocations", "cancel", {"key_prefix": "other"})
            assert (none["matched"], none["done"]) == (0, 0) and c.limits()["held"] == 5
            gone = _cli(url, "requests", "bulk", "cancel", "--operator", "lim", "--json")
            assert gone["done"] == 5 and sorted(gone["items"]) == [f"take-{i}" for i in range(1, 6)]
            assert c.limits()["held"] == 0
            answers = [httpx.get(f"{url}/requests/take-{i}", headers=AUTH, timeout=30) for i in range(6)]
            assert answers[0].status_code == 200
            assert {(a.status_code, a.json()["error"]["type"]) for a in answers[1:]} == {(409, "InvocationCancelled")}
            assert c.read_state("lim", ["k"])["entities"]["k"] == 1  # the cancelled ones never ran

            # -- parked effects: retried by error type once the service is back
            for i in range(3):
                c.invoke("orders", f"fx-{i}", "charge")
            _wait(lambda: httpx.get(f"{url}/admin/effects", headers=AUTH, timeout=30).json()["counts"]["failed"] == 3,
                  "three parked effects")
            assert c.bulk("effects", "retry", {"error_type": "TimeoutError"}, dry_run=True)["matched"] == 0
            dry = c.bulk("effects", "retry", {"error_type": "ConnectionError", "function": "flaky"}, dry_run=True)
            assert dry["matched"] == 3 and dry["done"] == 0
            (tmp_path / "service-up").write_text("")
            assert c.bulk_all("effects", "retry", {"error_type": "ConnectionError"}, limit=2)["done"] == 3
            _wait(lambda: all(v and v["runs"] == 1 and v["charged"]["ok"] for v in
                              c.read_state("orders", [f"fx-{i}" for i in range(3)])["entities"].values()),
                  "the retried effects' continuations")
    finally:
        _stop(node)
    audit = _audit(tmp_path)
    done = [a for a in audit if a.get("event") != "started"]
    assert len(done) == len([a for a in audit if a.get("event") == "started"]) + 12  # the 12 refusals: no start
    ok = [a for a in done if a["status"] == 200]
    assert all({"operation", "resource", "bulk_action", "where", "dry_run", "matched", "done"} <= set(a) for a in ok)
    cancels = [a for a in ok if a["resource"] == "promises" and not a["dry_run"]
               and a["where"].get("key_prefix") == "eu-" and a["done"]]
    assert sum(a["done"] for a in cancels) == 10 and len({a["operation"] for a in cancels}) == 1
    assert any(a["resource"] == "invocations" and a["done"] == 5 for a in ok)
    # replay-exact: the node's input log, replayed epoch by epoch in a fresh runtime, decides every request alike
    inp = InputLog(tmp_path / "data" / "input.sqlite", durable=False)
    out = OutputLog(tmp_path / "data" / "output.sqlite", durable=False)
    epochs: list[tuple[float, list[Any]]] = []
    batch: list[Any] = []
    for _, data in inp.read_raw(0, inp.start_offsets()[0], inp.end_offsets()[0]):
        req = serde.decode_request(data)
        if req.operator == EPOCH_MARK:
            epochs.append((req.ts, batch))
            batch = []
        else:
            batch.append(req)
    from bulk_app import app

    replay = InProcessRuntime(app, partitions=2, effects=False)
    decided: dict[str, str] = {}
    for ts, reqs in epochs:
        for rep in replay.run_epoch(reqs, now=ts).replies.values():
            live = out.get(rep.request_id)
            if live is not None:
                assert (live.ok, live.error_type, live.tid, live.value) == (rep.ok, rep.error_type, rep.tid,
                                                                            rep.value), rep.request_id
                decided[rep.request_id] = rep.error_type
    assert [decided[f"take-{i}"] for i in range(6)] == [""] + ["InvocationCancelled"] * 5


def _cancel_page(url: str, op: str, cursor: str | None, out: dict[str, Any]) -> None:
    """One page (10 promises) of the bulk cancel under ``op``, the one the kill cuts short."""
    try:
        with Client(url, token=TOKEN, timeout=60, retries=0) as c:
            out["page"] = c.bulk("promises", "cancel", {"operator": "orders"}, limit=10, cursor=cursor, operation=op)
    except (GatewayError, httpx.HTTPError, OSError) as exc:
        out["error"] = exc


@pytest.mark.parametrize("kill_after_pages", [3])
def test_a_sigkill_during_a_bulk_cancel_leaves_each_promise_cancelled_once_or_intact(
        tmp_path: Path, kill_after_pages: int) -> None:
    n = 120
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    node = _start(tmp_path, port)
    try:
        op = "bulk-kill-op"
        cursor: str | None = None
        with Client(url, token=TOKEN, timeout=60, retries=2) as c:
            pids = {f"o{i:03d}": c.invoke("orders", f"o{i:03d}", "place", 3600.0, request_id=f"place-{i}")
                    for i in range(n)}
            for _ in range(kill_after_pages):  # whole pages, then the kill lands on the next one's way
                cursor = c.bulk("promises", "cancel", {"operator": "orders"}, limit=10, cursor=cursor,
                                operation=op)["next"]
                assert cursor is not None
        out: dict[str, Any] = {}
        worker = threading.Thread(target=_cancel_page, args=(url, op, cursor, out), daemon=True)
        worker.start()
        _wait(lambda: len([a for a in _audit(tmp_path) if a.get("event") == "started"]) > kill_after_pages,
              "the next page under way", timeout=120)
        os.killpg(node.pid, signal.SIGKILL)
        node.wait(30)
        worker.join(90)
        assert not worker.is_alive()
        first = _audit(tmp_path)
        node = _start(tmp_path, port)
        with Client(url, token=TOKEN, timeout=60, retries=5) as c:
            recs: dict[str, Any] = {}
            while True:  # requests logged before the kill run in the first epochs after the restart
                seen = {k: c.promise(p) for k, p in pids.items()}
                if {k: r["status"] for k, r in seen.items()} == {k: r["status"] for k, r in recs.items()}:
                    break
                recs = seen
                time.sleep(1.0)
            assert {r["status"] for r in recs.values()} <= {"pending", "cancelled"}
            cut = [k for k, r in recs.items() if r["status"] == "cancelled"]
            assert cut, "the kill came before any page"

            def settled(expect: Callable[[str], int]) -> Callable[[], bool]:
                return lambda: all(v["runs"] == expect(k) for k, v in
                                   c.read_state("orders", list(pids))["entities"].items())
            _wait(settled(lambda k: int(k in cut)), "the continuations of the promises cancelled before the kill")
            # the same operation again: what was cancelled is not again (its continuation ran once)
            total = c.bulk_all("promises", "cancel", {"operator": "orders"}, limit=50, operation=op)
            now = {k: c.promise(p)["status"] for k, p in pids.items()}
            assert set(now.values()) == {"cancelled"}, ({k: v for k, v in now.items() if v != "cancelled"}, total)
            # a cancel the cut-short page had logged may run only now, after the records were read: the rerun's
            # own cancel of that promise then finds it settled (PromiseConflict, nothing changed)
            late = total["skipped"].pop("PromiseConflict", 0)
            assert total["done"] + late == n - len(cut) and late <= 10 and total["skipped"] == {}, (total, cut)
            _wait(settled(lambda k: 1), "every continuation, once")
            ents = c.read_state("orders", list(pids))["entities"]
            assert {v["outcome"]["error_type"] for v in ents.values()} == {"PromiseCancelled"}
    finally:
        _stop(node)
    # the audit: the calls before the kill each logged their count, the one cut short only its start
    starts = [a for a in first if a.get("event") == "started"]
    ends = [a for a in first if a.get("event") != "started"]
    assert {a["operation"] for a in first} == {op}
    cut_short = len(starts) - len(ends)
    assert cut_short in (0, 1) and all(a["status"] == 200 and a["done"] == 10 for a in ends)
    before = sum(a["done"] for a in ends)
    assert before <= len(cut) <= before + 10 * cut_short  # plus what the page cut short had committed
    after = [a for a in _audit(tmp_path) if a not in first and a.get("event") != "started"]
    assert sum(a["done"] for a in after) == total["done"]
