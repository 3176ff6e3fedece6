"""Choosing a log implementation from its location: a file path (SQLite) or ``nats://host:port/deployment``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from charon.log.contract import InputLogLike, OutputLogLike
from charon.log.sqlite import InputLog, OutputLog

__all__ = ["is_networked", "log_locations", "open_input_log", "open_output_log"]


def is_networked(location: str | os.PathLike[str] | None) -> bool:
    """Whether a log location is a NATS URL (``nats://`` or ``tls://``) rather than a file path."""
    from charon.log.nats import is_nats_url

    return location is not None and is_nats_url(location)


def log_locations(data_dir: str, log_url: str | None) -> tuple[str, str]:
    """``(input, output)`` log locations of a deployment: files under ``data_dir``, or the same NATS URL."""
    if log_url:
        if not is_networked(log_url):
            raise ValueError(f"log URL {log_url!r} must start with nats:// or tls://")
        return log_url, log_url
    return os.path.join(data_dir, "input.sqlite"), os.path.join(data_dir, "output.sqlite")


def open_input_log(
    location: str | os.PathLike[str], partitions: int | None = None, *, durable: bool = True, resize: bool = False,
) -> InputLogLike:
    """The input log at ``location``: :class:`InputLog` for a path, :class:`~charon.log.nats.NatsInputLog` for a
    NATS URL (both implement :class:`~charon.log.contract.InputLogLike`). An explicit ``partitions`` other than
    the log's routing count raises ``ValueError``, or with ``resize=True`` resizes the log
    (:meth:`InputLog.resize`)."""
    if is_networked(location):
        from charon.log.nats import NatsInputLog

        return NatsInputLog(str(location), partitions, durable=durable, resize=resize)
    return InputLog(location, partitions, durable=durable, resize=resize)


def open_output_log(location: str | os.PathLike[str], *, durable: bool = True) -> OutputLogLike:
    """The output log at ``location``: :class:`OutputLog` for a path, :class:`~charon.log.nats.NatsOutputLog`
    for a NATS URL (both implement :class:`~charon.log.contract.OutputLogLike`)."""
    if is_networked(location):
        from charon.log.nats import NatsOutputLog

        return NatsOutputLog(str(location), durable=durable)
    return OutputLog(location, durable=durable)


if TYPE_CHECKING:  # the type checker proves that both stores implement the contract (a member missing fails here)
    from charon.log.nats import NatsInputLog, NatsOutputLog

    def _conforms(
        sqlite_in: InputLog, sqlite_out: OutputLog, nats_in: NatsInputLog, nats_out: NatsOutputLog,
    ) -> tuple[list[InputLogLike], list[OutputLogLike]]:
        return [sqlite_in, nats_in], [sqlite_out, nats_out]
