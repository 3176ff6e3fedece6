"""The traceback of an exception a function raised, for the invocation inspector: bounded, the user's frames only.

Observation data: it never enters a reply's deterministic fields, the input log or state (file paths differ between
machines); the partition reports it beside its output (``RoundOutput.trace``) when the coordinator asks.
"""

from __future__ import annotations

import os
import traceback

#: the most bytes of one traceback's text (UTF-8); the innermost frames, where it was raised, are the ones kept
MAX_TRACEBACK_BYTES = 16 * 1024
_ENGINE_DIR = os.path.dirname(os.path.abspath(__file__))  # charon/core: the engine's frames are left out


def format_traceback(exc: BaseException, limit: int = MAX_TRACEBACK_BYTES) -> str:
    """``exc``'s traceback as Python prints it, without the engine's frames (the user's code first), at most
    ``limit`` bytes: when longer, the outer frames are dropped (a line says how many)."""
    try:
        te = traceback.TracebackException.from_exception(exc, capture_locals=False)
        frames = [f for f in te.stack if not (f.filename or "").startswith(_ENGINE_DIR)]
        if not frames:  # raised by the engine itself (a limit, a bad value): keep its frames
            frames = list(te.stack)
        te.stack = traceback.StackSummary.from_list(frames)
        head = "Traceback (most recent call last):\n"
        body = list(te.stack.format())
        tail = "".join(te.format_exception_only())
        kept: list[str] = []
        size = len(head.encode()) + len(tail.encode())
        for part in reversed(body):  # innermost first, while it fits
            n = len(part.encode())
            if size + n > limit - 64:
                break
            kept.append(part)
            size += n
        dropped = len(body) - len(kept)
        note = f"  ... {dropped} outer frame(s) left out ...\n" if dropped else ""
        text = head + note + "".join(reversed(kept)) + tail
        raw = text.encode()
        return text if len(raw) <= limit else raw[-limit:].decode(errors="ignore")
    except Exception as err:  # noqa: BLE001 - observation must never fail the transaction's abort
        return f"(traceback unavailable: {type(err).__name__})"
