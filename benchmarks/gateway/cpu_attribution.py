"""Attribute the server's measured CPU per request to the stages of a request, from a py-spy profile.

    .venv/bin/python benchmarks/gateway/gateway_cpu.py --concurrency 64 --duration 15 --profile \
        --out /tmp/profiled.json                 # py-spy's stacks: benchmarks/results/gateway/pyspy_c64.txt
    .venv/bin/python benchmarks/gateway/cpu_attribution.py benchmarks/results/gateway/pyspy_c64.txt \
        /tmp/profiled.json [--json /tmp/attribution.json]

Input: py-spy's raw collapsed stacks recorded with --threads (`thread (TID): name;frame;...;frame N`) and the
run's JSON (per-thread CPU seconds from psutil and the request count). Per thread, samples whose leaf is a wait
(a pool worker's queue.get, Condition.wait, epoll) are dropped, and the thread's measured CPU is split over its
remaining samples. Each sample goes to the FIRST stage of that thread's list whose pattern matches a frame,
scanning from the innermost frame outwards: a stage is inclusive of what it calls, exclusive of stages above it.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re

IDLE = re.compile(r"^_worker \(concurrent/futures/thread.py:81\)|^Condition.wait|^EpollSelector.select|"
                  r"^Event.wait|^Thread._wait_for_tstate_lock")

MAIN = [
    ("idempotency: runtime enqueue's NodeStorage.known (output_log.get + input_log.contains, SQLite on the loop)",
     r"^NodeStorage.known"),
    ("idempotency: gateway check_log's hop to the read pool (run_in_executor, wrap_future, wake-up)",
     r"^_Gateway.check_log|^_Gateway.off_loop"),
    ("metrics (prometheus counters/histograms)", r"prometheus_client|GatewayMetrics"),
    ("idempotency: inflight/recent bookkeeping (conflict, _finished, remember)",
     r"^_Gateway.conflict|^_Gateway._finished|^_Gateway.remember|^check_same_request"),
    ("validation (Application.validate, check_plain, parse_args, serde.encode)",
     r"^_Gateway.validate|^Application.validate|^check_plain|^parse_args|charon/serde"),
    ("body reading (read_body with its timeout)", r"read_body"),
    ("enqueue into the runtime (future, queue, wake)", r"^InProcessRuntime.enqueue|^_Gateway.start"),
    ("reply delivery from the engine thread (call_soon_threadsafe, _hand_out, future chaining, self-pipe)",
     r"^InProcessRuntime._hand_out|^_chain_future|^_copy_future_state|_read_from_self|^_Gateway.await_reply|"
     r"^wait \(asyncio/tasks|^_wait"),
    ("response encoding and write (reply_response, respond, Response, h11/httptools send, transport.write)",
     r"^_Gateway.reply_response|^respond |^Response\.|^RequestResponseCycle.send|"
     r"^_SelectorSocketTransport.write"),
    ("charon gateway handler (invoke, auth, request_id, guard)", r"charon/server/(gateway|wire)"),
    ("charon HTTP guards (StrictPath, HeadGuard, GuardedHttpTools timers)", r"charon/server/http"),
    ("starlette (middleware stack, routing, Request/Headers/QueryParams)", r"starlette/"),
    ("uvicorn + httptools parsing, ASGI cycle, ProxyHeaders", r"uvicorn/|httptools"),
    ("asyncio loop: socket reads, handles, timers, tasks", r"asyncio/|selectors"),
]
ENGINE = [
    ("durable input log append (SQLite: ids INSERT per request, entries, parts; commit)",
     r"charon/log/|^NodeStorage.log_epoch|^NodeStorage._retry_log"),
    ("reply delivery to the loop (call_soon_threadsafe, self-pipe write)",
     r"call_soon_threadsafe|_write_to_self"),
    ("engine epoch (sequencing, transactions, commit)", r"charon/runtime|charon/core|charon/state|charon/operator"),
]
POOL = [
    ("idempotency: stored_request (InputLog.position SQLite point query)", r"charon/log/"),
    ("pool hand-back (call_soon_threadsafe, self-pipe write, Future state)", r"."),
]
WRITER = [
    ("checkpoint: OutputLog.put_many (replies to SQLite)", r"OutputLog"),
    ("checkpoint: state delta files (write_atomic, fsync, sync_dir)", r"charon/state/"),
    ("checkpoint: other", r"."),
]


def stages_for(name: str) -> list[tuple[str, str]]:
    if "MainThread" in name:
        return MAIN
    if "engine" in name:
        return ENGINE
    if "gateway-read" in name:
        return POOL
    if "writer" in name:
        return WRITER
    return [("other thread", r".")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("run_json")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    run = json.load(open(a.run_json))["rows"][0]
    n_req = run["requests"]
    thread_cpu = {int(k): v for k, v in run["server_thread_cpu_s"].items()}
    opener = gzip.open if a.raw.endswith(".gz") else open
    per_thread: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    names: dict[int, str] = {}
    with opener(a.raw, "rt") as f:
        for line in f:
            stack, _, cnt = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            m = re.match(r"thread \((\d+)\)(?:: (.*))?", frames[0])
            if not m or len(frames) < 2:
                continue
            tid, name = int(m.group(1)), m.group(2) or ""
            names.setdefault(tid, name)
            names[tid] = names[tid] or name
            if IDLE.search(frames[-1]):
                continue
            pats = [(s, re.compile(p)) for s, p in stages_for(names[tid])]
            stage = "other"
            for fr in reversed(frames[1:]):
                hit = next((s for s, p in pats if p.search(fr)), None)
                if hit:
                    stage = hit
                    break
            per_thread[tid][stage] += int(cnt)
    rows = []
    groups: dict[str, float] = collections.defaultdict(float)
    for tid, cnt in per_thread.items():
        tot = sum(cnt.values())
        us = thread_cpu.get(tid, 0.0) / n_req * 1e6
        group = re.sub(r"_\d+$", "", names[tid]) or "?"
        for stage, c in cnt.items():
            groups[(group, stage)] += us * c / tot
    total = sum(groups.values())
    print(f"requests {n_req}, server CPU {run['server_cpu_us_per_request']} us/request "
          f"(attributed {total:.1f} us over threads with samples)")
    by_thread = collections.defaultdict(float)
    for (g, _stage), us in groups.items():
        by_thread[g] += us
    for g, us in sorted(by_thread.items(), key=lambda x: -x[1]):
        print(f"\n### {g}: {us:.1f} us/request")
        for (g2, s), v in sorted(groups.items(), key=lambda x: -x[1]):
            if g2 == g and v >= 0.05:
                print(f"  {v:6.1f} us  {100 * v / total:5.1f}%  {s}")
                rows.append({"thread": g, "stage": s, "us_per_request": round(v, 1)})
    if a.json:
        json.dump({"requests": n_req, "server_cpu_us_per_request": run["server_cpu_us_per_request"],
                   "requests_per_s": run["requests_per_s"], "stages": rows}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
