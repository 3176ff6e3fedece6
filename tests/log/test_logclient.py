"""LogClient survives a locked input log (issue 9 item 3) and enforces one payload per request id.

The "engine" here is a thread that answers every appended request in the output log, as the Spark
runtime's streaming query does; the LogClient, the SQLite logs and the lock are real.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time

import pytest

from charon import serde
from charon.errors import IdempotencyConflict, InvalidKey, LogUnavailable
from charon.log.client import LogClient
from charon.log.sqlite import InputLog, OutputLog
from charon.messages import Reply, Request


class Echo:
    """Answers every request of the input log with its first argument, like a running engine."""

    def __init__(self, inp: InputLog, out: OutputLog) -> None:
        self.inp, self.out = inp, out
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        seen = [0] * self.inp.partitions
        while not self.stop.is_set():
            ends = self.inp.end_offsets()
            for p, off, req in self.inp.read_range(seen, ends):
                self.out.put(Reply(req.request_id, off, p, True, serde.encode(serde.decode(req.args)[0])))
            seen = ends
            time.sleep(0.01)


@pytest.fixture
def logs(tmp_path: os.PathLike[str]):
    inp = InputLog(os.path.join(tmp_path, "in.sqlite"), 2)
    out = OutputLog(os.path.join(tmp_path, "out.sqlite"))
    echo = Echo(inp, out)
    echo.thread.start()
    yield inp, out
    echo.stop.set()
    echo.thread.join(5)


def hold_lock(path: str, seconds: float) -> threading.Thread:
    """Another connection holds the database's write lock for ``seconds``."""
    ready = threading.Event()

    def run() -> None:
        c = sqlite3.connect(path, isolation_level=None)
        c.execute("BEGIN EXCLUSIVE")
        ready.set()
        time.sleep(seconds)
        c.execute("ROLLBACK")
        c.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready.wait(5)
    return t


def test_locked_log_is_retried_or_fails_waiters_typed_and_the_pump_survives(logs) -> None:
    inp, out = logs

    async def main() -> None:
        patient = LogClient(inp, out, append_retry_s=60.0)
        impatient = LogClient(inp, out, append_retry_s=0.0)
        locker = hold_lock(inp.path, 11.5)  # longer than SQLite's 10 s busy wait
        t0 = time.monotonic()
        a = asyncio.ensure_future(impatient.submit("op", "k1", "f", [1], request_id="a1", timeout=60))
        b = asyncio.ensure_future(patient.submit("op", "k2", "f", [2], request_id="b1", timeout=60))
        with pytest.raises(LogUnavailable):
            await a
        rep = await b
        assert rep.ok and serde.decode(rep.value) == 2
        assert time.monotonic() - t0 >= 11.0
        locker.join()
        # the failed request was never appended; a retry with the same id works, on the same client
        rep_a = await impatient.submit("op", "k1", "f", [1], request_id="a1", timeout=30)
        assert rep_a.ok and serde.decode(rep_a.value) == 1
        # a fresh request on the client whose append failed still goes through
        rep_c = await impatient.submit("op", "k3", "f", [3], timeout=30)
        assert serde.decode(rep_c.value) == 3

    asyncio.run(main())


def test_reused_request_id_with_other_payload_is_a_conflict(logs) -> None:
    inp, out = logs

    async def main() -> None:
        c = LogClient(inp, out)
        first = await c.submit("op", "k", "f", [5], request_id="r1", timeout=30)
        again = await c.submit("op", "k", "f", [5], request_id="r1", timeout=30)
        assert again == first
        for op, key, fn, args in [("op", "k", "f", [6]), ("op", "other", "f", [5]), ("op2", "k", "f", [5]),
                                  ("op", "k", "g", [5])]:
            with pytest.raises(IdempotencyConflict):
                await c.submit(op, key, fn, args, request_id="r1", timeout=30)
        # a fresh client (a restarted gateway) sees the same rule from the log alone
        c2 = LogClient(inp, out)
        with pytest.raises(IdempotencyConflict):
            await c2.submit("op", "k", "f", [7], request_id="r1", timeout=30)
        assert await c2.submit("op", "k", "f", [5], request_id="r1", timeout=30) == first

    asyncio.run(main())


def test_unloggable_requests_fail_alone(logs) -> None:
    inp, out = logs

    async def main() -> None:
        c = LogClient(inp, out)
        with pytest.raises(InvalidKey):
            await c.submit("op", "bad\ud800", "f", [1], timeout=30)
        bad = asyncio.ensure_future(c.submit("op", "k", "f\udcff", [1], timeout=30))
        good = asyncio.ensure_future(c.submit("op", "k", "f", [9], timeout=30))
        results = await asyncio.gather(bad, good, return_exceptions=True)
        assert isinstance(results[0], LogUnavailable)
        assert serde.decode(results[1].value) == 9  # same batch, appended on its own

    asyncio.run(main())


