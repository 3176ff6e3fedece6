"""Verdict records survive torn writes (issue 31): a process killed in the middle of appending to
``verdicts.jsonl`` leaves a torn tail; the next load cuts it off the file before anything is appended, so the
next verdict (relied on: its InvocationTimeout reply went out) is not glued to it and lost at the following load,
which would run its transaction again on replay."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from charon.core.epoch import Verdict
from charon.runtime.guard.verdicts import FILE, CorruptRecords, VerdictBook, letter

TESTS = Path(__file__).resolve().parents[1] / "support"

# A durable node: one spinning transaction times out (its verdict recorded, its reply out), then the process dies
# without a checkpoint (the restart replays the epoch from the input log, with the recorded verdict).
_SPIN = """
import asyncio, os, sys
from charon import InProcessRuntime
from hostile_app import app
async def main():
    rt = InProcessRuntime(app, partitions=2, data_dir=sys.argv[1], function_timeout=0.3, watchdog_interval=0.05,
                          checkpoint_s=3600, warmup_txns=0)
    async with rt:
        r = await asyncio.wait_for(rt.submit("acc", sys.argv[2], "spin", [], request_id=sys.argv[2]), 30)
        print(r.request_id, r.error_type)
        sys.stdout.flush()
        os._exit(0)
asyncio.run(main())
"""

# A restart: recovery replays every logged epoch (a spin without its verdict would run forever: no budget applies
# to a replay), then lists the verdicts it knows.
_CHECK = """
import sys
from charon import InProcessRuntime
from hostile_app import app
rt = InProcessRuntime(app, partitions=2, data_dir=sys.argv[1], function_timeout=0.3, warmup_txns=0)
print(sorted(rt.verdict_book.verdicts), rt.get_reply("s1").error_type, rt.get_reply("s2").error_type)
rt.close()
"""


def _child(script: str, *args: str, timeout: float = 60) -> str:
    p = subprocess.run([sys.executable, "-c", script, *args], env={**os.environ, "PYTHONPATH": str(TESTS)},
                       capture_output=True, text=True, timeout=timeout, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_a_verdict_recorded_after_a_torn_write_survives_the_next_restart(tmp_path: Path) -> None:
    assert _child(_SPIN, str(tmp_path), "s1").split() == ["s1", "InvocationTimeout"]
    with open(tmp_path / FILE, "ab") as f:  # the next append was cut short (killed in the middle of a write)
        f.write(b'{"request_id":"s9","operator":"acc","func')
    # restarted: the torn tail is dropped (it was never relied on), s2 times out and is replied
    assert _child(_SPIN, str(tmp_path), "s2").split() == ["s2", "InvocationTimeout"]
    # restarted again: both verdicts are loaded, so the replay refuses both spins instead of running one forever
    out = _child(_CHECK, str(tmp_path), timeout=45)
    assert out.split() == ["['s1',", "'s2']", "InvocationTimeout", "InvocationTimeout"], out
    lines = (tmp_path / FILE).read_bytes().splitlines(keepends=True)
    assert len(lines) == 2 and all(line.endswith(b"\n") for line in lines)


def _v(rid: str) -> bytes:
    import msgspec

    return msgspec.json.encode(letter(rid, "acc", "f", "k", Verdict("InvocationTimeout", rid, False), 1)) + b"\n"


def test_a_record_glued_to_a_torn_prefix_by_an_older_version_is_recovered(tmp_path: Path) -> None:
    c = _v("c")
    (tmp_path / FILE).write_bytes(_v("a") + b'{"request_id":"b","operator":"acc","func' + c + b'{"requ')
    book = VerdictBook(str(tmp_path))
    assert sorted(book.verdicts) == ["a", "c"]
    assert (tmp_path / FILE).read_bytes().endswith(c)  # the torn tail is cut off the file
    book.record(letter("d", "acc", "f", "k", Verdict("Quarantined", "d", True), 2))
    assert sorted(VerdictBook(str(tmp_path)).verdicts) == ["a", "c", "d"]


def test_an_undecodable_record_that_was_relied_on_is_an_error(tmp_path: Path) -> None:
    (tmp_path / FILE).write_bytes(_v("a") + b"garbage\n" + _v("c"))
    with pytest.raises(CorruptRecords, match="byte"):
        VerdictBook(str(tmp_path))
    a = _v("a")
    (tmp_path / FILE).write_bytes(a + b"garbage\n")  # last and undecodable: a torn tail (never relied on)
    assert sorted(VerdictBook(str(tmp_path)).verdicts) == ["a"]
    assert (tmp_path / FILE).read_bytes() == a


def test_a_fallback_verdict_keeps_its_round_and_epoch_and_older_records_read(tmp_path: Path) -> None:
    """The fallback round a verdict was taken in (replayed there: tests/core/test_fallback_verdicts.py) and its epoch
    survive a restart; a record written before rounds were kept reads with none (judged before the fallback)."""
    old = (b'{"request_id":"o","operator":"acc","function":"f","key":"k","error_type":"InvocationTimeout",'
           b'"message":"m","epoch":4,"fallback":true,"at":1.0,"root":"acc.f"}\n')
    (tmp_path / FILE).write_bytes(old)
    book = VerdictBook(str(tmp_path))
    assert book.verdicts["o"] == Verdict("InvocationTimeout", "m", True, None, 4)
    book.record(letter("n", "acc", "f", "k", Verdict("InvocationTimeout", "m", True, 3, 5), 5))
    # the watchdog reserves with the round it read once the step was judged (maybe a later one); the engine thread
    # settles with the round the step ends in, recorded again when they differ
    assert book.reserve(letter("w", "acc", "f", "k", Verdict("InvocationTimeout", "m", True, 8, 5), 5))
    assert book.settle(letter("w", "acc", "f", "k", Verdict("InvocationTimeout", "m", True, 7, 5), 5)).in_round == 7
    again = VerdictBook(str(tmp_path)).verdicts
    assert again["n"] == Verdict("InvocationTimeout", "m", True, 3, 5)
    assert again["w"].in_round == 7 and again["o"].in_round is None
