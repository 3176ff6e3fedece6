"""``/health`` never answers 500 (issue 22, item 4): a runtime whose health check raises (Spark's JVM dying
between two py4j calls did) is a truthful 503 ``recovering`` naming why, over real HTTP."""

from __future__ import annotations

import httpx

from charon import InProcessRuntime
from charon.apps import ycsb
from charon.server.serve import BackgroundServer


def test_health_that_raises_is_a_503_naming_why() -> None:
    rt = InProcessRuntime(ycsb.app, partitions=2)
    with BackgroundServer(rt, token="t") as srv:
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200

        def broken() -> dict:
            raise ConnectionRefusedError("[Errno 111] Connection refused")

        rt.health = broken  # type: ignore[method-assign]
        for _ in range(3):
            r = httpx.get(f"{srv.url}/health", timeout=10)
            assert r.status_code == 503, r.text
            doc = r.json()
            assert doc["status"] == "recovering" and doc["ok"] is False
            assert "ConnectionRefusedError" in doc["last_error"], doc
