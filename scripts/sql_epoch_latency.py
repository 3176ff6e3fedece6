"""Epoch latency of a steady trickle of invokes while hostile /admin/sql queries run (issue 22, item 5).

Starts ``charon run bank:app`` (the repros' bank) on ENGINE, seeds N accounts with one admin update, then
sends one ``incr`` every 100 ms (sequentially: each invoke's latency is about one epoch) and, after a quiet
baseline, the repro's queries: ``kills_jvm`` (spark_sql_kills_jvm.sh: one 10^9-character string),
``stall`` (spark_sql_stall.sh: two concurrent 4-way cross joins), ``memory`` (sqlite_sql_memory.sh, no table).
Prints one JSON line: the baseline and in-window p50/p99/max latency (ms), failed invokes, the SQL answers
and /health afterwards.

usage: .venv/bin/python scripts/sql_epoch_latency.py --engine spark --query stall [--old-code DIR]
(``--old-code DIR``: run the charon package from DIR instead, e.g. ``git archive 7063588 | tar -x -C DIR``)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]  # the repository (this checkout)
REPROS = str(ROOT / "tests" / "support" / "repros")
H = {"Authorization": "Bearer s3cret"}


def _big(expr: str) -> str:
    for _ in range(9):
        expr = f"replace({expr},'a','aaaaaaaaaa')"
    return expr


QUERIES = {
    "kills_jvm": [f"SELECT length({_big('key')}) FROM account WHERE key = 'a1'"],
    "stall": ["SELECT count(*) FROM account a, account b, account c, account d"] * 2,
    "memory": [f"SELECT length({_big(repr('a'))})"],
}


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="spark")
    ap.add_argument("--query", default="stall", choices=sorted(QUERIES))
    ap.add_argument("--accounts", type=int, default=2000)
    ap.add_argument("--port", type=int, default=18977)
    ap.add_argument("--old-code", default=None)
    ap.add_argument("--baseline-s", type=float, default=10.0)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="charon-sqllat-")
    py = str(ROOT / ".venv" / "bin" / "python")
    path = [REPROS] + ([a.old_code] if a.old_code else []) + [str(ROOT)]  # this checkout's charon (or --old-code)
    env = dict(os.environ, PYSPARK_PYTHON=py, PYSPARK_DRIVER_PYTHON=py, PYTHONPATH=os.pathsep.join(path))
    url = f"http://127.0.0.1:{a.port}"
    cmd = [py, "-c", "from charon.cli import app; app()", "run", "bank:app", "--engine", a.engine, "--port",
           str(a.port), "--token", "s3cret", "--data-dir", os.path.join(work, "data")]
    err = open(os.path.join(work, "err"), "w")  # noqa: SIM115 - the server's stderr, closed with the process
    p = subprocess.Popen(cmd, cwd=REPROS, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    out: dict = {"engine": a.engine, "query": a.query, "old_code": bool(a.old_code)}
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        c = httpx.Client(base_url=url, headers=H, timeout=90)
        keys = ["a1"] + [f"k{i}" for i in range(a.accounts)]
        r = c.post("/admin/update", json={"id": "seed", "operator": "account", "function": "deposit", "args": [1],
                                          "keys": keys}, timeout=300)
        assert r.status_code == 200, r.text
        lat: list[tuple[float, float, int]] = []
        stop = threading.Event()

        def trickle() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    st = c.post("/invoke/account/w/incr", timeout=60).status_code
                except httpx.HTTPError:
                    st = 0
                lat.append((t0, (time.monotonic() - t0) * 1000, st))
                time.sleep(max(0.0, 0.1 - (time.monotonic() - t0)))

        th = threading.Thread(target=trickle, daemon=True)
        th.start()
        time.sleep(a.baseline_s)
        w0 = time.monotonic()
        answers: list = [None] * len(QUERIES[a.query])

        def ask(i: int, q: str) -> None:
            t = time.monotonic()
            try:
                r = httpx.post(url + "/admin/sql", headers=H, json={"sql": q}, timeout=90)
                answers[i] = [r.status_code, r.text[:160], round(time.monotonic() - t, 1)]
            except httpx.HTTPError as e:
                answers[i] = [0, repr(e)[:160], round(time.monotonic() - t, 1)]

        qs = [threading.Thread(target=ask, args=(i, q)) for i, q in enumerate(QUERIES[a.query])]
        for t in qs:
            t.start()
        for t in qs:
            t.join()
        time.sleep(5)
        w1 = time.monotonic()
        stop.set()
        th.join()
        base = [x[1] for x in lat if x[0] < w0 and x[2] == 200]
        win = [x for x in lat if w0 <= x[0] < w1]
        ok = [x[1] for x in win if x[2] == 200]
        try:
            h = httpx.get(url + "/health", timeout=5)
            health = [h.status_code, h.text[:160]]
        except httpx.HTTPError as e:
            health = [0, repr(e)]
        out.update(baseline={"n": len(base), "p50_ms": pct(base, 0.5), "p99_ms": pct(base, 0.99)},
                   window={"s": round(w1 - w0, 1), "n": len(win), "failed": len(win) - len(ok),
                           "p50_ms": pct(ok, 0.5), "p99_ms": pct(ok, 0.99), "max_ms": pct(ok, 1.0),
                           "mean_ms": round(statistics.fmean(ok), 1) if ok else None},
                   sql=answers, health_after=health)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
