"""Schemathesis over /openapi.json against a real uvicorn gateway with the in-process engine: no 5xx.

Positive and negative cases for every operation (invoke routes of each function, polling, state reads, the
admin routes and /metrics);
``CHARON_FUZZ_EXAMPLES`` sets the examples per operation (default 30)."""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from charon import Application, Context, Operator
from charon.runtime.inprocess import InProcessRuntime
from charon.server.serve import BackgroundServer

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = int(os.environ.get("CHARON_FUZZ_EXAMPLES", "30"))

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


APP = Application("fuzz", [item])


@pytest.fixture(scope="module")
def api_schema() -> Any:
    with BackgroundServer(InProcessRuntime(APP, partitions=2), token=TOKEN) as srv:
        yield schemathesis.openapi.from_url(srv.url + "/openapi.json")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_no_server_errors(api_schema: Any, mode: GenerationMode) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8  # the generic routes and one invoke route per function
    paths = {op.path for op in operations}
    admin = {"/admin/status", "/admin/pause", "/admin/resume", "/admin/state/{operator}", "/admin/update",
             "/admin/code", "/admin/summary", "/metrics", "/timers/{operator}/{key}", "/admin/rescale"}
    assert admin <= paths, sorted(admin - paths)
    seen: dict[int, int] = {}
    for op in operations:

        @given(op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=True, database=None)
        def run(case: Any) -> None:
            response = case.call(headers=AUTH, timeout=30)
            if case.operation.path == "/admin/pause" and response.status_code == 200:
                httpx.post(case.operation.base_url + "/admin/resume", headers=AUTH, timeout=30)  # the rest runs
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (
                f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
            )

        try:
            run()
        except Unsatisfiable:  # an operation without inputs has no negative cases (/health)
            assert mode is GenerationMode.NEGATIVE
    print(mode.value, sorted(seen.items()))
    assert any(200 <= s < 300 for s in seen) and any(400 <= s < 500 for s in seen), seen
