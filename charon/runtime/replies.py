"""Replies written to the output log on a thread of their own, in order, off the epoch's critical path.

An epoch's replies are decided when its rest returns; writing them (encoding, one log transaction) then
overlaps with the next epoch's job instead of delaying it. The one rule: an epoch's record is written only
after its replies are in the log (:meth:`ReplyWriter.flush` before the record), since a recorded epoch is
never run again and would otherwise lose replies a crash kept from the log. Until then a crash loses nothing:
the unrecorded epoch runs again and derives the same replies (the log ignores a request id it already has).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from charon.messages import Reply


class ReplyWriter:
    """Writes batches of replies with ``write`` (e.g. ``OutputLog.put_many``) on a daemon thread, in the order
    they were put. A failed write is raised by the next :meth:`put` or :meth:`flush` (and the batch kept, so a
    flush after the log recovered writes it); nothing is dropped silently."""

    def __init__(self, write: Callable[[list[Reply]], object], name: str = "charon-replies") -> None:
        self._write = write
        self._name = name
        self._cv = threading.Condition()
        self._queue: deque[list[Reply]] = deque()
        self._busy = False  # a batch is being written
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def put(self, replies: list[Reply]) -> None:
        """Queue a batch (returns at once); raises the error of an earlier failed write."""
        if not replies:
            return
        with self._cv:
            self._raise()
            self._queue.append(replies)
            self._closed = False
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every batch put so far is written; raises the error of a failed write (the batch stays
        queued: a later flush tries it again) or TimeoutError."""
        with self._cv:
            if self._error is not None and self._queue and not self._busy:
                self._error = None  # try the failed batch again (the log may be back)
                self._cv.notify_all()
            if not self._cv.wait_for(lambda: (not self._queue and not self._busy) or self._error is not None,
                                     timeout):
                raise TimeoutError(f"replies not written within {timeout} s")
            self._raise()

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

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: (self._queue and self._error is None) or (self._closed and not self._queue))
                if not self._queue:
                    return
                batch = self._queue[0]
                self._busy = True
            try:
                self._write(batch)
            except BaseException as e:  # noqa: BLE001 - kept and raised by put/flush on the epoch's thread
                with self._cv:
                    self._error = e
                    self._busy = False
                    self._cv.notify_all()
                continue
            with self._cv:
                if self._queue and self._queue[0] is batch:  # else abandoned meanwhile
                    self._queue.popleft()
                self._busy = False
                self._cv.notify_all()
