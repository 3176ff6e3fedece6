"""Replies written to the output log on a thread of their own, in order, off the epoch's critical path.

An epoch's replies are decided when its rest returns; writing them (encoding, one log transaction) then
overlaps with the next epoch's job instead of delaying it. The one rule: an epoch's record is written only
after its replies are in the log (:meth:`ReplyWriter.flush` before the record), since a recorded epoch is
never run again and would otherwise lose replies a crash kept from the log. Until then a crash loses nothing:
the unrecorded epoch runs again and derives the same replies (the log ignores a request id it already has).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from charon.messages import Reply


class ReplyWriter:
    """Writes batches of replies with ``write`` (e.g. ``OutputLog.put_many``) on a daemon thread, in the order
    they were put. A failed write keeps its batch at the head of the queue and stops the thread; the failure is
    raised by the next :meth:`put` (which then does not queue its batch: its epoch fails and runs again) or
    :meth:`flush`, and each of them first has the kept batch tried again (the log may be back): nothing is
    dropped silently, and a failure that is over is not raised again."""

    def __init__(self, write: Callable[[list[Reply]], object], name: str = "charon-replies") -> None:
        self._write = write
        self._name = name
        self._cv = threading.Condition()
        self._queue: deque[list[Reply]] = deque()
        self._busy = False  # a batch is being written
        self._error: BaseException | None = None  # the failure of the write that stopped the thread
        self._writes = 0  # writes started
        self._failed_at = 0  # the write whose failure is ``_error``
        self._closed = False
        self._thread: threading.Thread | None = None

    def put(self, replies: list[Reply]) -> None:
        """Queue a batch (returns at once). After a failed write: has its kept batch tried again and raises its
        error instead (this batch is not queued)."""
        if not replies:
            return
        with self._cv:
            err = self._error
            if err is not None:  # try the kept batch again (the log may be back), raise the failure to the epoch
                self._error = None
                self._cv.notify_all()
                raise err
            self._queue.append(replies)
            self._closed = False
            if self._thread is None:  # none, or it ended (see _run)
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every batch put so far is written, trying a failed batch again first; raises the error of
        a write started since the call that failed (the batch stays queued: a later flush tries it again) or
        TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            began = self._writes  # only a write started from here on may fail this flush
            while True:
                if self._error is not None:
                    self._error = None  # try the failed batch again (the log may be back)
                    self._cv.notify_all()
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._cv.wait_for(lambda: (not self._queue and not self._busy) or self._error is not None,
                                         left):
                    raise TimeoutError(f"replies not written within {timeout} s")
                if self._error is None:
                    return
                if self._failed_at > began:
                    raise self._error

    def close(self) -> None:
        """Write what is queued (:meth:`flush`), then end the thread (a later :meth:`put` starts another)."""
        try:
            self.flush()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()

    def abandon(self) -> None:
        """Drop what is queued and end the thread, as a crash of the process would (a simulator's crash); a
        batch being written is let finish (the log may be closed right after)."""
        with self._cv:
            self._queue.clear()
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def pending(self) -> int:
        """Replies queued or being written."""
        with self._cv:
            return sum(len(b) for b in self._queue)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: (self._queue and self._error is None) or (self._closed and not self._queue))
                if not self._queue:
                    if self._thread is threading.current_thread():
                        self._thread = None  # a put from now on starts another (this one may still look alive)
                    return
                batch = self._queue[0]
                self._busy = True
                self._writes += 1
                attempt = self._writes
            try:
                self._write(batch)
            except BaseException as e:  # noqa: BLE001 - kept and raised by put/flush on the epoch's thread
                with self._cv:
                    self._error = e
                    self._failed_at = attempt
                    self._busy = False
                    self._cv.notify_all()
                continue
            with self._cv:
                if self._queue and self._queue[0] is batch:  # else abandoned meanwhile
                    self._queue.popleft()
                self._busy = False
                self._cv.notify_all()
