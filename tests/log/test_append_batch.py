"""The input log's one-statement append of a batch of new ids gives exactly what appending item by item gives,
whatever mix of new, known and repeated ids a batch holds (a known id falls back to the item-by-item path)."""

from __future__ import annotations

import os
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from charon.log.sqlite import InputLog
from charon.messages import Request


def _req(rid: str, key: str) -> Request:
    return Request(rid, "op", key, "f", b"\x90", 1.0)


batches = st.lists(st.lists(st.tuples(st.sampled_from("abcdefgh"), st.sampled_from("xyz")), max_size=6),
                   min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(batches)
def test_batched_append_matches_item_by_item(bs: list[list[tuple[str, str]]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        batched = InputLog(os.path.join(d, "a.sqlite"), 3)
        single = InputLog(os.path.join(d, "b.sqlite"), 3)
        for batch in bs:
            got = batched.append_many([_req(r, k) for r, k in batch])
            want = [single.append(_req(r, k)) for r, k in batch]
            assert got == want
        assert batched.end_offsets() == single.end_offsets()
        for p, end in enumerate(batched.end_offsets()):
            assert [r.request_id for r in batched.read(p, 0, end)] == [r.request_id for r in single.read(p, 0, end)]
        batched.close()
        single.close()
