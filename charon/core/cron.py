"""Cron expressions for schedules (``@app.schedule``), through ``croniter``: the one place that reads them.

Five fields (minute hour day-of-month month day-of-week), or six with **seconds first** (``*/5 * * * * *``:
every five seconds). Times are seconds since the Unix epoch, read in UTC. Pure functions of their arguments:
a replayed epoch computes the same slots.
"""

from __future__ import annotations

import math

from croniter import croniter

__all__ = ["MAX_EXPRESSION_CHARS", "check", "count_between", "next_after", "latest_at_or_before"]

MAX_EXPRESSION_CHARS = 200


def _seconds_first(expr: str) -> bool:
    return len(expr.split()) == 6


def check(expr: object) -> str:
    """``expr`` if it is a valid cron expression (5 fields, or 6 with seconds first); ValueError otherwise."""
    if not isinstance(expr, str) or not 0 < len(expr) <= MAX_EXPRESSION_CHARS:
        raise ValueError(f"a cron expression is a string of 1..{MAX_EXPRESSION_CHARS} characters, got {expr!r}")
    fields = len(expr.split())
    if fields not in (5, 6) or not croniter.is_valid(expr, second_at_beginning=fields == 6):
        raise ValueError(f"not a cron expression of 5 fields (or 6, seconds first): {expr!r}")
    return expr


def next_after(expr: str, t: float) -> float:
    """The first slot of ``expr`` strictly after ``t`` (``inf`` if it has none, e.g. a 30th of February)."""
    try:
        return float(croniter(expr, t, second_at_beginning=_seconds_first(expr)).get_next(float))
    except (ValueError, KeyError, OverflowError):  # croniter gives up on expressions without a next date
        return math.inf


def latest_at_or_before(expr: str, t: float) -> float:
    """The last slot of ``expr`` at or before ``t`` (``-inf`` if none)."""
    try:
        prev = float(croniter(expr, t + 1e-6, second_at_beginning=_seconds_first(expr)).get_prev(float))
    except (ValueError, KeyError, OverflowError):
        return -math.inf
    return prev if prev <= t else -math.inf


def count_between(expr: str, first: float, end: float, cap: int) -> int:
    """How many slots of ``expr`` lie in ``[first, end)``, counting at most ``cap`` (one iterator: ~0.1 ms each)."""
    if not first < end:
        return 0
    try:
        it = croniter(expr, first - 1e-3, second_at_beginning=_seconds_first(expr))
        n = 0
        while n < cap and float(it.get_next(float)) < end:
            n += 1
        return n
    except (ValueError, KeyError, OverflowError):
        return 0
