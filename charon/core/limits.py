"""Admission limits as declared (``Limit``): what a request's bucket and priority are. Pure data, no imports of
the rest of Charon, so the programming model (``@op.function(limit=...)``) may use it; the decisions are
:mod:`charon.core.admission`'s."""

from __future__ import annotations

import math
import re

import msgspec

from charon.core.routing import check_operator_name
from charon.errors import InvalidKey

__all__ = ["Limit", "check_target", "pick"]

_ARG = re.compile(r"arg:(\d{1,3})((?:\.[A-Za-z0-9_-]{1,64}){0,4})")


class Limit(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """An admission limit on a target's requests (see ``docs/internals/admission.md``).

    ``concurrency``: at most this many transactions of one bucket per epoch. ``rate``/``burst``: a token bucket
    per bucket refilled by the epoch's recorded time (``burst`` default ``max(1, rate)``). ``per``: ``"all"``,
    ``"key"`` or ``"arg:<i>[.<field>...]"`` (a key the caller names in its arguments). ``priority``: an integer
    or ``"arg:..."`` (higher first; ties by log order). ``queue``: waiting requests per bucket before
    ``RateLimited``."""

    concurrency: int | None = None
    rate: float | None = None
    burst: float | None = None
    per: str = "all"
    priority: int | str = 0
    queue: int = 1000

    def __post_init__(self) -> None:
        if self.concurrency is None and self.rate is None:
            raise ValueError("a limit needs a concurrency or a rate")
        if self.concurrency is not None and not (type(self.concurrency) is int and self.concurrency >= 1):
            raise ValueError("concurrency must be an integer >= 1")
        for name in ("rate", "burst"):
            v = getattr(self, name)
            if v is not None and not (type(v) in (int, float) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number")
        if self.burst is not None and self.rate is None:
            raise ValueError("burst needs a rate")
        if self.burst is not None and self.burst < 1:
            raise ValueError("burst must be at least 1 (a request takes one token)")
        if self.per not in ("all", "key") and not _ARG.fullmatch(self.per):
            raise ValueError("per must be 'all', 'key' or 'arg:<index>[.<field>...]'")
        p = self.priority
        if not ((type(p) is int and -(2**31) <= p < 2**31) or (type(p) is str and _ARG.fullmatch(p))):
            raise ValueError("priority must be a 32-bit integer or 'arg:<index>[.<field>...]'")
        if not (type(self.queue) is int and 0 <= self.queue <= 1_000_000):
            raise ValueError("queue must be an integer in 0..1000000")

    @property
    def size(self) -> float:
        """The token bucket's size (``burst``, default ``max(1, rate)``)."""
        assert self.rate is not None
        return float(self.burst) if self.burst is not None else max(1.0, float(self.rate))

    def bucket(self, key: str, args: object) -> str:
        """The bucket a request on entity ``key`` with ``args`` (its decoded argument list) falls in."""
        if self.per == "all":
            return ""
        if self.per == "key":
            return key
        v = pick(self.per, args)
        return str(v) if type(v) in (str, int) else ""

    def priority_of(self, args: object) -> int:
        """The request's priority (0 when an ``arg:`` path finds no integer)."""
        p = self.priority
        if type(p) is int:
            return p
        v = pick(str(p), args)
        return v if type(v) is int and -(2**31) <= v < 2**31 else 0


def pick(path: str, args: object) -> object:
    """The value ``arg:<i>.<f>...`` names in ``args`` (None when absent)."""
    m = _ARG.fullmatch(path)
    if m is None or type(args) is not list:
        return None
    i = int(m.group(1))
    if i >= len(args):
        return None
    v: object = args[i]
    for f in m.group(2).split(".")[1:]:
        if type(v) is not dict:
            return None
        v = v.get(f)
    return v


def check_target(target: str) -> str:
    """``target`` if it names an operator (``"account"``) or one of its functions (``"account/withdraw"``; an
    operator name has no ``/``); ``ValueError`` otherwise."""
    if type(target) is not str:
        raise ValueError(f"a limit's target is 'operator' or 'operator/function', got {target!r}")
    op, _, fn = target.partition("/")
    try:
        check_operator_name(op)
    except InvalidKey as exc:
        raise ValueError(f"a limit's target names an invalid operator: {exc}") from None
    if "/" in target and not fn.isidentifier():
        raise ValueError(f"a limit's target is 'operator' or 'operator/function', got {target!r}")
    return target
