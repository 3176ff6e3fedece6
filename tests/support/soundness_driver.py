"""Phases of the watchdog soundness tests that must run in a process of their own (killed, then recovered).

    python soundness_driver.py caught DIR KIND      `caught` past a 0.3 s budget, then os._exit
    python soundness_driver.py slow DIR             first run: `slow` (1.5 s) under a 10 s budget, then os._exit
    python soundness_driver.py recover DIR BUDGET [EXIT_AFTER]   recovery: the stored replies, state, dead letters
    python soundness_driver.py torture DIR SEED EPOCHS BUDGET    a seeded torture run (killed by the test)

Every line printed is one JSON document.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import traceback
from typing import Any

from soundness_app import app, handler

from charon import InProcessRuntime, Request, serde
from charon.core.partition import Interrupt


def _reply(r: Any) -> dict[str, Any]:
    return {"ok": r.ok, "value": bytes(r.value).hex(), "error_type": r.error_type or "",
            "error_message": r.error_message or "", "epoch": r.epoch, "position": r.position}


def _req(rid: str, key: str, fn: str, *args: object) -> Request:
    return Request(rid, "acc", key, fn, serde.encode(list(args)))


def first_run(data_dir: str, req: Request, budget: float) -> None:
    rt = InProcessRuntime(app, data_dir=data_dir, partitions=1, function_timeout=budget, checkpoint_s=1e9,
                          warmup_txns=0, watchdog_interval=0.02)
    rt.watchdog.start()  # batch mode: the service loop is not running; the watchdog runs as in service mode
    res = rt.run_epoch([req])
    r = res.replies[min(res.replies)]
    print(json.dumps({"reply": _reply(r), "state": rt.read_state("acc", req.key)}), flush=True)
    os._exit(0)  # a crash before any checkpoint: the restart replays the epoch


def recover(data_dir: str, budget: float, exit_after: float | None) -> None:
    rt = InProcessRuntime(app, data_dir=data_dir, partitions=1, function_timeout=budget, checkpoint_s=1e9,
                          warmup_txns=0, watchdog_interval=0.02, exit_when_stuck=exit_after)
    try:
        replies = {}
        acked = os.path.join(data_dir, "acked.jsonl")
        ids = []
        if os.path.exists(acked):
            with open(acked, "rb") as f:
                for line in f:
                    try:
                        ids.append(json.loads(line)["id"])
                    except ValueError:
                        break  # a torn last line: never acknowledged
        for rid in ids or ["req-1"]:
            r = rt.node.known(rid) if rt.node is not None else None
            replies[rid] = _reply(r) if r is not None and r is not True and r is not False else None
        keys = sorted({k for k in ("k", *(f"k{i}" for i in range(8)))})
        print(json.dumps({"replies": replies, "state": {k: rt.read_state("acc", k) for k in keys},
                          "dead_letters": [(d["request_id"], d["error_type"]) for d in rt.dead_letters()],
                          "replayed": rt.replayed_epochs}), flush=True)
    finally:
        rt.close()


# -- the torture run ------------------------------------------------------------------------------------------------
KINDS = ("inc", "work_then_raise", "caught_bare", "caught_base", "caught_finally", "chatty", "slow", "hog",
         "slow_str_boom")


def _workload(rng: random.Random, epoch: int, budget: float) -> list[Request]:
    out = []
    for i in range(rng.randint(3, 8)):
        rid = f"e{epoch}-{i}"
        key = f"k{rng.randrange(8)}"
        kind = rng.choice(KINDS)
        t = budget * rng.uniform(0.5, 3.0)  # about its budget: some finish, most are interrupted at a random point
        if kind == "inc":
            out.append(_req(rid, key, "inc", rng.randint(1, 9)))
        elif kind == "work_then_raise":
            out.append(_req(rid, key, "work_then_raise", t))
        elif kind.startswith("caught_"):
            out.append(_req(rid, key, "caught", kind[len("caught_"):], t))
        elif kind == "chatty":
            out.append(_req(rid, key, "chatty", int(t / 4e-6)))  # about 4 us a line
        elif kind == "slow":
            out.append(_req(rid, key, "slow", t, rng.randint(1, 99)))
        elif kind == "hog":
            out.append(_req(rid, key, "hog", rng.randint(2, 6), budget * rng.uniform(0.3, 0.9)))
        else:
            out.append(_req(rid, key, "slow_str_boom"))
    return out


def _lock_free() -> bool:
    got: list[bool] = []

    def probe() -> None:
        ok = handler.lock.acquire(timeout=2.0)  # type: ignore[union-attr]
        if ok:
            handler.lock.release()  # type: ignore[union-attr]
        got.append(ok)

    th = threading.Thread(target=probe)
    th.start()
    th.join()
    return got[0]


def torture(data_dir: str, seed: int, epochs: int, budget: float) -> None:
    rng = random.Random(seed)
    rt = InProcessRuntime(app, data_dir=data_dir, partitions=2, function_timeout=budget,
                          watchdog_interval=budget / 10, warmup_txns=0, fsync=False, checkpoint_s=0.2)
    start = rt.epoch
    rt.watchdog.start()
    fd = os.open(os.path.join(data_dir, "acked.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    stats = {"epochs": 0, "replies": 0, "timeouts": 0, "escaped": 0, "lock_leaks": 0}
    for n in range(epochs):
        reqs = _workload(rng, start + n, budget)
        try:
            res = rt.run_epoch(reqs)
        except Interrupt:
            stats["escaped"] += 1
            print(json.dumps({"escaped": traceback.format_exc()}), flush=True)
            os._exit(3)
        for r in res.replies.values():
            stats["replies"] += 1
            stats["timeouts"] += r.error_type in ("InvocationTimeout", "Quarantined")
            os.write(fd, (json.dumps({"id": r.request_id, "reply": _reply(r)}) + "\n").encode())
        stats["epochs"] += 1
        if not _lock_free():
            stats["lock_leaks"] += 1
            print(json.dumps({"lock_leak_at_epoch": start + n}), flush=True)
            os._exit(4)
        if n % 5 == 0:
            print(json.dumps({"progress": stats, "delivered": rt.watchdog.delivered,
                              "deferred": rt.watchdog.deferred}), flush=True)
    print(json.dumps({"done": stats, "delivered": rt.watchdog.delivered, "deferred": rt.watchdog.deferred}),
          flush=True)
    rt.watchdog.stop()
    rt.close()


if __name__ == "__main__":
    cmd, d = sys.argv[1], sys.argv[2]
    if cmd == "caught":
        first_run(d, _req("req-1", "k", "caught", sys.argv[3], 1.0), 0.3)
    elif cmd == "slow":
        first_run(d, _req("req-1", "k", "slow", 1.5, 42), 10.0)
    elif cmd == "recover":
        recover(d, float(sys.argv[3]), float(sys.argv[4]) if len(sys.argv) > 4 else None)
    elif cmd == "torture":
        torture(d, int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    else:
        raise SystemExit(f"unknown phase {cmd}")
