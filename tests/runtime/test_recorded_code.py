"""The code book Spark's executors get (:class:`charon.runtime.control.codeversions.RecordedCode`): built from the
shipped code history only, it answers as the driver's history does, and imports every version when preloaded
(never later: a version that failed to import stays unavailable, its pinned steps fail typed); a version a code
update unloaded (drained) is not loaded, and a worker drops it."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import wf_pin_v1
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


def test_a_drained_entry_is_not_loaded_and_a_worker_unloads_it(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A Spark worker's book (:func:`charon.runtime.spark.tasks.code_book`) from a history whose update unloaded a
    drained version: the next book reuses the applications still loaded and drops the drained one from the book,
    the worker's application cache and the import cache."""
    from charon.runtime.spark import session, tasks

    name = f"wf_drained_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(Path(wf_pin_v1.__file__).read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tasks, "_BOOK", [])
    hist = CodeHistory(None, CodeVersion(0, "1", f"{name}:app"))
    hist.versions.append(CodeVersion(3, "v2", "wf_pin_v2:app"))
    first = tasks.code_book(code_entries(hist))
    assert first is not None and tasks.code_book(code_entries(hist)) is first  # kept while the history is the same
    drained = first.application_of("1")
    assert drained is sys.modules[name].app and session.load_app(f"{name}:app") is drained
    hist.versions = hist.updated(CodeVersion(7, "v3", "wf_pin_v2:app"), ["1"])
    assert [v.unloaded_at for v in hist.versions] == [7, None, None]
    book = tasks.code_book(code_entries(hist))
    assert book is not None and book is not first and book.refs == ["wf_pin_v2:app"]
    assert book.application_of("1") is None and book.application_of("v2") is v2 is book.application_of("v3")
    assert book.label_of(2, 1) == "1"  # its label still answers (a transaction's recorded version)
    assert name not in sys.modules
    assert session.load_app(f"{name}:app") is not drained  # out of the worker's cache too: imported afresh
    again = RecordedCode(code_entries(hist), lambda ref: pytest.fail(f"imported {ref}"), prior=book).preload()
    assert again.application_of("v3") is v2  # reused from the book before: nothing imported
