"""Open-loop load generator.

Request ``i`` is due at ``t0 + i / rate`` whatever happened to earlier requests (open loop: a slow system
does not slow the client down). Latency is measured from the request's *due time* to its reply, so time a
request spent waiting because the client itself fell behind is counted too (no coordinated omission).
Requests due in the first ``warmup`` seconds are sent but not measured. Works against any object with
``async submit(operator, key, function, args, *, request_id=None)`` returning a :class:`charon.messages.Reply`
(the in-process runtime, the Spark runtime, the PostgreSQL baseline); a target with ``enqueue(Request) ->
Future`` (the in-process runtime) is driven through it, with no task or coroutine per request.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import selectors
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from charon import serde
from charon.messages import Request as _Request

Request = tuple[str, str, str, list]


class Target(Protocol):
    async def submit(self, operator: str, key: str, function: str, args: list, *,
                     request_id: str | None = None) -> Any: ...


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (the smallest value with at least ``q``% of values <= it); nan if empty."""
    if not values:
        return math.nan
    s = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(s)))
    return s[min(rank, len(s)) - 1]


def latency_summary(latencies_ms: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/max/mean of latencies in milliseconds."""
    if not latencies_ms:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "max": math.nan, "mean": math.nan}
    return {
        "p50": percentile(latencies_ms, 50),
        "p90": percentile(latencies_ms, 90),
        "p99": percentile(latencies_ms, 99),
        "max": max(latencies_ms),
        "mean": sum(latencies_ms) / len(latencies_ms),
    }


def summarize(samples: list[dict], *, rate: float, duration: float, warmup: float,
              epochs: list[dict] | None = None, extra: dict | None = None) -> dict:
    """Turn per-request samples into a run result.

    A sample is ``{"due": s, "done": s or None, "ok": bool, "error_type": str}`` with times relative to the
    start of the run. Measured = due in ``[warmup, warmup + duration)``. Throughput counts measured requests
    that committed / aborted per second of the measured window; ``timeline`` counts completions per second
    over the whole run.
    """
    measured = [s for s in samples if warmup <= s["due"] < warmup + duration]
    done = [s for s in measured if s["done"] is not None]
    committed = [s for s in done if s["ok"]]
    aborted = [s for s in done if not s["ok"]]
    lat = [(s["done"] - s["due"]) * 1000 for s in done]
    lat_ok = [(s["done"] - s["due"]) * 1000 for s in committed]
    end = max((s["done"] for s in samples if s["done"] is not None), default=0.0)
    buckets: list[list[dict]] = [[] for _ in range(int(math.ceil(end)) + 1)]
    for s in samples:
        if s["done"] is not None:
            buckets[int(s["done"])].append(s)
    timeline = [
        {
            "t": sec,
            "committed": sum(1 for s in b if s["ok"]),
            "aborted": sum(1 for s in b if not s["ok"]),
            "p50_ms": percentile([(s["done"] - s["due"]) * 1000 for s in b], 50) if b else None,
        }
        for sec, b in enumerate(buckets)
    ]
    result: dict[str, Any] = {
        "input_rate": rate,
        "duration_s": duration,
        "warmup_s": warmup,
        "sent": len(samples),
        "measured": len(measured),
        "completed": len(done),
        "unfinished": len(measured) - len(done),
        "committed": len(committed),
        "aborted": len(aborted),
        "committed_per_s": len(committed) / duration if duration else math.nan,
        "aborted_per_s": len(aborted) / duration if duration else math.nan,
        "abort_rate": len(aborted) / len(done) if done else math.nan,
        "abort_types": dict(Counter(s["error_type"] for s in aborted)),
        "latency_ms": latency_summary(lat),
        "latency_committed_ms": latency_summary(lat_ok),
        "timeline": timeline,
    }
    if epochs is not None:
        result["epochs"] = epoch_summary(epochs)
    if extra:
        result.update(extra)
    return result


def epoch_summary(epochs: list[dict]) -> dict:
    """Sizes and durations of the epochs of a run (from a runtime's ``epoch_stats``)."""
    sizes = [e.get("size", 0) for e in epochs]
    durs = [e.get("duration_ms", 0.0) for e in epochs]
    total = sum(sizes)
    out = {
        "count": len(epochs),
        "size_mean": total / len(sizes) if sizes else math.nan,
        "size_p50": percentile(sizes, 50),
        "size_max": max(sizes) if sizes else math.nan,
        "duration_ms_p50": percentile(durs, 50),
        "duration_ms_p99": percentile(durs, 99),
        "duration_ms_max": max(durs) if durs else math.nan,
    }
    for k in ("committed", "aborted", "lockfree", "conflicts", "fallback", "deferred"):
        vals = [e.get(k) for e in epochs if isinstance(e.get(k), int | float)]
        if vals:
            out[f"{k}_total"] = sum(vals)
    # transactions that lost Aria's lock-free commit to a conflict and went through the fallback
    fb = out.get("fallback_total", out.get("conflicts_total"))
    if total and fb is not None:
        out["fallback_share"] = fb / total
    return out


async def run_open_loop(
    target: Target,
    gen: Callable[[random.Random], Request],
    *,
    rate: float,
    duration: float,
    warmup: float = 2.0,
    drain_timeout: float = 10.0,
    seed: int = 0,
    label: str = "",
    on_reply: Callable[[Request, Any], None] | None = None,
) -> dict:
    """Drive ``target`` at ``rate`` requests/s for ``warmup + duration`` seconds; return the run's result.

    Requests are generated from ``gen(rng)`` (seeded with ``seed``). Replies still missing
    ``drain_timeout`` seconds after the last request was due count as ``unfinished``. ``on_reply``
    is called with each request and its reply (e.g. to collect committed review ids).
    """
    rng = random.Random(seed)
    total = int((warmup + duration) * rate)
    samples: list[dict] = []
    tasks: set[asyncio.Task] = set()
    before = getattr(target, "epoch_stats", None) or []
    last_before = before[-1]["epoch"] if before else -1  # stats are bounded (oldest dropped): go by epoch
    loop = asyncio.get_running_loop()
    retries_before = getattr(target, "retries", 0)

    async def one(sample: dict, req: Request) -> None:
        op, key, fn, args = req
        try:
            rep = await target.submit(op, key, fn, args, request_id=uuid.uuid4().hex)
            sample["ok"] = bool(rep.ok)
            sample["error_type"] = rep.error_type
            if on_reply is not None:
                on_reply(req, rep)
        except Exception as exc:  # a transport failure is an aborted request, named by its type
            sample["ok"] = False
            sample["error_type"] = f"client:{type(exc).__name__}"
        sample["done"] = loop.time() - t0

    enqueue = getattr(target, "enqueue", None)  # an in-process runtime: no task per request (see _lean_send)
    if enqueue is not None:
        send = _lean_sender(enqueue, samples, on_reply, loop, lambda: t0, uuid.uuid4().hex[:16])
    t0 = loop.time() + 0.05
    i = 0
    while i < total:
        now = loop.time()
        due = t0 + i / rate
        if due > now:
            await asyncio.sleep(due - now)
            now = loop.time()
        # send everything that is due (several per wake-up at high rates)
        while i < total and t0 + i / rate <= now:
            sample = {"due": i / rate, "done": None, "ok": False, "error_type": ""}
            samples.append(sample)
            if enqueue is not None:
                fut = send(sample, gen(rng), i)
                if fut is not None:
                    tasks.add(fut)
                    fut.add_done_callback(tasks.discard)
            else:
                task = asyncio.ensure_future(one(sample, gen(rng)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            i += 1
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=drain_timeout)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    all_epochs = getattr(target, "epoch_stats", None)
    epochs = [e for e in all_epochs if e["epoch"] > last_before] if all_epochs is not None else None
    extra: dict[str, Any] = {"label": label, "wall_s": loop.time() - t0, "when": time.time()}
    if hasattr(target, "retries"):
        extra["retries"] = target.retries - retries_before
    return summarize(samples, rate=rate, duration=duration, warmup=warmup, epochs=epochs, extra=extra)


def _lean_sender(
    enqueue: Callable[[_Request], Any], samples: list[dict], on_reply: Callable[[Request, Any], None] | None,
    loop: asyncio.AbstractEventLoop, t0: Callable[[], float], prefix: str,
) -> Callable[[dict, Any, int], Any]:
    """The generator's per-request path for a target with ``enqueue(Request) -> Future`` (the in-process
    runtime): the request goes straight to its queue and a done-callback records the sample, so the generator
    spends no task, coroutine or uuid per request and its own cost stays small beside the engine's."""

    def send(sample: dict, req: Any, i: int) -> Any:
        op, key, fn, args = req
        request = _Request(f"{prefix}-{i}", op, key, fn, serde.encode(list(args)), time.time())
        try:
            fut = enqueue(request)
        except Exception as exc:  # noqa: BLE001 - refused at once: an aborted request, named by its type
            sample["error_type"] = f"client:{type(exc).__name__}"
            sample["done"] = loop.time() - t0()
            return None

        def done(f: asyncio.Future) -> None:
            if f.cancelled():
                sample["error_type"] = "client:CancelledError"
            elif f.exception() is not None:
                sample["error_type"] = f"client:{type(f.exception()).__name__}"
            else:
                rep = f.result()
                sample["ok"] = bool(rep.ok)
                sample["error_type"] = rep.error_type
                if on_reply is not None:
                    on_reply(req, rep)
            sample["done"] = loop.time() - t0()

        fut.add_done_callback(done)
        return fut

    return send


def precise_loop() -> asyncio.AbstractEventLoop:
    """An event loop whose timers wake within microseconds, for load generators.

    The default selector (epoll) rounds every timeout up to a whole millisecond, so an open-loop generator
    sleeping until its next due time wakes up to 1 ms late and that lag is counted in every latency (on
    whatever system it drives). ``select(2)`` takes microsecond timeouts; a generator holds few sockets, so
    its limit of 1,024 descriptors does not bind."""
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


def run(main: Any) -> Any:
    """``asyncio.run(main)`` on a :func:`precise_loop`."""
    with asyncio.Runner(loop_factory=precise_loop) as runner:
        return runner.run(main)


def save(result: dict | list, path: str | Path) -> Path:
    """Write a result (or list of results) as JSON."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1, default=float, allow_nan=True))
    return p
