"""What the gateway uses of uvicorn beyond its documented API, checked (issue 35).

The direct invoke path (:class:`~charon.server.lane.DirectInvoke`) answers a request from uvicorn's protocol
callbacks and sets the state uvicorn's own ``RequestResponseCycle.send`` would; the guarded protocols
(:mod:`charon.server.http`) read its pipeline and cycle. None of that is a public uvicorn interface, so
``pyproject.toml`` pins the uvicorn versions it was tested with, and :func:`missing` names what a given uvicorn lacks:
the gateway then serves every invoke through the ASGI route (slower, same answers) and logs why, instead of failing
at the first request; ``tests/server/test_uvicorn_pin.py`` fails on a uvicorn that lacks any of it.
"""

from __future__ import annotations

import importlib
import inspect
import re
from functools import cache

__all__ = ["CYCLE_ATTRIBUTES", "PROTOCOL_ATTRIBUTES", "missing"]

MODULE = "uvicorn.protocols.http.httptools_impl"
# set in RequestResponseCycle.__init__; read or written by DirectInvoke and GuardedHttpTools
CYCLE_ATTRIBUTES = ("scope", "body", "more_body", "disconnected", "keep_alive", "message_event",
                    "response_started", "response_complete", "waiting_for_100_continue", "on_response")
# set in HttpToolsProtocol.__init__ (or its connection_made); read by DirectInvoke and GuardedHttpTools
PROTOCOL_ATTRIBUTES = ("loop", "transport", "flow", "server_state", "pipeline", "cycle")
PROTOCOL_METHODS = ("_unset_keepalive_if_required", "on_headers_complete", "on_body", "on_message_complete")


def _assigned(cls: type[object]) -> set[str]:
    """The instance attributes ``cls``'s own methods assign (``self.NAME = ...`` or ``self.NAME: T = ...``)."""
    return set(re.findall(r"self\.([A-Za-z_]\w*)\s*(?::[^=\n]+)?=(?!=)", inspect.getsource(cls)))


@cache
def missing() -> tuple[str, ...]:
    """What the installed uvicorn lacks of what the gateway relies on (empty: all there)."""
    try:
        mod = importlib.import_module(MODULE)
    except ImportError as exc:  # httptools not installed: no direct path anyway
        return (f"{MODULE} ({exc})",)
    out = [f"{MODULE}.{name}" for name in ("STATUS_LINE", "HttpToolsProtocol", "RequestResponseCycle")
           if not hasattr(mod, name)]
    if out:
        return tuple(out)
    cycle, proto = mod.RequestResponseCycle, mod.HttpToolsProtocol
    have = _assigned(cycle)
    out += [f"RequestResponseCycle.{a}" for a in CYCLE_ATTRIBUTES if a not in have and not hasattr(cycle, a)]
    have = _assigned(proto)
    out += [f"HttpToolsProtocol.{a}" for a in PROTOCOL_ATTRIBUTES if a not in have and not hasattr(proto, a)]
    out += [f"HttpToolsProtocol.{m}()" for m in PROTOCOL_METHODS if not callable(getattr(proto, m, None))]
    return tuple(out)
