"""Stream-to-application wiring (issue 12 item 3): exactly-once delivery across restarts, cycles allowed."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from charon import InProcessRuntime, Request, serde
from charon.runtime.wiring import StreamWire

TESTS = Path(__file__).resolve().parents[1] / "support"
sys.path.insert(0, str(TESTS))
from wire_apps import bank, shop  # noqa: E402


def _orders(rng: random.Random, n: int, start: int = 0) -> list[Request]:
    return [Request(f"o{i}", "orders", f"o{i}", "place", serde.encode([f"c{rng.randint(0, 4)}", rng.randint(1, 9)]),
                    0.0) for i in range(start, start + n)]


async def test_a_cycle_between_two_applications_delivers_each_event_once() -> None:
    """shop -> to_pay -> bank -> paid -> shop, with both wires stepped repeatedly and restarted from
    scratch (no checkpoint) midway: every order is charged once and marked paid once."""
    rng = random.Random(1)
    s = InProcessRuntime(shop, partitions=2)
    b = InProcessRuntime(bank, partitions=3)
    async with s, b:
        to_pay = StreamWire(s.streams, "to_pay", b, "accounts", "charge", max_events=7)
        paid = StreamWire(b.streams, "paid", s, "orders", "mark_paid", max_events=4)
        for i in range(4):
            for r in _orders(rng, 15, 15 * i):
                s.enqueue(r)
            for _ in range(5):
                await to_pay.step()
                await paid.step()
                await asyncio.sleep(0.005)  # the shop's epochs run meanwhile
            if i == 1:  # a restart without checkpoints: everything is delivered again, and runs once
                before = (to_pay.delivered, paid.delivered)
                assert min(before) > 0
                to_pay = StreamWire(s.streams, "to_pay", b, "accounts", "charge", max_events=50)
                paid = StreamWire(b.streams, "paid", s, "orders", "mark_paid", max_events=50)
        while to_pay.offset < 60 or paid.offset < 60:
            await to_pay.step()
            await paid.step()
            await asyncio.sleep(0.002)
        assert to_pay.delivered == paid.delivered == 60  # the new wires delivered everything again
    assert all(o["paid"] == 1 for o in s.entities("orders").values()) and len(s.entities("orders")) == 60
    charged = {}
    for c in (f"c{i}" for i in range(5)):
        charged.update(b.read_items("accounts", c))
    assert sorted(charged) == sorted(f"o{i}" for i in range(60)) and set(charged.values()) == {1}
    total = sum(o["amount"] for o in s.entities("orders").values())
    assert -sum(b.entities("accounts").values()) == total


def test_sigkill_of_the_consuming_application_keeps_exactly_once(tmp_path: Path) -> None:
    """The bank (a durable node fed by the shop's stream) is SIGKILLed at random moments while it takes
    the orders; after restarts it has charged every order exactly once."""
    shop_rt = InProcessRuntime(shop, partitions=2, data_dir=str(tmp_path / "shop"), fsync=False)
    rng = random.Random(5)
    for e in range(20):
        shop_rt.run_epoch(_orders(rng, 10, 10 * e))
    n = shop_rt.streams.end_offset("to_pay")
    assert n == 200
    bank_dir = str(tmp_path / "bank")
    kills = 0
    resumed: list[int] = []
    for attempt in range(8):
        p = subprocess.Popen([sys.executable, str(TESTS / "wire_consumer.py"), bank_dir, shop_rt.streams.path,
                              str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("started"), p.stderr.read() if p.stderr else ""
        resumed.append(int(line.split()[1]))
        if attempt < 3:
            time.sleep(rng.uniform(0.2, 0.7))
            p.send_signal(signal.SIGKILL)
            p.wait(30)
            kills += p.returncode == -signal.SIGKILL
            continue
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "done" in out, err
        break
    assert kills >= 2 and any(0 < r < n for r in resumed), resumed  # killed midway, resumed from its checkpoint
    bank_rt = InProcessRuntime(bank, partitions=2, data_dir=bank_dir)
    try:
        charged: dict[str, int] = {}
        for c in (f"c{i}" for i in range(5)):
            charged.update(bank_rt.read_items("accounts", c))
        assert sorted(charged) == sorted(f"o{i}" for i in range(200))
        assert set(charged.values()) == {1}, {k: v for k, v in charged.items() if v != 1}
        total = sum(o["amount"] for o in shop_rt.entities("orders").values())
        assert -sum(bank_rt.entities("accounts").values()) == total
        assert bank_rt.streams.end_offset("paid") == 200  # one confirmation per order
    finally:
        bank_rt.close()
        shop_rt.close()


def test_transaction_timeout_reaches_the_durable_nodes_watchdog_and_is_refused_elsewhere(tmp_path: Path) -> None:
    import pytest

    from charon.runtime.factory import EngineSpec, EngineSpecError, make_engine

    eng = make_engine(EngineSpec("inprocess", "charon.apps.holds:app", data_dir=str(tmp_path), transaction_timeout=0.7,
                                 function_timeout=0.2))
    try:
        assert eng.rt.watchdog.transaction_timeout == 0.7  # type: ignore[attr-defined]
        assert eng.rt.watchdog.timeout == 0.2  # type: ignore[attr-defined]
    finally:
        eng.rt.close()  # type: ignore[attr-defined]
    with pytest.raises(EngineSpecError, match="--transaction-timeout applies to --engine inprocess only"):
        EngineSpec("spark", "charon.apps.holds:app", transaction_timeout=1.0).check()
