"""The server's logs: one setup (:func:`setup_logging`) for ``charon run``, text by default or JSON lines.

Every line goes to stderr through stdlib :mod:`logging`. A JSON line holds ``ts`` (ISO 8601, UTC), ``level``,
``logger``, ``msg``, every ``extra`` field the call site gave (``request_id``, ``operator``, ``function``, ``key``,
``error_type``, ``epoch``...) and, for a record with an exception, ``traceback``. A text line is
``TS LEVEL LOGGER: MSG key=value ...`` with the same extra fields. The loggers are named under ``charon``:
``charon.server`` (start, ready, shutdown), ``charon.admin`` (operator actions), ``charon.engine`` (restarts,
outages), ``charon.requests`` (aborts).
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import queue
import sys
import time
from datetime import UTC, datetime
from typing import TextIO

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

__all__ = ["setup_logging", "reset_logging", "NonBlocking", "LOG_FORMATS", "LOG_LEVELS", "LOG_QUEUE",
           "JsonLines", "JsonFields", "TextLines", "extra_fields"]

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_RESERVED = frozenset(RESERVED_ATTRS) | {"message", "asctime", "taskName"}
_HANDLER_NAME = "charon-logs"
STOP_WAIT = 5.0  # seconds a stop (a new setup, the process's exit) waits for the writer to write what is queued
LOG_QUEUE = 10_000  # records waiting for the writer thread at most; beyond, they are dropped and counted


class NonBlocking(logging.handlers.QueueHandler):
    """Hands each record to a writer thread (:class:`logging.handlers.QueueListener`) and never waits: the engine's
    thread logs an abort without touching stderr, so a slow or unread stderr (a pipe nobody drains) cannot stall
    it. When the queue is full a record is dropped and counted; the next record that fits is preceded by a
    ``dropped N log lines`` warning. :meth:`flush` waits until the writer has written what is queued."""

    def __init__(self, q: queue.Queue[logging.LogRecord | None]) -> None:
        super().__init__(q)
        self.pending = q
        self.dropped = 0  # dropped since the last ``log_dropped`` line
        self.dropped_total = 0  # dropped since the handler was made

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record.msg = record.getMessage()  # the arguments as they are now; the formatter runs in the writer
        record.args = None
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        q = self.pending
        try:
            if self.dropped:
                q.put_nowait(logging.makeLogRecord({
                    "name": "charon.server", "levelno": logging.WARNING, "levelname": "WARNING",
                    "msg": f"dropped {self.dropped} log lines (stderr was not read fast enough)",
                    "event": "log_dropped", "dropped": self.dropped}))
                self.dropped = 0
            q.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            self.dropped_total += 1

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until the writer has written what is queued (at most ``timeout`` s: a stream may never move)."""
        deadline = time.monotonic() + timeout
        while self.pending.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)


class _Writer(logging.handlers.QueueListener):
    """The writer thread; its stop waits (a little) for room for its sentinel instead of failing on a full queue,
    and for the writer at most :data:`STOP_WAIT` s: a stream that never moves must not keep the process alive."""

    def __init__(self, q: queue.Queue[logging.LogRecord | None], writer: logging.Handler) -> None:
        super().__init__(q, writer)
        self.pending = q

    def enqueue_sentinel(self) -> None:
        try:
            self.pending.put(None, timeout=2.0)  # QueueListener's sentinel is None
        except queue.Full:
            pass

    def stop(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self.enqueue_sentinel()
        thread.join(STOP_WAIT)  # a daemon thread: left behind if its stream is stuck
        self._thread = None


_listener: _Writer | None = None


def _stop_listener() -> None:
    global _listener
    if _listener is not None and _listener._thread is not None:
        _listener.stop()  # writes what is queued
    _listener = None


atexit.register(_stop_listener)


def reset_logging() -> None:
    """Undo :func:`setup_logging`: stop its writer and take its handler off the loggers (as before the setup)."""
    _stop_listener()
    for name in ("charon", "uvicorn", "uvicorn.error", "opentelemetry"):
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
            logger.removeHandler(old)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
    logging.getLogger("uvicorn.access").disabled = False


def extra_fields(record: logging.LogRecord) -> dict[str, object]:
    """The fields a call site passed as ``extra`` (everything not a standard :class:`logging.LogRecord` one)."""
    return {k: v for k, v in record.__dict__.items() if k not in _RESERVED and not k.startswith("_")}


def _ts(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonLines(JsonFormatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg``, the extra fields, ``traceback`` (the
    handler's :class:`JsonFields` filter gives ``ts`` and ``level``)."""

    def __init__(self) -> None:
        super().__init__("%(ts)s %(level)s %(name)s %(message)s", json_ensure_ascii=False,
                         rename_fields={"name": "logger", "message": "msg", "exc_info": "traceback"})


class JsonFields(logging.Filter):
    """Gives each record the ``ts`` (ISO 8601, UTC, milliseconds) and lower-case ``level`` of a JSON line."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.ts = _ts(record)
        record.level = record.levelname.lower()
        return True


class TextLines(logging.Formatter):
    """``TS LEVEL LOGGER: MSG key=value ...`` and the traceback below it, if any."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_ts(record)} {record.levelname} {record.name}: {record.getMessage()}"
        extra = extra_fields(record)
        if extra:
            line += " " + " ".join(f"{k}={v!r}" if isinstance(v, str) and (" " in v or not v) else f"{k}={v}"
                                   for k, v in extra.items() if k != "traceback")
        tb = extra.get("traceback")
        if record.exc_info:
            tb = self.formatException(record.exc_info)
        if tb:
            line += "\n" + str(tb).rstrip("\n")
        return line


def setup_logging(level: str = "info", fmt: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """Send the ``charon`` loggers (at ``level``), uvicorn's and OpenTelemetry's (warnings and above) to ``stream``
    (stderr) as text or JSON lines, written by a thread of their own (:class:`NonBlocking`); called once per
    process (again: replaces its handler). Returns the handler (``flush()`` waits until the lines are written)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {fmt!r}")
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
    global _listener
    writer = logging.StreamHandler(stream if stream is not None else sys.stderr)
    writer.setFormatter(JsonLines() if fmt == "json" else TextLines())
    if fmt == "json":
        writer.addFilter(JsonFields())
    _stop_listener()
    q: queue.Queue[logging.LogRecord | None] = queue.Queue(LOG_QUEUE)
    handler = NonBlocking(q)
    handler.set_name(_HANDLER_NAME)
    _listener = _Writer(q, writer)
    _listener.start()
    for name, lvl in (("charon", level.upper()), ("uvicorn", "WARNING"), ("uvicorn.error", "WARNING"),
                      ("opentelemetry", "WARNING")):  # e.g. the span exporter's "collector unreachable"
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
            logger.removeHandler(old)
        logger.setLevel(lvl)
        logger.propagate = False
        if name != "uvicorn.error":  # it propagates to "uvicorn"
            logger.addHandler(handler)
    logging.getLogger("uvicorn.error").propagate = True
    logging.getLogger("uvicorn.access").disabled = True
    return handler
