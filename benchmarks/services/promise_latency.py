"""Durable promises: resolve sent -> continuation committed, on the durable node (fsync per epoch).

``charon run promises_app:app`` (``tests/support/promises_app.py``: ``orders/place`` creates a promise whose
continuation ``decided`` writes the order's state, ``runs`` + 1) in its own process through the shared harness,
``--data-dir`` (fsync per epoch). ``--promises`` orders each create a promise (``POST /invoke/orders/oN/place``);
then each is resolved over HTTP (``POST /promises/{id}/resolve``, an Idempotency-Key each):

* **one by one**: resolve, then poll the order's state (``GET /state/orders/oN``) every ``--poll-ms`` until
  ``runs == 1``, then the next;
* **open loop**: resolves sent at ``--rate`` per second for ``--duration`` seconds whatever the answers, one
  poller reading the outstanding orders together (``GET /admin/state/orders?key=..``) every ``--poll-ms``.

The continuation runs as a transaction of its own in an epoch after the resolve's (the resolve registers a timer
due at once: ``charon/core/promises.py``), so the resolve's reply does not say it committed; the order's state
does (a read between epochs; in durable mode an epoch's batch is in the input log before it runs). Latency =
resolve sent -> the first read that sees ``runs == 1``: it includes up to one poll interval and one read's round
trip. Also reported: the resolve's own reply (its transaction committed). Writes
``benchmarks/results/services/promise_latency.json`` and ``.png``.

    .venv/bin/python benchmarks/services/promise_latency.py --promises 300 --rate 100 --duration 20
    .venv/bin/python benchmarks/services/promise_latency.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from _meta import ROOT, header, loadavg, ms_summary, pythonpath

from charon.bench.engines import ConnectionPool, HttpConnection, start_node

OUT = ROOT / "benchmarks" / "results" / "services" / "promise_latency.json"
SUPPORT = ROOT / "tests" / "support"
TOKEN = "t34"
WARMUP = 20


def _post(host: bytes, path: bytes, body: bytes, rid: bytes) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n"
            b"Idempotency-Key: %s\r\nContent-Length: %d\r\n\r\n" % (path, host, TOKEN.encode(), rid, len(body))) + body


def _get(host: bytes, path: bytes) -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n\r\n" % (path, host, TOKEN.encode())


async def _call(conn: HttpConnection, req: bytes) -> dict:
    status, body = await conn.send(req)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {body[:300]!r}")
    return json.loads(body)


async def place(pool: ConnectionPool, names: list[str]) -> list[str]:
    """One promise per order (``orders/<name>/place``), ``len(pool.connections)`` at a time."""
    host = pool.host.encode()

    async def one(name: str) -> str:
        async with pool.connection() as c:
            doc = await _call(c, _post(host, b"/invoke/orders/%s/place" % name.encode(), b'{"args":[3600.0]}',
                                       b"place-" + name.encode()))
        return str(doc["value"])

    return list(await asyncio.gather(*(one(n) for n in names)))


def _resolve_req(host: bytes, pid: str, i: int) -> bytes:
    return _post(host, b"/promises/%s/resolve" % pid.encode(), b'{"value":{"n":%d}}' % i, b"resolve-%s" % pid.encode())


async def one_by_one(url: str, pids: list[tuple[str, str]], poll_s: float) -> dict:
    cont, resolve, polls = [], [], 0
    async with ConnectionPool(url, 2) as pool:
        host = pool.host.encode()
        rc, sc = pool.connections
        for i, (name, pid) in enumerate(pids):
            read = _get(host, b"/state/orders/%s" % name.encode())
            t0 = time.perf_counter()
            await _call(rc, _resolve_req(host, pid, i))
            t1 = time.perf_counter()
            while True:
                polls += 1
                doc = await _call(sc, read)
                if doc["value"]["runs"] >= 1:
                    t2 = time.perf_counter()
                    break
                await asyncio.sleep(poll_s)
            if i >= WARMUP:
                resolve.append(t1 - t0)
                cont.append(t2 - t0)
    return {"continuation_ms": ms_summary(cont), "resolve_reply_ms": ms_summary(resolve),
            "polls_per_promise": round(polls / len(pids), 2), "samples_ms": sorted(x * 1000 for x in cont)}


async def open_loop(url: str, pids: list[tuple[str, str]], rate: float, poll_s: float) -> dict:
    sent: dict[str, float] = {}  # order -> resolve sent, while its continuation is not seen
    cont: list[float] = []
    resolve: list[float] = []
    lag: list[float] = []  # how late each send was against its schedule
    state = {"polls": 0, "sending": True}
    async with ConnectionPool(url, 64) as pool:
        host = pool.host.encode()
        poller = HttpConnection(pool.host, pool.port)
        await poller.open()

        async def send(i: int, name: str, pid: str) -> None:
            async with pool.connection() as c:
                t0 = time.perf_counter()
                sent[name] = t0
                await _call(c, _resolve_req(host, pid, i))
                resolve.append(time.perf_counter() - t0)

        async def poll() -> None:
            while state["sending"] or sent:
                if sent:
                    names = list(sent)[:200]
                    q = "&".join(f"key={n}" for n in names).encode()
                    state["polls"] += 1
                    doc = await _call(poller, _get(host, b"/admin/state/orders?" + q))
                    now = time.perf_counter()
                    for n, v in doc["entities"].items():
                        if v and v.get("runs", 0) >= 1 and n in sent:
                            cont.append(now - sent.pop(n))
                await asyncio.sleep(poll_s)

        ptask = asyncio.create_task(poll())
        tasks = []
        start = time.perf_counter()
        for i, (name, pid) in enumerate(pids):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            lag.append(time.perf_counter() - due)
            tasks.append(asyncio.create_task(send(i, name, pid)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        state["sending"] = False
        await asyncio.wait_for(ptask, 60)
        poller.close()
    return {"rate": rate, "promises": len(pids), "achieved_per_s": round(len(pids) / wall, 1),
            "continuation_ms": ms_summary(cont), "resolve_reply_ms": ms_summary(resolve),
            "send_lag_ms": ms_summary(lag), "polls": state["polls"],
            "samples_ms": sorted(x * 1000 for x in cont)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--promises", type=int, default=300, help=f"resolved one by one (after {WARMUP} warm-up)")
    ap.add_argument("--rate", type=float, default=100.0, help="open loop: resolves per second")
    ap.add_argument("--duration", type=float, default=20.0, help="open loop: seconds")
    ap.add_argument("--poll-ms", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true", help="a smoke: 40 one by one, 2 s open loop at 50/s")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    if a.quick:
        a.promises, a.rate, a.duration = 40, 50.0, 2.0
    n_open = int(a.rate * a.duration)
    load0 = loadavg()
    node = start_node("promises_app:app", token=TOKEN, env={"PYTHONPATH": pythonpath(SUPPORT)})
    try:
        async def run() -> dict:
            names_a = [f"s{i}" for i in range(a.promises + WARMUP)]
            names_b = [f"o{i}" for i in range(n_open)]
            async with ConnectionPool(node.url, 32) as pool:
                t0 = time.perf_counter()
                pids = await place(pool, names_a + names_b)
                placed = time.perf_counter() - t0
            serial = await one_by_one(node.url, list(zip(names_a, pids[: len(names_a)], strict=True)),
                                      a.poll_ms / 1000)
            opened = await open_loop(node.url, list(zip(names_b, pids[len(names_a):], strict=True)), a.rate,
                                     a.poll_ms / 1000)
            return {"placed": len(pids), "place_s": round(placed, 2), "one_by_one": serial, "open_loop": opened}

        res = asyncio.run(run())
    finally:
        node.stop()
    doc = {**header(load0), "engine": "durable in-process node (charon run --data-dir, fsync per epoch)",
           "app": "tests/support/promises_app.py", "poll_ms": a.poll_ms, **res}
    doc["columns"] = ["mode", "n", "p50", "p90", "p99", "max", "resolve_reply_p50", "resolve_reply_p99"]
    doc["rows"] = [{"mode": label,
                    **{q: doc[k]["continuation_ms"].get(q) for q in ("n", "p50", "p90", "p99", "max")},
                    "resolve_reply_p50": doc[k]["resolve_reply_ms"].get("p50"),
                    "resolve_reply_p99": doc[k]["resolve_reply_ms"].get("p99")}
                   for k, label in (("one_by_one", "one by one"),
                                    ("open_loop", f"open loop {a.rate:g}/s"))]  # run.py's table (ms)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, out.with_suffix(".png"))
    short = {k: v for k, v in doc.items() if k not in ("one_by_one", "open_loop", "rows", "columns")}
    for k in ("one_by_one", "open_loop"):
        short[k] = {kk: vv for kk, vv in doc[k].items() if kk != "samples_ms"}
    print(json.dumps(short, indent=1))
    return 0


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, label in (("one_by_one", "one by one"), ("open_loop", f"open loop {doc['open_loop']['rate']:g}/s")):
        xs = doc[k]["samples_ms"]
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    ax.axvline(doc["one_by_one"]["resolve_reply_ms"].get("p50", 0), color="grey", linestyle="--",
               label="resolve's own reply p50 (one by one)")
    ax.set_xscale("log")
    ax.set_xlabel("resolve sent -> continuation committed (ms)")
    ax.set_ylabel("fraction")
    ax.set_title(f"durable promises, durable node (fsync), {doc['commit']}, load {doc['loadavg_before'][0]}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
