"""The async client offers what the sync one does: admin updates, code updates and /metrics over real HTTP (an
in-process runtime behind the gateway), and no public method of :class:`Client` lacks an async twin."""

from __future__ import annotations

import inspect

import code_versions
import pytest

from charon import InProcessRuntime
from charon.client import AsyncClient, Client, Unauthorized
from charon.config import GatewayConfig
from charon.errors import CharonError
from charon.server.serve import BackgroundServer

TOKEN = "a5ync"
N = 12
CFG = GatewayConfig(code_refs="code_versions:v2, code_versions:v1")
SYNC_ONLY = {"close"}  # the async client's is aclose
OWN_DEFAULTS = {("invoke_many", "concurrency")}  # coroutines are cheaper than the sync client's threads


def public(cls: type) -> dict[str, inspect.Signature]:
    return {n: inspect.signature(getattr(cls, n)) for n in dir(cls) if not n.startswith("_")}


def test_every_sync_method_has_an_async_twin_with_the_same_parameters() -> None:
    sync, asyn = public(Client), public(AsyncClient)
    missing = sorted(set(sync) - set(asyn) - SYNC_ONLY)
    assert missing == []
    for name in set(sync) - SYNC_ONLY:
        fn = getattr(AsyncClient, name)
        assert inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn), name
        assert list(asyn[name].parameters) == list(sync[name].parameters), name
        for param, p in asyn[name].parameters.items():
            if (name, param) not in OWN_DEFAULTS:
                assert p.default == sync[name].parameters[param].default, (name, param)


async def test_admin_update_code_update_and_metrics_over_http() -> None:
    rt = InProcessRuntime(code_versions.v1, partitions=4, epoch_max_ms=2.0)
    rt.load("account", {f"a{i}": 100 for i in range(N)})
    try:
        with BackgroundServer(rt, token=TOKEN, config=CFG) as srv:
            async with AsyncClient(srv.url, token=TOKEN) as c:
                assert await c.invoke("account", "a0", "deposit", 1) == ["v1", 101]
                out = await c.admin_update("bonus-1", "account", "deposit", 10)
                again = await c.admin_update("bonus-1", "account", "deposit", 10)
                some = await c.admin_update("bonus-2", "account", "deposit", 1, keys=["a1", "a2"])
                assert out["transactions"] == out["committed"] == N and not out["aborted"] and not out["repeated"]
                assert again["repeated"] is True and again["committed"] == N
                assert some["committed"] == 2
                assert sum(rt.entities("account").values()) == N * 110 + 1 + 2, "each update ran exactly once"

                text = await c.metrics()
                assert 'charon_transactions_total{outcome="committed",reason=""}' in text
                assert 'version="1"' in text

                upd = await c.update_code("code_versions:v2", "v2", ("account", "migrate", ["EUR"]))
                assert upd["migration"]["committed"] == N
                assert await c.invoke("account", "a0", "deposit", 1) == ["v2", 112]
                assert (await c.status())["code_version"] == "v2"
                assert 'version="v2"' in await c.metrics()
                pages = [p async for p in c.iter_state("account", limit=4)]
                seen = [k for p in pages for k in p["entities"]]
                assert seen == sorted(seen) and len(seen) == N and len({p["epoch"] for p in pages}) == 1
                page = await c.requests(function="deposit", status="committed", limit=2)
                items = page["items"]
                assert isinstance(items, list) and len(items) == 2 and page["next"] is not None
                newest = items[0]
                detail = await c.request_detail(newest["request_id"])
                assert detail["reply"] == ["v2", 112] and detail["call_graph"][0]["function"] == "deposit"
                with pytest.raises(CharonError) as err:
                    await c.update_code("code_versions:nosuch", "v9")
                assert err.value.status == 403
            async with AsyncClient(srv.url, token="wrong") as bad:
                with pytest.raises(Unauthorized):
                    await bad.metrics()
    finally:
        rt.close()
