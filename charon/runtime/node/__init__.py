"""The durable node: the in-process runtime (:mod:`~charon.runtime.node.inprocess`), its face through the engine
contract (:mod:`~charon.runtime.node.inprocess_engine`) and what makes it durable on one machine
(:mod:`~charon.runtime.node.storage`)."""
