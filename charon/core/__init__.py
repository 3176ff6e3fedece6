"""The deterministic core: per-request context and journal, partition execution, the epoch coordinator,
the sequencer, key routing, and schedules (their specs and cron expressions). Pure logic, no I/O of its own: it
may import the top-level model modules (errors, serde, messages, operator) and the store protocol
:mod:`charon.state.store`, and nothing from ``charon.runtime``, ``charon.log``, ``charon.server`` or any other
``charon.state`` module.
"""
