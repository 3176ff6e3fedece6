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


def format_traceback(exc: BaseException, limit: int = MAX_TRACEBACK_BYTES) -> str:
    """``exc``'s traceback as Python prints it (without the column carets), without the engine's frames (the user's
    code first), at most ``limit`` bytes: when longer, the outer frames are dropped (a line says how many)."""
    try:
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
    except Exception as err:  # noqa: BLE001 - observation must never fail the transaction's abort
        return f"(traceback unavailable: {type(err).__name__})"
