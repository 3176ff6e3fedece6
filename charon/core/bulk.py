"""Bulk operations' filters (issue 34 item 5): which queued invocations, pending promises, schedules or parked
effects one bulk call acts on.

A :class:`Where` is pure data, checked once where it enters (the gateway answers a bad one 400 before anything
reaches the log) and matched wherever the item's fate is decided:

* queued invocations (held by admission control) are matched **in the epoch** that takes the cancel
  (:meth:`charon.core.epoch.EpochCoordinator` through :func:`match_request`), on the request's logged fields and
  its logged append time, so a replay cancels the same ones;
* promises and schedules are matched on the gateway over a page of their records, only to choose which ones to
  send the single-item transaction (``cancel``, ``pause``, ``resume``, ``delete``): whether each one is cancelled
  is that transaction's decision (a promise settled meanwhile answers ``PromiseConflict`` and stays as it is);
* parked effects are matched on their store's rows, then retried or abandoned one by one (the single-item path).

Fields (each optional; all given must match): ``operator`` and ``function`` (the invoked function; a promise's
waiting entity and continuation; a schedule's target; an effect's handler, with ``operator`` its continuation's
operator), ``key_prefix`` (the invoked entity's key; the waiting entity's key; the schedule's name; the
continuation entity's key), ``error_type`` (effects only: the type their last error names), ``since`` and
``until`` (Unix seconds, inclusive: when the request was appended; when the promise, schedule or effect was
created).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from charon.messages import Request

__all__ = ["BULK_ACTIONS", "MAX_BULK_LIMIT", "Where", "match_request", "parse_where"]

#: the resources a bulk call acts on, and what it may do to each
BULK_ACTIONS: dict[str, tuple[str, ...]] = {
    "invocations": ("cancel",),
    "promises": ("cancel",),
    "schedules": ("pause", "resume", "delete"),
    "effects": ("retry", "abandon"),
}
#: most items one bulk call looks at (the page of the continuation cursor)
MAX_BULK_LIMIT = 1000
MAX_TEXT = 256


class Where(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A bulk operation's filter (see the module docstring); empty: every item of the resource."""

    operator: str | None = None
    function: str | None = None
    key_prefix: str | None = None
    error_type: str | None = None
    since: float | None = None
    until: float | None = None

    def time_ok(self, t: float) -> bool:
        return (self.since is None or t >= self.since) and (self.until is None or t <= self.until)

    def match(self, operator: str, function: str, key: str, at: float, error_type: str | None = None) -> bool:
        """Whether an item with these fields matches."""
        return ((self.operator is None or operator == self.operator)
                and (self.function is None or function == self.function)
                and (self.key_prefix is None or key.startswith(self.key_prefix))
                and (self.error_type is None or error_type == self.error_type)
                and self.time_ok(at))

    def doc(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


def parse_where(doc: object, resource: str) -> Where:
    """The :class:`Where` of a JSON object for ``resource``; ``ValueError`` naming what is wrong otherwise."""
    if doc is None:
        doc = {}
    if type(doc) is not dict:
        raise ValueError("where must be an object of operator, function, key_prefix, error_type, since, until")
    try:
        w = msgspec.convert(doc, Where)
    except msgspec.ValidationError as exc:
        raise ValueError(f"where: {exc}") from None
    for name in ("operator", "function", "key_prefix", "error_type"):
        v = getattr(w, name)
        if v is not None and not (0 < len(v) <= MAX_TEXT and "\0" not in v):
            raise ValueError(f"where.{name} must be a non-empty string of at most {MAX_TEXT} characters")
    for name in ("since", "until"):
        v = getattr(w, name)
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"where.{name} must be Unix seconds (a finite number >= 0)")
    if w.since is not None and w.until is not None and w.since > w.until:
        raise ValueError("where.since is after where.until: nothing could match")
    if w.error_type is not None and resource != "effects":
        raise ValueError("where.error_type filters parked effects only (invocations, promises and schedules that "
                         "wait have no error)")
    return w


def match_request(where: Where, req: Request) -> bool:
    """Whether a queued invocation matches (its logged fields and append time only: replay-exact)."""
    return where.match(req.operator, req.function, req.key, req.ts)
