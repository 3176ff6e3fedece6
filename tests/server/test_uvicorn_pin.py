"""The gateway's use of uvicorn's internals is checked (issue 35): the installed uvicorn is one the pin in
``pyproject.toml`` allows and has everything the direct invoke path and the guarded protocols use; a uvicorn
lacking any of it turns the direct path off (every invoke through the ASGI route, same answers) instead of
breaking requests."""

from __future__ import annotations

import importlib.metadata
import logging
import re
import tomllib
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement

from charon.server import uvicorn_pin

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_uvicorn_is_in_the_pinned_range_and_has_what_the_gateway_uses() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if re.match(r"uvicorn\b", d)]
    assert req.specifier and any(s.operator == "<" for s in req.specifier), f"uvicorn is not pinned above: {req}"
    version = importlib.metadata.version("uvicorn")
    assert req.specifier.contains(version), f"uvicorn {version} is outside the pinned {req.specifier}"
    assert uvicorn_pin.missing() == (), (
        f"uvicorn {version} lacks what charon.server.lane / charon.server.http use: {uvicorn_pin.missing()} -- "
        "update them (and the pin in pyproject.toml) before allowing this uvicorn")


def test_a_uvicorn_lacking_an_attribute_is_named() -> None:
    from uvicorn.protocols.http import httptools_impl

    assert "message_event" in uvicorn_pin._assigned(httptools_impl.RequestResponseCycle)
    uvicorn_pin.missing.cache_clear()
    real = httptools_impl.RequestResponseCycle
    try:
        class Renamed:  # what an upgrade renaming the cycle's attributes would look like
            def __init__(self) -> None:
                self.scope = {}
        httptools_impl.RequestResponseCycle = Renamed  # type: ignore[misc,assignment]
        lacking = uvicorn_pin.missing()
        assert "RequestResponseCycle.message_event" in lacking and "RequestResponseCycle.scope" not in lacking
    finally:
        httptools_impl.RequestResponseCycle = real  # type: ignore[misc]
        uvicorn_pin.missing.cache_clear()
    assert uvicorn_pin.missing() == ()


def test_a_gateway_on_such_a_uvicorn_serves_invokes_through_the_asgi_route(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from charon import InProcessRuntime
    from charon.apps import ycsb
    from charon.server.serve import BackgroundServer

    monkeypatch.setattr(uvicorn_pin, "missing", lambda: ("RequestResponseCycle.message_event",))
    caplog.set_level(logging.WARNING, logger="charon.server")
    rt = InProcessRuntime(ycsb.app, partitions=2)
    with BackgroundServer(rt, token="t") as srv:
        r = httpx.post(f"{srv.url}/invoke/account/a1/deposit", json={"args": [5]},
                       headers={"Authorization": "Bearer t"}, timeout=10)
        assert r.status_code == 200, r.text
    assert any("direct invoke path is off" in rec.getMessage() for rec in caplog.records), caplog.text
