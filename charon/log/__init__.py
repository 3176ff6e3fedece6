"""Durable logs: the embedded SQLite input and output logs (:mod:`charon.log.sqlite`, the default), the same
logs on NATS JetStream (:mod:`charon.log.nats`, for gateways on other machines) and the client-side append
path (:mod:`charon.log.client`). It may import ``charon.core`` (key checks) and the top-level model modules;
never ``charon.runtime``, ``charon.state`` or ``charon.server``.

:func:`open_input_log` / :func:`open_output_log` pick the implementation from a location: a file path (SQLite)
or a URL ``nats://host:port/deployment`` (JetStream), typed as the contract both implement
(:class:`InputLogLike`, :class:`OutputLogLike`, :mod:`charon.log.contract`).
"""

from charon.log.contract import InputLogLike, OutputLogLike
from charon.log.location import is_networked, log_locations, open_input_log, open_output_log
from charon.log.offsets import pad_offsets, pad_pair
from charon.log.sqlite import InputLog, OutputLog

__all__ = ["InputLog", "InputLogLike", "OutputLog", "OutputLogLike", "is_networked", "log_locations",
           "open_input_log", "open_output_log", "pad_offsets", "pad_pair"]
