"""The code book Spark's executors get (:class:`charon.runtime.control.codeversions.RecordedCode`): built from the
shipped code history only, it answers as the driver's history does, and imports every version when preloaded
(never later: a version that failed to import stays unavailable, its pinned steps fail typed)."""

from __future__ import annotations

from typing import Any

from wf_pin_v1 import app as v1
from wf_pin_v2 import app as v2

from charon.runtime.control.codeversions import CodeHistory, CodeVersion, RecordedCode, code_entries


def test_the_book_answers_as_the_history_and_imports_only_when_preloaded() -> None:
    hist = CodeHistory(None, CodeVersion(0, "1", "wf_pin_v1:app"))
    hist.versions += [CodeVersion(5, "v2", "wf_pin_v2:app", None, 40), CodeVersion(9, "gone", "no_such_mod:app")]
    loads: list[str] = []

    def load(ref: str) -> Any:
        loads.append(ref)
        if ref.startswith("no_such_mod"):
            raise ModuleNotFoundError(ref)
        return {"wf_pin_v1:app": v1, "wf_pin_v2:app": v2}[ref]

    book = RecordedCode(code_entries(hist), load)
    assert book.application_of("1") is None and loads == []  # nothing imported before preload
    assert book.preload() is book and loads == ["wf_pin_v1:app", "wf_pin_v2:app", "no_such_mod:app"]
    for epoch, tid in ((0, 1), (5, 39), (5, 40), (8, 2), (9, 1), (20, 7)):
        assert book.label_of(epoch, tid) == hist.label(epoch, tid)
    assert [book.label_of(5, 39), book.label_of(5, 40)] == ["1", "v2"]  # a compatible update's first TID
    assert book.application_of("1") is v1 and book.application_of("v2") is v2
    assert book.application_of("gone") is None and book.application_of("v9") is None
    book.preload()
    assert loads.count("wf_pin_v1:app") == 1  # imported once
