"""The traceback of an exception a function raised, for the invocation inspector: bounded, the user's frames only.

Observation data: it never enters a reply's deterministic fields, the input log or state (file paths differ between
machines); the partition reports it beside its output (``RoundOutput.trace``) when the coordinator asks.
"""

from __future__ import annotations

import linecache
import os
import traceback

#: the most bytes of one traceback's text (UTF-8); the innermost frames, where it was raised, are the ones kept
MAX_TRACEBACK_BYTES = 16 * 1024
_ENGINE_DIR = os.path.dirname(os.path.abspath(__file__))  # charon/core: the engine's frames are left out


#: at most this many exceptions of a chain (``raise ... from``, or raised while handling another) are shown
MAX_CHAIN = 5
_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"
_MIN_BLOCK = 256  # bytes left for an earlier exception of the chain below which it is left out


def format_traceback(exc: BaseException, limit: int = MAX_TRACEBACK_BYTES) -> str:
    """``exc``'s traceback as Python prints it (without the column carets), without the engine's frames (the user's
    code first), at most ``limit`` bytes: when longer, the outer frames are dropped (a line says how many). Earlier
    exceptions of its chain come first, as Python prints them, while they fit (``exc``'s own block is kept)."""
    try:
        chain, seps = [exc], []  # seps[i]: printed between chain[i + 1]'s block and chain[i]'s
        seen = {id(exc)}
        more = False  # earlier exceptions beyond MAX_CHAIN
        e = exc
        while True:
            prev, sep = (e.__cause__, _CAUSE) if e.__cause__ is not None else (
                None if e.__suppress_context__ else e.__context__, _CONTEXT)
            if prev is None or id(prev) in seen:
                break
            if len(chain) == MAX_CHAIN:
                more = True
                break
            chain.append(prev)
            seps.append(sep)
            seen.add(id(prev))
            e = prev
        text = _one(exc, limit)
        left = limit - len(text.encode())
        shown = 1
        for earlier, sep in zip(chain[1:], seps, strict=True):
            budget = left - len(sep.encode())
            if budget < _MIN_BLOCK:
                more = True
                break
            block = _one(earlier, budget)
            text = block + sep + text
            left -= len(block.encode()) + len(sep.encode())
            shown += 1
        if more and left >= 64:
            text = "(earlier exceptions of the chain left out)\n" + text
        return text
    except Exception as err:  # noqa: BLE001 - observation must never fail the transaction's abort
        return f"(traceback unavailable: {type(err).__name__})"


def _one(exc: BaseException, limit: int) -> str:
    """One exception's block: its frames (innermost kept) and its last line, at most ``limit`` bytes."""
    frames = [(f.f_code.co_filename, n, f.f_code.co_name) for f, n in traceback.walk_tb(exc.__traceback__)]
    user = [fr for fr in frames if not fr[0].startswith(_ENGINE_DIR)]
    head = "Traceback (most recent call last):\n"
    tail = "".join(traceback.format_exception_only(type(exc), exc))
    size = len(head.encode()) + len(tail.encode()) + 64
    kept: list[str] = []
    for filename, lineno, name in reversed(user or frames):  # innermost first, while it fits
        line = linecache.getline(filename, lineno).strip()
        part = f'  File "{filename}", line {lineno}, in {name}\n' + (f"    {line}\n" if line else "")
        n = len(part.encode())
        if size + n > limit:
            break
        kept.append(part)
        size += n
    dropped = len(user or frames) - len(kept)
    note = f"  ... {dropped} outer frame(s) left out ...\n" if dropped else ""
    text = head + note + "".join(reversed(kept)) + tail
    raw = text.encode()
    return text if len(raw) <= limit else raw[-limit:].decode(errors="ignore")
