"""Schemathesis over /openapi.json against a real uvicorn gateway with the in-process engine: no 5xx.

Positive and negative cases for every operation (invoke routes of each function, polling, state reads, the
admin routes and /metrics); ``CHARON_FUZZ_EXAMPLES`` sets the examples per operation (default 30).

The cases run in a child process (this file run as a script), one operation after another, each reported as it
ends. Hypothesis can stall generating one operation's cases, inside a single draw with no request in flight (seen
on CI: a whole session's budget spent in one draw, out of reach of a signal): an operation that reports nothing
for ``CHARON_FUZZ_OP_BUDGET_S`` seconds is recorded as stalled, the child killed, and a new one goes on with the
operations left. Every case that ran counts; a 5xx fails the test.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from typing import Any

import httpx
import pytest

from charon import Application, Context, Operator, Workflow

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = int(os.environ.get("CHARON_FUZZ_EXAMPLES", "30"))
OP_BUDGET_S = float(os.environ.get("CHARON_FUZZ_OP_BUDGET_S", "30"))
MAX_STALLS = 3  # operations that may stall in one mode (each costs a child process and its budget)

item = Operator("item")


class Rejected(Exception):
    """A function's own abort (409, not 5xx)."""


@item.function(public=True)
async def store(ctx: Context, value: Any) -> Any:
    ctx.put(value)
    return value


@item.function(public=True)
async def add(ctx: Context, n: int, label: str = "") -> int:
    v = ctx.get(default=0) + n
    if v < 0:
        raise Rejected(label)
    ctx.put(v)
    return v


@item.function(public=True)
async def tag(ctx: Context, name: str, values: list[int], extra: dict[str, float]) -> list:
    ctx.put_item(name, values)
    return ctx.scan_items()


@item.function(public=True)
async def link(ctx: Context, other: str) -> Any:
    return await ctx.call(item, other, store, ctx.key)


@item.function(public=True)
async def nothing(ctx: Context) -> None:
    return None


flow = Workflow("flow", backoff=0.2)


@flow.step(first=True)
async def begin(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
    return w.promise(then=finish, timeout=60.0)


@flow.step
async def finish(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
    return w.done(outcome)


APP = Application("fuzz", [item], workflows=[flow])


def _key(op: Any) -> str:
    return f"{op.method.upper()} {op.path}"


def child(mode_name: str, skip: set[str]) -> None:
    """The cases of every operation not in ``skip``, in order; one JSON line per event on stdout."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    from charon.runtime.effects import EffectExecutor, engine_resume
    from charon.runtime.node.inprocess import InProcessRuntime
    from charon.server.serve import BackgroundServer

    mode = GenerationMode.POSITIVE if mode_name == "positive" else GenerationMode.NEGATIVE

    def say(**doc: Any) -> None:
        print(json.dumps(doc), flush=True)

    rt = InProcessRuntime(APP, partitions=2)
    eng = rt.engine()
    # an effect executor beside the engine, as `charon run --effects` runs one: the effects routes answer (without
    # it the bulk effects actions are a documented 501 NotSupported, which this test counts as a server error)
    executor = EffectExecutor(APP, lambda: eng.streams, engine_resume(eng.submit))
    with BackgroundServer(rt, token=TOKEN, effects=executor) as srv:
        schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        say(operations=[_key(op) for op in operations])
        seen: dict[int, int] = {}  # the statuses of the operation running
        for op in operations:
            if _key(op) in skip:
                continue
            say(start=_key(op))
            seen.clear()

            # no shrink phase: a 5xx is reported at once (shrinking it took the whole budget, and the operation was
            # then recorded as stalled, its failure lost)
            @given(op.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                      derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
                      report_multiple_bugs=False)
            def run(case: Any) -> None:
                response = case.call(headers=AUTH, timeout=30)
                if case.operation.path == "/admin/pause" and response.status_code == 200:
                    httpx.post(case.operation.base_url + "/admin/resume", headers=AUTH, timeout=30)  # the rest runs
                seen[response.status_code] = seen.get(response.status_code, 0) + 1
                if response.status_code >= 500:  # reported now: a child killed later as stalled still counts it
                    error = f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
                    say(failed=_key(case.operation), error=error)
                    raise AssertionError(error)

            try:
                run()
            except Unsatisfiable:  # an operation without inputs has no negative cases (/health)
                assert mode is GenerationMode.NEGATIVE
            except AssertionError:  # a 5xx, reported by run
                pass
            say(done=_key(op), seen=dict(seen))
        say(end=True)


def _pump(proc: subprocess.Popen, lines: queue.Queue[str]) -> None:
    for line in proc.stdout or ():
        lines.put(line)


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_server_errors(mode: str) -> None:
    skip: set[str] = set()
    stalled: list[str] = []
    done: dict[str, dict[str, int]] = {}
    failures: list[str] = []
    operations: list[str] = []
    while True:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), mode, json.dumps(sorted(skip))],
                                stdout=subprocess.PIPE, text=True)
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=_pump, args=(proc, lines), daemon=True)
        reader.start()
        current = None
        try:
            while True:
                try:
                    line = lines.get(timeout=OP_BUDGET_S)
                except queue.Empty:
                    break  # stalled: nothing reported for the budget
                doc = json.loads(line)
                if "operations" in doc:
                    operations = doc["operations"]
                elif "start" in doc:
                    current = doc["start"]
                elif "failed" in doc:  # hypothesis replays a failing case once more at the end
                    if f"{doc['failed']}: {doc['error']}" not in failures:
                        failures.append(f"{doc['failed']}: {doc['error']}")
                elif "done" in doc:
                    done[doc["done"]] = doc["seen"]
                    skip.add(doc["done"])
                    current = None
                elif "end" in doc:
                    break
        finally:
            proc.kill()
            proc.wait()
            reader.join(timeout=10)
        if current is None:
            assert operations and set(done) | set(stalled) == set(operations) or not operations, "the child ended early"
            break
        stalled.append(current)  # its cases so far ran and answered (a 5xx would have been reported)
        skip.add(current)
        assert len(stalled) <= MAX_STALLS, f"generation stalled for {stalled}"
    print(mode, "stalled:", stalled)
    assert failures == [], failures
    assert len(operations) >= 8  # the generic routes and one invoke route per function
    paths = {k.split(" ", 1)[1] for k in operations}
    admin = {"/admin/status", "/admin/pause", "/admin/resume", "/admin/state/{operator}", "/admin/update",
             "/admin/code", "/admin/summary", "/metrics", "/timers/{operator}/{key}", "/admin/rescale"}
    assert admin <= paths, sorted(admin - paths)
    assert set(done) | set(stalled) == set(operations), sorted(set(operations) - set(done) - set(stalled))
    seen: dict[int, int] = {}
    for counts in done.values():
        for status, n in counts.items():
            seen[int(status)] = seen.get(int(status), 0) + n
    print(mode, sorted(seen.items()))
    assert any(200 <= s < 300 for s in seen) and any(400 <= s < 500 for s in seen), seen


if __name__ == "__main__":
    child(sys.argv[1], set(json.loads(sys.argv[2])))
