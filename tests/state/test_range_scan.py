"""Range scans (``ctx.scan_items(prefix, start, stop)``) read only the range, and equal filtering all items."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from charon import Application, Context, InProcessRuntime, Operator, Request, serde

box = Operator("box")


@box.function
async def put_then_scan(ctx: Context, writes: dict, deletes: list, prefix: str, start: str | None,
                        stop: str | None) -> list:
    for name, v in writes.items():
        ctx.put_item(name, v)
    for name in deletes:
        ctx.delete_item(name)
    return ctx.scan_items(prefix, start, stop)


app = Application("ranges", [box])
names = st.text(alphabet="ab:\u00e9\U0001f600", min_size=0, max_size=4)


@settings(max_examples=120, deadline=None)
@given(st.dictionaries(names, st.integers(0, 9), max_size=8), st.dictionaries(names, st.integers(10, 19), max_size=4),
       st.lists(names, max_size=3), names, st.none() | names, st.none() | names)
def test_range_scan_equals_filtering(loaded, writes, deletes, prefix, start, stop):
    """Committed items, the transaction's own writes and deletes, any prefix/start/stop (non-ASCII too)."""
    rt = InProcessRuntime(app, partitions=2)
    if loaded:
        rt.load_items("box", "k", loaded)
    r = rt.run_epoch([Request("r", "box", "k", "put_then_scan",
                              serde.encode([writes, deletes, prefix, start, stop]))])
    assert r.replies[1].ok, r.replies[1].error_message
    items = {**loaded, **writes}
    for d in deletes:
        items.pop(d, None)
    expect = sorted((n, v) for n, v in items.items() if n.startswith(prefix) and (start is None or n >= start)
                    and (stop is None or n < stop))
    assert [tuple(x) for x in serde.decode(r.replies[1].value)] == expect
