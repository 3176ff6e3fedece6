"""Charon: transactional stateful functions on Apache Spark (after Styx).

Write operators and ``async def`` functions; every client invocation runs as a serializable,
exactly-once transaction over its whole call graph.
"""

from charon.context import Context
from charon.errors import (
    BadArguments,
    CallGraphLimitExceeded,
    CharonError,
    SerializationError,
    TransactionAborted,
    UnknownFunction,
    UnknownOperator,
)
from charon.inprocess import InProcessRuntime
from charon.messages import Reply, Request
from charon.operator import Application, Function, Operator

__all__ = [
    "Application",
    "BadArguments",
    "CallGraphLimitExceeded",
    "CharonError",
    "Context",
    "Function",
    "InProcessRuntime",
    "Operator",
    "Reply",
    "Request",
    "SerializationError",
    "TransactionAborted",
    "UnknownFunction",
    "UnknownOperator",
]
