"""SQL over state shows the user's entities only (issue 25, CLI): the engine's internal entries stored beside an
entity's items (its pending timers) are left out of the SQL views, as ``charon read`` leaves them out, on every
path: the SQL box in-process (the engine's controls and ``POST /admin/sql``, volatile and durable) and
``charon sql``'s Spark views over a data directory (one short real-PySpark test)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from charon import Application, Context, InProcessRuntime, Operator
from charon.client import Client
from charon.server.serve import BackgroundServer

TOKEN = "sq1-internal"
remind = Operator("remind")


@remind.function(public=True)
async def note(ctx: Context, text: str) -> str:
    ctx.put_item("text", text)
    ctx.send_after(3600, remind, ctx.key, "ping")  # pending for an hour: an internal entry of this entity
    return text


@remind.function(public=True)
async def ping(ctx: Context) -> None:
    return None


@remind.function(public=True)
async def alarm_only(ctx: Context) -> None:
    ctx.send_after(3600, remind, ctx.key, "ping")  # nothing of its own: only the timer


APP = Application("reminders", [remind])
QUERY = "SELECT key, item, value FROM remind ORDER BY key, item"


async def _fill(rt: InProcessRuntime) -> None:
    assert await rt.invoke("remind", "r1", "note", "hello") == "hello"
    await rt.invoke("remind", "r2", "alarm_only")
    for key in ("r1", "r2"):  # each timer is there, only left out of SQL
        assert [t.function for t in rt.engine().timers("remind", key)] == ["ping"]


@pytest.mark.parametrize("durable", [False, True], ids=["volatile", "durable"])
def test_the_sql_box_leaves_out_timers(tmp_path: Path, durable: bool) -> None:
    kw: dict[str, Any] = {"data_dir": str(tmp_path), "fsync": False} if durable else {}
    rt = InProcessRuntime(APP, partitions=2, **kw)
    try:
        with BackgroundServer(rt, token=TOKEN) as srv, Client(srv.url, token=TOKEN) as c:
            srv.call(_fill(rt), 60)
            assert len(c.timers("remind", "r1")) == 1 and len(c.timers("remind", "r2")) == 1
            doc = c.sql(QUERY)
            assert doc["rows"] == [["r1", "text", "hello"]], doc
            assert c.sql("SELECT count(*) FROM remind WHERE key = 'r2'")["rows"] == [[0]]
            controls = rt.engine().controls
            assert controls is not None
            inproc = srv.call(controls.sql(QUERY), 60)
            assert inproc.doc()["rows"] == doc["rows"]
    finally:
        rt.close()


def test_charon_sql_views_leave_out_timers(tmp_path: Path, spark: Any) -> None:
    """``charon sql --data-dir`` (statesql's Spark views) over a durable node's data directory."""
    from charon.runtime.spark.statesql import layout_of, register_views

    rt = InProcessRuntime(APP, partitions=2, data_dir=str(tmp_path), fsync=False)

    async def main() -> None:
        async with rt:
            await _fill(rt)

    try:
        asyncio.run(main())
    finally:
        rt.close()
    views = register_views(spark, layout_of(str(tmp_path)))
    assert sorted(views) == ["remind"]  # not the timers' due-time index
    rows = [tuple(r) for r in spark.sql(QUERY).collect()]
    assert rows == [("r1", "text", "hello")], rows
