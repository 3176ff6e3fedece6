"""Engines that drive the core, and what they share: the durable node (:mod:`charon.runtime.node`), the Spark data
plane (:mod:`charon.runtime.spark`), the guards every engine runs (:mod:`charon.runtime.guard`: budgets,
interrupts, quarantine, verdicts) and the engine side of the control surface (:mod:`charon.runtime.control`).

At the root: the engine contract (``contract.py``), the one place engines are built (``factory.py``), a gateway's
runtime when the engine runs elsewhere (``remote.py``), effects, replies, schedules, deployments of several
applications and their wiring, and fault injection. A runtime may import ``charon.core``, ``charon.storage``,
``charon.state``, ``charon.log`` and the top-level model modules; never ``charon.server`` (the gateway talks to a
runtime through its protocol, not the other way round). Inside the layer, in tiers: the contract; the guards;
the shared services (control, effects, replies, schedules, wiring, faults); the engines, the remote runtime and
deployments, which never import each other; the factory, which builds any engine (``RUNTIME_TIERS`` in
``tests/package/test_layers.py``).
"""
