"""The HTTP front end: the gateway (:mod:`charon.server.gateway`); metrics and the dashboard join here. It
may import ``charon.core``, ``charon.log`` and the top-level model modules, and uses a runtime only through
the protocol the gateway defines; it never imports ``charon.runtime`` or ``charon.state``.
"""
