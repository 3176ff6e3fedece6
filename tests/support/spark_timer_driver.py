"""A Spark driver for the timer crash test, run as a subprocess (so ``CHARON_CRASH_AT`` can SIGKILL it).

    python tests/support/spark_timer_driver.py DATA_DIR first|resume

``first``: bulk-load four accounts, append holds and reminders (due ~2 s later) and one far timer, start;
the test kills it at a crash point of the epoch that fires the timers. ``resume``: start again over
DATA_DIR, wait until every near timer has fired and the runtime is idle, list and cancel the far timer,
replay the recorded epochs in-process, and print one JSON line with what the test checks.
"""

from __future__ import annotations

import json
import sys
import time

from charon import Request, serde
from charon.apps import holds
from charon.config import SparkConfig
from charon.core import timers
from charon.core.routing import store_key
from charon.runtime.spark.runtime import SparkRuntime
from charon.testing import replay_in_process

APP = "charon.apps.holds:app"
ACCOUNTS = {f"a{i}": 100 for i in range(4)}


def requests() -> list[Request]:
    now = time.time()
    out = [Request(f"h{i}", "acct", f"a{i}", "hold", serde.encode([f"x{i}", 10 * (i + 1), 2.0])) for i in range(4)]
    out += [Request(f"m{i}", "acct", f"a{i}", "remind", serde.encode([f"a{(i + 1) % 4}", f"n{i}", now + 2.0]))
            for i in range(2)]
    out.append(Request("far", "acct", "a3", "remind", serde.encode(["a0", "far", now + 3600.0])))
    return out


def main() -> int:
    data, mode = sys.argv[1], sys.argv[2]
    cfg = SparkConfig(master="local[2]", data_dir=data, partitions=2, max_batch=100, truncate_log=False,
                      timer_poll_ms=20, spark_conf={"spark.sql.streaming.stopTimeout": "60s"})
    rt = SparkRuntime(APP, cfg)
    try:
        if mode == "first":
            rt.load("acct", ACCOUNTS)
            rt.input_log.append_many(requests())
            rt.start()
            print("started", flush=True)
            time.sleep(600)  # the crash point ends this run
            return 1
        rt.start()
        ids = {}
        deadline = time.monotonic() + 120
        while len(ids) < 7 and time.monotonic() < deadline:
            ids = {rid: serde.decode(r.value) for rid in ["h0", "h1", "h2", "h3", "m0", "m1", "far"]
                   if (r := rt.get_reply(rid)) is not None and r.ok}
            time.sleep(0.1)
        near = [ids[k] for k in ["h0", "h1", "h2", "h3", "m0", "m1"]]
        while time.monotonic() < deadline and not all(rt.get_reply(timers.REQUEST_PREFIX + t) for t in near):
            time.sleep(0.1)
        rt.wait_idle(120)
        listed = [t.id for t in rt.timers("acct", "a3")]
        rt.input_log.append(Request("cancel-far", "acct", "a3", "cancel", serde.encode([ids["far"]])))
        rt.wait_idle(120)
        listed_after = [t.id for t in rt.timers("acct", "a3")]
        rt.stop()
        fired = {t: [r.epoch, r.tid, r.ok] for t in near if (r := rt.get_reply(timers.REQUEST_PREFIX + t))}
        initial = {store_key("acct", k): serde.encode(v) for k, v in ACCOUNTS.items()}
        ip, results = replay_in_process(holds.app, rt, initial)
        replies = {r.request_id: r for r in rt.replies()}
        replay_ok = ip.snapshot() == rt.snapshot() and all(
            replies.get(r.request_id) == r for res in results for r in res.replies.values())
        timer_epochs = {t.id: res.epoch for res in results for t in res.timers}
        print(json.dumps({
            "ids": ids, "fired": fired, "timer_epochs": timer_epochs, "listed": listed, "listed_after": listed_after,
            "cancelled": serde.decode(replies["cancel-far"].value), "replay_ok": replay_ok,
            "timer_replies": sorted(rid for rid in replies if rid.startswith(timers.REQUEST_PREFIX)),
            "balances": rt.snapshot() and {k: rt.read_state("acct", k) for k in ACCOUNTS},
            "items": {k: ip.read_items("acct", k) for k in ACCOUNTS},
            "epochs": rt.last_recorded_epoch() + 1,
        }), flush=True)
        return 0
    finally:
        rt.close()


if __name__ == "__main__":
    sys.exit(main())
