"""A schedule's spec (``@app.schedule``, ``POST /schedules``): checked once, where it is declared or created.

See :mod:`charon.core.schedules` for what a schedule does; cron expressions are :mod:`charon.core.cron`'s.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from charon import serde
from charon.core import cron
from charon.core.routing import check_key
from charon.errors import BadArguments, ValueTooLarge

__all__ = ["MAX_ARGS_BYTES", "MAX_CATCH_UP", "check_name", "schedule_spec", "spec_hash"]

MAX_CATCH_UP = 100  # missed slots a tick may fire besides the current one
MAX_ARGS_BYTES = 64 << 10  # a schedule's extra arguments, encoded
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")


def check_name(name: object) -> str:
    """A schedule name (1-100 characters of A-Z a-z 0-9 _ . : -); BadArguments otherwise."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadArguments(f"a schedule name is 1-100 characters of A-Z a-z 0-9 _ . : -, got {name!r}")
    return name


def schedule_spec(app: Any, name: object, expr: object, operator: object, key: object, function: object,
                  args: object = (), catch_up: object = 0, *, public_only: bool = False) -> dict[str, Any]:
    """A checked schedule spec (typed errors otherwise): the target exists (a public function when
    ``public_only``: a schedule created at run time calls only what clients may call) and takes
    ``(firing, *args)``."""
    check_name(name)
    try:
        cron.check(expr)
    except ValueError as exc:
        raise BadArguments(str(exc)) from None
    if not isinstance(operator, str) or not isinstance(function, str) or not isinstance(key, str):
        raise BadArguments("operator, key and function are strings")
    fn = app.exposed(operator, function) if public_only else app.resolve(operator, function)
    if not isinstance(args, list | tuple):
        raise BadArguments("args must be a list")
    fn.check_args([{}, *args])
    if (n := len(serde.encode_value(list(args)))) > MAX_ARGS_BYTES:
        raise ValueTooLarge(f"a schedule's args of {n} bytes exceed the maximum of {MAX_ARGS_BYTES}")
    if type(catch_up) is not int or not 0 <= catch_up <= MAX_CATCH_UP:
        raise BadArguments(f"catch_up must be an integer 0..{MAX_CATCH_UP}, got {catch_up!r}")
    check_key(key)
    return {"name": name, "cron": expr, "operator": fn.operator.name, "key": key, "function": fn.name,
            "args": list(args), "catch_up": catch_up}


def spec_hash(spec: dict[str, Any]) -> str:
    """A short hash of a spec (what a declaration's request id names)."""
    return hashlib.blake2b(serde.encode_value(spec), digest_size=8).hexdigest()
