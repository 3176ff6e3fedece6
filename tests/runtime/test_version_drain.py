"""The code-version rules every caller of an engine's ``update_code`` gets (issue 34;
:mod:`charon.runtime.control.drain`): a deploy that would drop the code of a version with workflows in flight raises
:class:`~charon.VersionInUse` and records nothing; once they finished it applies and unloads the drained version
(``unloaded_at`` in the recorded history: out of the code book and the import cache, and not imported again by a
restart); what is kept loaded: the current version, one with workflows in flight, a compatible update's previous
one, and the node's built-in application."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import uuid
import weakref
from pathlib import Path
from typing import Any

import pytest
import wf_pin_v1
from wf_pin_v1 import app
from wf_pin_v2 import app as app_v2

from charon import InProcessRuntime, VersionInUse
from charon.core.workflows import workflow_operator

OP = workflow_operator("pin")


async def _until(rt: InProcessRuntime, wid: str, pred: Any) -> dict[str, Any]:
    for _ in range(1000):
        rec = rt.read_state(OP, wid)
        if rec is not None and pred(rec):
            return dict(rec)
        await asyncio.sleep(0.01)
    raise AssertionError(rt.read_state(OP, wid))


def _at(step: str) -> Any:
    return lambda r: r["status"] == "waiting" and r["step"] == step and r["awaiting"]


async def _finish(rt: InProcessRuntime, wid: str) -> dict[str, Any]:
    """Resolve what ``wid`` awaits until it is done."""
    done: set[str] = set()
    for _ in range(3):
        rec = await _until(rt, wid, lambda r: r["status"] == "done" or (
            r["status"] == "waiting" and r["awaiting"] and r["awaiting"][0]["id"] not in done))
        if rec["status"] == "done":
            return rec
        done.add(rec["awaiting"][0]["id"])
        await rt.invoke("charon.promise", rec["awaiting"][0]["id"], "resolve", 1)
    return await _until(rt, wid, lambda r: r["status"] == "done")


def _gone_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """An installed module with its own copy of v1's code (removed later by the test)."""
    name = f"wf_gone_{uuid.uuid4().hex[:8]}"
    mods = tmp_path / "mods"
    mods.mkdir()
    module = mods / f"{name}.py"
    module.write_text(Path(wf_pin_v1.__file__).read_text())
    monkeypatch.syspath_prepend(str(mods))
    return name, module


async def test_a_deploy_dropping_a_pinned_version_raises_and_records_nothing_then_unloads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    name, module = _gone_module(tmp_path, monkeypatch)
    data = tmp_path / "node"
    rt = InProcessRuntime(app, partitions=2, data_dir=str(data), checkpoint_s=3600)
    eng = rt.engine()
    async with rt:
        await eng.update_code(f"{name}:app", "gone")
        await rt.invoke(OP, "w1", "start", None)
        await _until(rt, "w1", _at("middle"))
        gone_app = eng.book.application_of("gone")
        assert gone_app is sys.modules[name].app and gone_app is not app
        module.unlink()  # its code is no longer installed (still imported here)
        recorded = (data / "code.json").read_bytes()
        history = eng.code_versions()
        with pytest.raises(VersionInUse, match="'gone' has 1 workflow"):
            await eng.update_code("wf_pin_v2:app", "v2")
        with pytest.raises(VersionInUse):  # the runtime's own Python face: the same rule
            await rt.update_code("wf_pin_v2:app", "v2")
        assert (data / "code.json").read_bytes() == recorded and eng.code_versions() == history  # nothing recorded
        assert eng.book.application_of("gone") is gone_app and await rt.invoke("probe", "x", "ping") == "v1"
        done = await _finish(rt, "w1")
        assert done["result"] == {"ran": ["v1:begin", "v1:middle", "v1:end"], "pinned": "gone"}  # its own code
        out = await eng.update_code("wf_pin_v2:app", "v2")  # nothing in flight on 'gone' any more: applied
        assert await rt.invoke("probe", "x", "ping") == "v2"
        hist = {v["version"]: v["unloaded_at"] for v in eng.code_versions()}
        assert hist == {"1": None, "gone": out.from_epoch, "v2": None}, hist
        assert eng.book.application_of("gone") is None and f"{name}:app" not in eng.book.apps
        assert name not in sys.modules  # out of the import cache too: the application can be freed
        gone = weakref.ref(gone_app)
        del gone_app
        gc.collect()
        assert gone() is None, gc.get_referrers(gone())
        assert eng.book.application_of("1") is app and eng.book.application_of("v2") is app_v2
    rt.close()
    caplog.set_level(logging.WARNING)
    again = InProcessRuntime(app, partitions=2, data_dir=str(data))  # a restart loads what the record says
    try:
        book = again.engine().book
        assert book.application_of("gone") is None and book.application_of("v2") is app_v2
        assert "cannot be imported" not in caplog.text  # the drained version is not imported again
        assert name not in sys.modules
    finally:
        again.close()


async def test_only_drained_versions_no_longer_current_are_unloaded() -> None:
    async with InProcessRuntime(app, partitions=2) as rt:
        eng = rt.engine()

        def unloaded() -> dict[str, int | None]:
            return {str(v["version"]): v["unloaded_at"] for v in eng.code_versions()}  # type: ignore[misc]

        await eng.update_code("wf_pin_v1:app", "a")
        await rt.invoke(OP, "w", "start", None)
        await _until(rt, "w", _at("middle"))
        await eng.update_code("wf_pin_v2:app", "b")
        assert unloaded() == {"1": None, "a": None, "b": None}  # 'a' has a workflow in flight: kept
        assert eng.book.application_of("a") is app
        assert (await _finish(rt, "w"))["result"]["pinned"] == "a"
        c = await eng.update_code("wf_pin_v1:app", "c", mode="compatible")
        # 'a' drained: unloaded; 'b' was current until now (a compatible update's transactions deferred before it
        # may still start a workflow on it): kept; '1' is the built-in application: kept
        assert unloaded() == {"1": None, "a": c.from_epoch, "b": None, "c": None}
        assert eng.book.application_of("a") is None and eng.book.application_of("b") is app_v2
        assert eng.book.application_of("c") is app and "wf_pin_v1" in sys.modules  # 'c' runs the same ref
        await rt.invoke(OP, "w2", "start", None)
        await _until(rt, "w2", _at("middle"))
        d = await eng.update_code("wf_pin_v2:app", "d")
        assert unloaded() == {"1": None, "a": c.from_epoch, "b": d.from_epoch, "c": None, "d": None}  # 'c': w2
        assert (await _finish(rt, "w2"))["result"] == {"ran": ["v1:begin", "v1:middle", "v1:end"], "pinned": "c"}
        e = await eng.update_code("wf_pin_v2:app", "e")
        assert unloaded() == {"1": None, "a": c.from_epoch, "b": d.from_epoch, "c": e.from_epoch,
                              "d": e.from_epoch, "e": None}
        assert eng.book.refs == ["wf_pin_v2:app"] and eng.book.application_of("1") is app
        assert "wf_pin_v1" in sys.modules  # it holds the built-in application: never dropped from the cache