def test_a_reply_the_lookup_missed_still_reaches_its_waiter(tmp_path, monkeypatch) -> None:
    """A request answered before this client's tail position whose lookup at submit missed its reply (a gateway
    started after the answer; the output log did not find it that once): the pump's look by id delivers it,
    within ``RECHECK_S``, where the tail read never would."""
    from charon.log import client as client_mod
    from charon.messages import Request

    monkeypatch.setattr(client_mod, "RECHECK_S", 0.2)
    inp = InputLog(os.path.join(tmp_path, "in.sqlite"), 1)
    out = OutputLog(os.path.join(tmp_path, "out.sqlite"))
    req = Request("done-1", "acct", "a", "f", serde.encode([7]), 1.0)
    inp.append_many([req])
    out.put(Reply("done-1", 1, 0, True, serde.encode(7)))  # answered by an engine before the client started
    lc = LogClient(inp, out)  # its tail position is past that reply
    misses = {"left": 1}
    real_get = out.get

    def flaky_get(rid: str) -> Reply | None:
        if rid == "done-1" and misses["left"]:
            misses["left"] -= 1
            return None  # the one look at submit misses it
        return real_get(rid)

    monkeypatch.setattr(out, "get", flaky_get)

    async def main() -> Reply:
        return await lc.submit("acct", "a", "f", [7], request_id="done-1", timeout=5)

    t0 = time.monotonic()
    rep = asyncio.run(main())
    assert rep.ok and serde.decode(rep.value) == 7 and misses["left"] == 0
    assert time.monotonic() - t0 < 2.0


def test_requests_are_appended_in_the_order_they_were_submitted(tmp_path, monkeypatch) -> None:
    """The lookups of known ids run at once, in threads, and may return in any order; the requests still reach the
    input log in the order their submits came (a client's request after an accepted one runs after it)."""
    inp = InputLog(os.path.join(tmp_path, "in.sqlite"), 1)
    out = OutputLog(os.path.join(tmp_path, "out.sqlite"))
    echo = Echo(inp, out)
    echo.thread.start()
    lc = LogClient(inp, out)
    real = lc._lookup

    def slow_first(rid: str):  # the first lookups take longest: without the ordering, the later ones pass them
        time.sleep({"o0": 0.3, "o1": 0.2, "o2": 0.1}.get(rid, 0.0))
        return real(rid)

    monkeypatch.setattr(lc, "_lookup", slow_first)

    async def main() -> list[Reply]:
        tasks = [asyncio.ensure_future(lc.submit("acct", "a", "f", [i], request_id=f"o{i}", timeout=10))
                 for i in range(8)]
        return await asyncio.gather(*tasks)

    try:
        replies = asyncio.run(main())
    finally:
        echo.stop.set()
        echo.thread.join(5)
    assert [serde.decode(r.value) for r in replies] == list(range(8))
    logged = [req.request_id for _, _, req in inp.read_range([0], inp.end_offsets())]
    assert logged == [f"o{i}" for i in range(8)]


def test_one_batch_mixes_known_conflicting_and_new_ids(logs) -> None:
    """The appender looks a batch's client ids up together: a known id is answered with its stored reply and not
    appended again, another operation under a known id fails alone, a new one and a minted one are appended."""
    inp, out = logs

    async def main() -> None:
        first = await LogClient(inp, out).submit("op", "k", "f", [5], request_id="known", timeout=30)
        c = LogClient(inp, out, group_commit_s=0.05)  # one window: the four below form one batch
        c._last_append = time.monotonic()

        futs = [c.enqueue(Request("known", "op", "k", "f", serde.encode([5]), time.time())),
                c.enqueue(Request("new", "op", "k", "f", serde.encode([6]), time.time())),
                c.enqueue(Request("minted", "op", "k", "f", serde.encode([7]), time.time()), given=False)]
        with pytest.raises(IdempotencyConflict):  # another operation under an id waiting here: at once
            await c.submit("op", "k", "f", [8], request_id="new", timeout=30)
        other = c.enqueue(Request("known", "op", "k", "f", serde.encode([5]), time.time()))  # shares the future
        assert other is futs[0]
        results = await asyncio.gather(*futs, return_exceptions=True)
        assert results[0] == first
        assert [serde.decode(r.value) for r in results[1:]] == [6, 7]
        with pytest.raises(IdempotencyConflict):  # from the log: the appender's lookup
            await c.submit("op", "k", "f", [9], request_id="known", timeout=30)

    asyncio.run(main())
    appended = [req.request_id for _, _, req in inp.read_range([0] * inp.partitions, inp.end_offsets())]
    assert appended.count("known") == 1 and "new" in appended and "minted" in appended


def test_replies_a_writer_of_this_process_wrote_answer_their_waiters_without_a_poll(tmp_path) -> None:
    """``replies_written`` (the Spark driver's reply writer, after its write): the waiting submit is answered at
    once, not at the pump's next look at the output log (here a poll every 30 s would never come in time)."""
    inp = InputLog(os.path.join(tmp_path, "in.sqlite"), 1)
    out = OutputLog(os.path.join(tmp_path, "out.sqlite"))
    lc = LogClient(inp, out, poll_s=30.0)
    waited: list[float] = []

    def writer() -> None:  # stands for the driver's reply writer thread
        while inp.position("push-1") is None:
            time.sleep(0.005)
        time.sleep(0.3)  # the pump has looked and is asleep by now
        rep = Reply("push-1", 1, 0, True, serde.encode(3))
        out.put_many([rep])
        lc.replies_written([rep])

    async def main() -> Reply:
        t = threading.Thread(target=writer, daemon=True)
        t.start()
        t0 = time.monotonic()
        rep = await lc.submit("acct", "a", "f", [3], request_id="push-1", timeout=10)
        waited.append(time.monotonic() - t0)
        return rep

    rep = asyncio.run(main())
    assert rep.ok and serde.decode(rep.value) == 3
    assert waited[0] < 2.0, f"answered by the writer's call, not by a poll ({waited[0]:.2f} s)"
