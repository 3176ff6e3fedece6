"""Object storage for everything durable that is not the log: one interface (:mod:`charon.storage.contract`) over a
local directory (``file://``, :mod:`charon.storage.files`) or an S3 bucket (``s3://bucket/prefix``,
:mod:`charon.storage.s3`), opened by URL (:mod:`charon.storage.location`). The lowest layer with ``core``: it
imports only other ``charon.storage`` modules and the top-level model modules, never ``charon.state``,
``charon.core``, ``charon.log``, ``charon.runtime`` or ``charon.server``.
"""
