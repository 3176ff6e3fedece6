"""Partition state: the store protocol and in-memory store (:mod:`charon.state.store`), the LMDB store on
executors and the atomic on-disk layout helpers (:mod:`charon.state.durable`). The bottom layer: it imports
only other ``charon.state`` modules and the top-level model modules (errors, serde, messages), never
``charon.core``, ``charon.runtime``, ``charon.log`` or ``charon.server``.
"""
