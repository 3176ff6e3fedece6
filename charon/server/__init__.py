"""The HTTP front end: the gateway (:mod:`charon.server.gateway`, run by :mod:`charon.server.serve`), its admin
routes (:mod:`charon.server.admin`), metrics and the dashboard; what the routes share lives in
:mod:`charon.server.wire`, :mod:`charon.server.limits`, :mod:`charon.server.streams`, :mod:`charon.server.openapi`
and :mod:`charon.server.http` (none of them imports the gateway). The layer may import ``charon.core``,
``charon.log`` and the top-level model modules; of ``charon.runtime`` it imports only the engine contract
(``charon.runtime.contract``): engines are used through it alone. It never imports ``charon.state``.
"""
