"""Charon: transactional stateful functions on Apache Spark (after Styx).

Write operators and ``async def`` functions; every client invocation runs as a serializable,
exactly-once transaction over its whole call graph. This module is the public surface; the layers behind it
are ``charon.core`` (the deterministic core), ``charon.state``, ``charon.log``, ``charon.runtime`` and
``charon.server``.
"""

import logging as _logging

from charon.core.context import Call, Context, Outcome
from charon.core.limits import Limit
from charon.core.promises import promise_value
from charon.core.timers import Timer
from charon.core.workflows import Workflow
from charon.errors import (
    BadArguments,
    CallGraphLimitExceeded,
    CharonError,
    EngineUnavailable,
    IdempotencyConflict,
    IllegalAwait,
    InvalidKey,
    InvocationCancelled,
    InvocationTimeout,
    LogUnavailable,
    NonDeterministicFunction,
    NotMigratable,
    Overloaded,
    PayloadTooLarge,
    PromiseCancelled,
    PromiseConflict,
    PromiseFailed,
    PromiseRejected,
    PromiseTimedOut,
    Quarantined,
    RateLimited,
    SerializationError,
    TransactionAborted,
    UnawaitedCall,
    UndeclaredPortal,
    UnknownEffect,
    UnknownFunction,
    UnknownOperator,
    UnknownPromise,
    UnknownSchedule,
    UnknownWorkflow,
    ValueTooLarge,
    VersionInUse,
    VersionUnavailable,
    WorkflowExists,
    WorkflowTooLong,
)
from charon.messages import Reply, Request
from charon.operator import Application, Function, Operator
from charon.runtime.deployment import Deployment
from charon.runtime.node.inprocess import InProcessRuntime

# A library logs through ``charon.*`` loggers and leaves their output to the application: without a logging setup
# (``charon run`` has one, ``charon.server.logs.setup_logging``) an abort's WARNING is not printed on stderr.
_logging.getLogger("charon").addHandler(_logging.NullHandler())

__all__ = [
    "Application",
    "BadArguments",
    "Call",
    "CallGraphLimitExceeded",
    "CharonError",
    "Context",
    "Deployment",
    "EngineUnavailable",
    "Function",
    "IdempotencyConflict",
    "IllegalAwait",
    "InProcessRuntime",
    "InvalidKey",
    "InvocationTimeout",
    "Limit",
    "LogUnavailable",
    "NonDeterministicFunction",
    "NotMigratable",
    "Operator",
    "Outcome",
    "InvocationCancelled",
    "Overloaded",
    "PayloadTooLarge",
    "PromiseCancelled",
    "PromiseConflict",
    "PromiseFailed",
    "PromiseRejected",
    "PromiseTimedOut",
    "Quarantined",
    "RateLimited",
    "Reply",
    "Request",
    "SerializationError",
    "Timer",
    "TransactionAborted",
    "UnawaitedCall",
    "UndeclaredPortal",
    "UnknownEffect",
    "UnknownFunction",
    "UnknownOperator",
    "UnknownPromise",
    "UnknownSchedule",
    "UnknownWorkflow",
    "ValueTooLarge",
    "VersionInUse",
    "VersionUnavailable",
    "Workflow",
    "WorkflowExists",
    "WorkflowTooLong",
    "promise_value",
]
