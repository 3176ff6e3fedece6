"""The fast paths of argument and key checks (Function.check_args' exact-signature set, check_key's ASCII test)
accept and reject exactly what the full checks do, with the same typed error."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from charon import Context, Operator
from charon.core import routing
from charon.errors import CharonError

op = Operator("fastchecks")


@op.function
async def scalars(ctx: Context, a: int, b: float, c: str = "", d: bool = False, e: bytes = b"") -> int:
    """Every scalar hint, some optional."""
    return 0


@op.function
async def two(ctx: Context, x: float, y: int) -> int:
    """Two scalars."""
    return 0


VALUES = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=3), st.booleans(),
                   st.binary(max_size=3), st.none(), st.lists(st.integers(), max_size=2),
                   st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))


def _outcome(fn, args) -> str | None:  # noqa: ANN001
    try:
        fn.check_args(args)
    except CharonError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@settings(max_examples=3000, deadline=None)
@given(name=st.sampled_from(["scalars", "two"]), args=st.lists(VALUES, max_size=6), as_tuple=st.booleans())
def test_check_args_fast_path_equals_full_check(name, args, as_tuple):
    fn = op.functions[name]
    assert fn._sigs is not None, "the fast path is on for scalar hints"
    slow = copy.copy(fn)
    slow._sigs = None
    a = tuple(args) if as_tuple else args
    assert _outcome(fn, a) == _outcome(slow, a)


def _key_outcome(check, key) -> str | None:  # noqa: ANN001
    try:
        assert check(key) is key
    except CharonError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@settings(max_examples=3000, deadline=None)
@given(key=st.one_of(st.text(max_size=300), st.text(alphabet=st.characters(max_codepoint=127), max_size=300),
                     st.just(""), st.just("a\0b"), st.just("x" * 256), st.just("x" * 257), st.just("\ud800"),
                     st.integers(), st.none(), st.binary(max_size=4)))
def test_check_key_fast_path_equals_full_check(key):
    assert _key_outcome(routing.check_key, key) == _key_outcome(
        lambda k: routing._check("entity key", k, 1, routing.MAX_KEY_BYTES), key)
