"""Engines that drive the core: the in-process runtime, the durable single-node engine
(:mod:`charon.runtime.node`) and the Spark data plane (:mod:`charon.runtime.spark`). A runtime may import
``charon.core``, ``charon.state``, ``charon.log`` and the top-level model modules; never ``charon.server``
(the gateway talks to a runtime through its protocol, not the other way round).
"""
