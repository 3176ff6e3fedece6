"""The watchdog's looks at the engine thread never hold that thread's frames across a point where it can run.

Walking another thread's frames (``f_back``) while it runs can crash CPython 3.11 (a frame popped or a coroutine
suspended between two reads: CI saw a segfault in exactly that walk). So every look is generated straight-line
code with no call and no backward jump (no eval-breaker check), and a stress run of looks against a thread that
churns coroutines must end cleanly.
"""

from __future__ import annotations

import dis
import subprocess
import sys
import textwrap

from charon.runtime.guard import interrupts


def _checks(fn: object) -> list[str]:
    """The instructions of ``fn`` after which CPython may switch threads or run Python code."""
    out = []
    for ins in dis.get_instructions(fn):  # type: ignore[arg-type]
        if ins.opname.startswith(("CALL", "JUMP_BACKWARD", "PRECALL", "YIELD", "SEND")):
            out.append(f"{ins.opname} at {ins.offset}")
    return out


def test_the_frame_walk_has_no_check_between_its_reads() -> None:
    assert _checks(interrupts._files_of_unguarded) == []


def test_the_window_calls_only_to_deliver_as_its_last_act() -> None:
    calls = _checks(interrupts._window)
    assert calls and all(c.split()[0] in ("CALL", "PRECALL") for c in calls)
    ins = list(dis.get_instructions(interrupts._window))
    last_call = max(i for i, x in enumerate(ins) if x.opname == "CALL")
    # after the one call (set_exc) only its result is dropped and 1 returned
    assert [x.opname for x in ins[last_call + 1:]] == ["POP_TOP", "LOAD_CONST", "RETURN_VALUE"]
    assert len([x for x in ins if x.opname == "CALL"]) == 1


def test_doom_marks_with_no_check() -> None:
    assert _checks(interrupts.doom) == []


def test_files_of_reads_the_engine_threads_frames() -> None:
    import threading

    handle = interrupts.ThreadHandle()
    ready, done = threading.Event(), threading.Event()

    def inner() -> None:
        ready.set()
        done.wait(10)

    def run() -> None:
        handle.attach()
        try:
            inner()
        finally:
            handle.detach()

    t = threading.Thread(target=run)
    t.start()
    ready.wait(10)
    try:
        names = interrupts._files_of(handle)
        assert __file__ in names  # inner/run are this file's
        assert names.count(__file__) >= 2
    finally:
        done.set()
        t.join(10)
    assert interrupts._files_of(handle) == ()  # detached: nothing to read


_STRESS = textwrap.dedent("""
    import random, sys, threading, time
    from charon.runtime.guard import interrupts

    sys.setswitchinterval(1e-6)
    stop = False
    handle = interrupts.ThreadHandle()

    async def leaf(n):
        if n % 7 == 0:
            raise ValueError(n)
        return sum(range(30))

    async def mid(n, d):
        if d == 0:
            return await leaf(n)
        try:
            return await mid(n, d - 1)
        except ValueError:
            return -1

    def churn():
        handle.attach()
        n = 0
        try:
            while not stop:
                n += 1
                c = mid(n, random.randint(0, 40))
                try:
                    c.send(None)
                except (StopIteration, ValueError):
                    pass
                if n % 5 == 0:
                    c2 = mid(n, 3)
                    try:
                        c2.throw(KeyError("x"))
                    except KeyError:
                        pass
        finally:
            handle.detach()

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    user = interrupts.UserCode()
    end = time.monotonic() + float(sys.argv[1])
    looks = 0
    while time.monotonic() < end:
        user.learn(handle)
        looks += 1
    stop = True
    t.join(10)
    print("looks", looks)
""")


def test_looks_against_a_churning_thread_never_crash(tmp_path) -> None:
    script = tmp_path / "stress.py"
    script.write_text(_STRESS)
    p = subprocess.run([sys.executable, str(script), "4"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert int(p.stdout.split()[-1]) > 1000
