"""Durable logs: the SQLite input and output logs (:mod:`charon.log.sqlite`) and the client-side append path
(:mod:`charon.log.client`). It may import ``charon.core`` (key checks) and the top-level model modules; never
``charon.runtime``, ``charon.state`` or ``charon.server``.
"""

from charon.log.sqlite import InputLog, OutputLog

__all__ = ["InputLog", "OutputLog"]
