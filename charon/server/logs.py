"""The server's logs: one setup (:func:`setup_logging`) for ``charon run``, text by default or JSON lines.

Every line goes to stderr through stdlib :mod:`logging`. A JSON line holds ``ts`` (ISO 8601, UTC), ``level``,
``logger``, ``msg``, every ``extra`` field the call site gave (``request_id``, ``operator``, ``function``, ``key``,
``error_type``, ``epoch``...) and, for a record with an exception, ``traceback``. A text line is
``TS LEVEL LOGGER: MSG key=value ...`` with the same extra fields. The loggers are named under ``charon``:
``charon.server`` (start, ready, shutdown), ``charon.admin`` (operator actions), ``charon.engine`` (restarts,
outages), ``charon.requests`` (aborts).
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import TextIO

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

__all__ = ["setup_logging", "LOG_FORMATS", "LOG_LEVELS", "JsonLines", "JsonFields", "TextLines", "extra_fields"]

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_RESERVED = frozenset(RESERVED_ATTRS) | {"message", "asctime", "taskName"}
_HANDLER_NAME = "charon-logs"


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
    (stderr) as text or JSON lines; called once per process (again: replaces its handler). Returns the handler."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {fmt!r}")
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(JsonLines() if fmt == "json" else TextLines())
    if fmt == "json":
        handler.addFilter(JsonFields())
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
