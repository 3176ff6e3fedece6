"""Ack shares: exact dyadic rationals as ``(n, e)`` integer pairs meaning ``n / 2**e`` (the one owner of their rules).

A transaction's root starts with :data:`ONE`. An invocation that sends or calls ``k`` others splits its
share: each of the ``k`` gets ``share / 2**m`` with ``2**m >= k`` (``m = (k - 1).bit_length()``), and what is
left (``2**m - k`` parts) stays with the invocation (:func:`split`). Shares travel back with replies and
terminal acks and are summed by the coordinator (:func:`add`); the call graph is complete when its root has
finished and the sum is exactly one (:func:`is_one`). Only integer shifts and additions are used (no
``Fraction`` normalisation, no floats), so the arithmetic is exact for any fan-out and depth, and a part is
never zero (a zero part could let the sum reach one while that invocation still runs).
"""

from __future__ import annotations

Share = tuple[int, int]

ONE: Share = (1, 0)
ZERO: Share = (0, 0)


def split(share: Share, k: int) -> tuple[Share, Share]:
    """Split ``share`` into ``k`` equal non-zero parts and a remainder: ``(part, rest)``, ``k·part + rest == share``.

    ``rest`` is ZERO when ``k`` is a power of two."""
    n, e = share
    m = (k - 1).bit_length()
    e += m
    r = (1 << m) - k
    return (n, e), ((n * r, e) if r else ZERO)


def add(a: Share, b: Share) -> Share:
    """The exact sum of two shares (normalised while the numerator is even, to keep the integers small)."""
    an, ae = a
    bn, be = b
    if ae == be:
        n, e = an + bn, ae
    elif ae < be:
        n, e = (an << (be - ae)) + bn, be
    else:
        n, e = an + (bn << (ae - be)), ae
    while e and not n & 1 and n:
        n >>= 1
        e -= 1
    return (n, e)


def is_one(share: Share | None) -> bool:
    """Whether ``share`` is exactly one."""
    return share is not None and share[0] == 1 << share[1]


def is_zero(share: Share) -> bool:
    """Whether ``share`` is exactly zero."""
    return not share[0]


def value(share: Share) -> float:
    """The share as a float (for messages and debugging only; never used to decide completion)."""
    return share[0] / (1 << share[1])
