"""The saga example, a workflow over durable effects (issue 23 item 3, issue 34 item 4): orders reserve stock,
charge a card and ship through a real external HTTP service (its own process) that fails at random, declines some
charges and shipments; the engine (``charon run --effects``) is SIGKILLed once mid-run. Money and stock are
conserved, every order is completed or compensated (never both, never neither), and each step ran exactly once."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

from nodeproc import kill, start_charon

from charon import UnknownWorkflow
from charon.client import Client
from charon.server.serve import free_port

TESTS = Path(__file__).resolve().parents[1] / "support"  # the test apps and the external service
sys.path.insert(0, str(TESTS))
from effects_service import Service  # noqa: E402

ITEMS = {"apple": 25, "pear": 20, "fig": 5}  # fig runs out: some orders are rejected
N = 30


def _start(data: Path, port: int, service: Service) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CHARON_SAGA_SERVICE_URL": service.url}
    return start_charon(["run", "charon.apps.saga:app", "--data-dir", str(data), "--effects"], port=port, env=env,
                        log=data.parent / f"engine-{time.time():.3f}.log")


def _outcome(c: Client, order: str) -> dict | None:
    """The order's saga as the oracle reads it: its state, why it compensated, and the steps that committed."""
    try:
        rec = c.workflow("saga", order)
    except UnknownWorkflow:
        return None
    state = {"done": rec["result"], "compensated": "compensated"}.get(rec["status"], rec["status"])
    return {"state": state, "why": rec["state"].get("why"), "steps": [h["step"] for h in rec["history"]]}


def test_saga_under_random_failures_and_a_kill_conserves_money_and_stock(tmp_path: Path) -> None:
    rng = random.Random(23)
    plan = [(f"o{i}", f"c{i % 7}", rng.choice(list(ITEMS)), rng.randint(1, 3), rng.randint(5, 50),
             rng.random() < 0.2, rng.random() < 0.2) for i in range(N)]
    service = Service(str(tmp_path / "service.sqlite")).start()
    service.control(fail_rate=0.3)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = _start(tmp_path / "data", port, service)

    def place_all() -> None:
        with Client(url, timeout=30, retries=5) as c:
            for oid, cust, item, qty, amount, decline, fail_ship in plan:
                c.submit("orders", oid, "place", cust, item, qty, amount, decline, fail_ship, request_id=f"place-{oid}")

    try:
        with Client(url, timeout=30) as c:
            for item, qty in ITEMS.items():
                c.invoke("stock", item, "fill", qty, request_id=f"fill-{item}")
        place_all()
        deadline = time.monotonic() + 60
        while len(service.stats()["applied"]) < 10:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        kill(engine)  # mid-saga: some charged, some shipping, some compensating
        engine = _start(tmp_path / "data", port, service)
        place_all()  # clients retry: each order placed once
        deadline = time.monotonic() + 180
        with Client(url, timeout=30, retries=5) as c:
            while True:
                docs = {p[0]: _outcome(c, p[0]) for p in plan}
                if all(d and d["state"] in ("completed", "compensated", "rejected") for d in docs.values()):
                    break
                assert time.monotonic() < deadline, docs
                time.sleep(0.2)
            stock_left = {item: c.state("stock", item) for item in ITEMS}
    finally:
        kill(engine)
    applied = service.stats()["applied"]
    attempts = service.stats()["attempts"]
    service.kill()

    charges = [b for b in applied.values() if b["op"] == "charge" and not b["decline"]]
    refunds = [b for b in applied.values() if b["op"] == "refund"]
    completed = [p for p in plan if docs[p[0]]["state"] == "completed"]
    compensated = [p for p in plan if docs[p[0]]["state"] == "compensated"]
    rejected = [p for p in plan if docs[p[0]]["state"] == "rejected"]
    assert completed and compensated and len(completed) + len(compensated) + len(rejected) == N
    whys = {docs[p[0]]["why"] for p in compensated}
    assert whys == {"charge failed", "shipment failed"}, whys  # both compensation paths ran
    # money: what the card processor kept is what the completed orders cost
    assert sum(b["amount"] for b in charges) - sum(b["amount"] for b in refunds) == sum(p[4] for p in completed)
    # stock: what left the shelves is what the completed orders took
    for item, initial in ITEMS.items():
        assert initial - stock_left[item] == sum(p[3] for p in completed if p[2] == item), item
    # never both: a completed order was shipped and not refunded; a compensated one not shipped, refunded iff charged
    refunded = {b["order"] for b in refunds}
    shipped = {b["order"] for b in applied.values() if b["op"] == "ship" and not b["decline"]}
    assert {p[0] for p in completed} == shipped and not refunded & shipped
    for p in compensated:
        d = docs[p[0]]
        assert (p[0] in refunded) == (d["why"] == "shipment failed"), d
        # each step once (the refund awaited by the built-in compensation step)
        assert d["steps"] == (["take_stock", "charged", "shipped", "charon.compensate"] if d["why"] ==
                              "shipment failed" else ["take_stock", "charged"]), d
    assert all(docs[p[0]]["steps"] == ["take_stock", "charged", "shipped"] for p in completed)
    assert all(docs[p[0]]["steps"] == ["take_stock"] for p in rejected)
    assert sum(attempts.values()) > len(applied) > 25  # retried; the kill (after 10 applied) was mid-run
