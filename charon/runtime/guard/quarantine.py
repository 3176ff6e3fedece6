"""Quarantine: a transaction that kills the process running it (``os._exit``, a crash in a C extension, memory
exhaustion) must not keep a durable node in a crash loop.

The node replays its logged epochs at every restart, so such a transaction would kill every restart. Recovery
therefore counts its attempts per epoch (``recovery.json`` in the data directory, written before each replayed
epoch runs): when the epoch about to be replayed already killed an earlier recovery, it is *probed* before it
runs. A forked child runs the epoch on a copy of the state while reporting, through a pipe, the start of every
invocation step (which transaction's code runs, and its function's time budget) and its end. The probe blames only
a step that started and did not end: the child died in it, or the step ran past ten times its own budget
(``PROBE_FACTOR``, plus ``STEP_GRACE_S``; the child is killed then). That transaction gets a ``Quarantined``
verdict (recorded before the epoch replays, see :mod:`charon.runtime.guard.verdicts`) and the probe repeats until the
epoch completes in the child.
Then the epoch replays for real, the quarantined transactions refused up front; their clients get the typed
``Quarantined`` reply and ``charon dead-letters`` lists them. The decision is taken before anything depends on it,
so it is replay-exact like any verdict.

A child that dies with no step running (after its last step ended: in the engine's own work), or stays outside any
step for the probe's deadline, blames nobody: no transaction is quarantined, and recovery exits (75, one ``FATAL``
line naming the epoch) for the supervisor instead of replaying an epoch known to kill the process. The epoch as a
whole has no deadline: an epoch of many steps, each within its budget, is never cut short.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, NoReturn

from charon.core.epoch import EpochCoordinator, Verdict
from charon.core.partition import Frame, Outgoing, PartitionUnit
from charon.runtime.guard.verdicts import VerdictBook, letter
from charon.storage.files import write_file_atomic

FILE = "recovery.json"
KEEP_MARKS = 16  # the recent epochs whose reply marks are kept (a rerun is of the last few unrecorded ones)
MAX_PROBES = 8  # transactions quarantined in one epoch at most (then the replay runs as it is)


class RecoveryAttempts:
    """Which epoch recovery was replaying when the process last died, and how many times."""

    def __init__(self, data_dir: str, write: Callable[[str, bytes], None] = write_file_atomic,
                 remove: Callable[[str], None] | None = None) -> None:
        self.path = os.path.join(data_dir, FILE)
        self._write, self._remove = write, remove  # e.g. also on object storage (the Spark checkpoint's files)
        self.epoch, self.attempts = -1, 0
        # per recent epoch: the output log's last seq when it first started (every reply it wrote comes after)
        self.reply_marks: dict[int, int] = {}
        try:
            with open(self.path) as f:
                doc = json.load(f)
            self.epoch, self.attempts = int(doc["epoch"]), int(doc["attempts"])
            self.reply_marks = {int(e): int(s) for e, s in doc.get("marks", {}).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass

    def failed_before(self, epoch: int) -> bool:
        """Whether an earlier recovery died replaying ``epoch``."""
        return self.epoch == epoch and self.attempts > 0

    def starting(self, epoch: int, reply_mark: int | None = None,
                 later: Callable[[Callable[[], None]], bool] | None = None) -> None:
        """Recovery is about to replay ``epoch``: count the attempt (durably: before it runs, or with ``later``
        before anything depends on it; a rerun is always counted before it runs). The epochs before
        the one an earlier recovery died in completed then: they are not counted (nor written). ``reply_mark``:
        the output log's last seq now, kept for the epoch's first start only (see :meth:`reply_mark`).
        ``later``: hands the file's write to a writer that makes it durable before anything depends on the epoch
        (the resident sequencer's, beside the epoch's bound: off the epoch's path), returning False when it
        cannot (then it is written here, before the epoch runs)."""
        if epoch < self.epoch:
            return
        n = self.attempts + 1 if epoch == self.epoch else 1
        marks = dict(self.reply_marks)
        if reply_mark is not None:
            marks.setdefault(epoch, reply_mark)
            marks = {e: m for e, m in marks.items() if epoch - KEEP_MARKS < e <= epoch}
        doc: dict[str, Any] = {"epoch": epoch, "attempts": n}
        if marks:
            doc["marks"] = {str(e): m for e, m in sorted(marks.items())}
        data = json.dumps(doc).encode()
        self.epoch, self.attempts, self.reply_marks = epoch, n, marks
        if later is None or not later(lambda: self._write(self.path, data)):
            self._write(self.path, data)

    def reply_mark(self, epoch: int) -> int | None:
        """The output log's last seq when ``epoch`` first started: every reply an earlier run of it wrote (a fired
        timer's too, whose request is in no log) comes after it. None when not kept (too old, or never given)."""
        return self.reply_marks.get(epoch)

    def done(self) -> None:
        """Recovery completed: nothing to count any more."""
        if self._remove is not None:
            self._remove(self.path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.epoch, self.attempts = -1, 0


class Culprit(NamedTuple):
    """What a probing child was running when it died: the transaction and the function."""

    request_id: str
    root: str  # the transaction's "operator.function"
    operator: str
    function: str
    key: str
    fallback: bool


STEP_GRACE_S = 1.0  # a probed step may run this long past PROBE_FACTOR x its budget (a forked child on a busy host)
#: a probed step is blamed only past this many times its budget: it then cannot have completed within its budget in
#: the epoch's first run (functions are deterministic; the margin is for a slower host), so its transaction never
#: answered and a new verdict contradicts no reply (docs/internals/verdicts.md, rule 5)
PROBE_FACTOR = 10.0
EXIT_CODE = 75  # EX_TEMPFAIL: as the watchdog's give-up (charon.cli.exitcodes.ExitCode.STUCK)
_events = logging.getLogger("charon.engine")


class Inconclusive(NamedTuple):
    """A probing child that died (or hung) outside any step: no transaction can be blamed."""

    why: str


def probe(run_epoch: Callable[[], Any], coordinator: Callable[[], EpochCoordinator], deadline_s: float,
          default_budget: float = 5.0) -> Culprit | Inconclusive | None:
    """Run ``run_epoch()`` in a forked child. The child reports every invocation step when it starts (what runs,
    and its function's time budget) and when it ends. None if the epoch completed; the :class:`Culprit` whose step
    started and did not end when the child died, or whose step ran past its own budget (the child is killed then);
    :class:`Inconclusive` when the child died with no step running (after its last step ended: engine code), or
    stayed outside any step for ``deadline_s`` (it is killed then): no transaction is to blame for that."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report every invocation step's start and end, then run the epoch
        os.close(r)
        _report_steps(coordinator(), w, default_budget)
        code = 0
        try:
            run_epoch()
        except BaseException:  # noqa: BLE001 - the child's outcome is its exit code
            code = 1
        os._exit(code)
    os.close(w)
    running: list[tuple[list[Any], float]] = []  # the steps started and not ended: (report, its deadline)
    buf = b""
    idle_until = time.monotonic() + deadline_s  # outside any step: the engine's own work
    overran: list[Any] | None = None
    idle_killed = False
    status = 0
    try:
        while True:
            now = time.monotonic()
            end = running[-1][1] if running else idle_until
            if now >= end:
                os.kill(pid, signal.SIGKILL)
                if running:
                    overran = running[-1][0]
                else:
                    idle_killed = True
                break
            poller = select.poll()  # (not select: any descriptor number)
            poller.register(r, select.POLLIN)
            if poller.poll(min(end - now, 0.5) * 1000):
                chunk = os.read(r, 65536)
                if not chunk:
                    break  # the child closed the pipe: exited
                buf += chunk
                while len(buf) >= 4:
                    (n,) = struct.unpack(">I", buf[:4])
                    if len(buf) < 4 + n:
                        break  # a report cut short by the child's death: its step had not started
                    msg, buf = buf[4:4 + n], buf[4 + n:]
                    now = time.monotonic()
                    if msg == b"E":
                        if running:
                            running.pop()
                        idle_until = now + deadline_s
                    else:
                        doc = json.loads(msg)
                        running.append((doc[:6], now + PROBE_FACTOR * float(doc[6]) + STEP_GRACE_S))
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    if overran is not None:
        return Culprit(*overran)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return None
    if running:
        return Culprit(*running[-1][0])
    if idle_killed:
        return Inconclusive(f"its probing child ran no function for {deadline_s:.0f} s and was killed")
    how = (f"exited with {os.WEXITSTATUS(status)}" if os.WIFEXITED(status) else
           f"was killed by signal {os.WTERMSIG(status)}")
    return Inconclusive(f"its probing child {how} with no function running")


def _report_steps(coord: EpochCoordinator, fd: int, default_budget: float) -> None:
    """In the probing child only: every unit writes what it is about to run (and the function's budget) to ``fd``
    before each step, and ``E`` after it (the class is patched: this process ends with the probe)."""
    from charon.runtime.guard.watchdog import budget_of

    run, replay = PartitionUnit._run, PartitionUnit._replay_cached

    def send(data: bytes) -> None:
        os.write(fd, struct.pack(">I", len(data)) + data)

    def started(unit: PartitionUnit, tid: int, frames: list[Any], fallback: bool) -> bool:
        req = coord.current.requests.get(tid) if coord.current is not None else None
        if req is None:
            return False
        f = frames[0]
        budget = sum(budget_of(unit, fr, default_budget) for fr in frames)
        send(json.dumps([req.request_id, f"{req.operator}.{req.function}", f.op, f.fn, f.key, fallback,
                         budget]).encode())
        return True

    def probed_run(unit: PartitionUnit, frame: Frame) -> Outgoing:
        on = started(unit, frame.tid, [frame], coord.phase == 1)
        try:
            return run(unit, frame)
        finally:
            if on:
                send(b"E")

    def probed_replay(unit: PartitionUnit, tid: int, cached: Any) -> bool:
        on = bool(cached) and started(unit, tid, [c.frame for c in cached], True)
        try:
            return replay(unit, tid, cached)
        finally:
            if on:
                send(b"E")

    PartitionUnit._run = probed_run  # type: ignore[method-assign,assignment]  # a deliberate patch (see above)
    PartitionUnit._replay_cached = probed_replay  # type: ignore[method-assign,assignment]


def exit_for_supervisor(epoch: int, why: str) -> NoReturn:
    """Recovery cannot blame any transaction for what kills the process in ``epoch``: say so in one ``FATAL`` line
    naming the epoch and exit (75) for the supervisor, rather than replay it for real and die again unexplained."""
    line = (f"FATAL: replaying epoch {epoch} stops the engine's process outside any function ({why}), in its epoch "
            "and again at recovery; no transaction is to blame, nothing was set aside; exiting for the supervisor "
            "(the data directory needs a person)")
    _events.critical("%s", line, extra={"event": "fatal", "epoch": epoch})
    logged = False
    lg: logging.Logger | None = _events
    while lg is not None:  # the handlers the line went to (flushed: the exit skips it)
        for handler in lg.handlers:
            handler.flush()
            logged = logged or not isinstance(handler, logging.NullHandler)
        lg = lg.parent if lg.propagate else None
    if not logged:  # logging is not set up (not `charon run`): the line still reaches stderr
        os.write(2, (line + "\n").encode())
    os._exit(EXIT_CODE)


def quarantine_killers(epoch: int, run_epoch: Callable[[], Any], coordinator: Callable[[], EpochCoordinator],
                       book: VerdictBook, deadline_s: float, default_budget: float | None = None,
                       give_up: Callable[[int, str], Any] = exit_for_supervisor) -> list[str]:
    """Probe ``epoch`` until it completes in a child; quarantine each transaction whose step killed one or ran past
    its budget (recorded before the epoch replays). Returns the request ids quarantined. A child that died
    outside any step blames nobody: ``give_up(epoch, why)`` (by default: a FATAL line, exit 75).
    ``default_budget``: the budget of a function without a ``timeout`` of its own (the runtime's
    ``function_timeout``; default ``deadline_s``)."""
    if default_budget is None:
        default_budget = deadline_s
    out: list[str] = []
    for _ in range(MAX_PROBES):
        c = probe(run_epoch, coordinator, deadline_s, default_budget)
        if isinstance(c, Inconclusive):
            give_up(epoch, c.why)
            break
        if c is None or c.request_id in book.verdicts:
            break  # it completes (or the same one again: the replay refuses it anyway)
        msg = (f"{c.operator}.{c.function} on key {c.key!r} stopped the engine's process while running (killed "
               "it, or ran past its time budget) in its epoch and again at recovery; the transaction was set aside")
        book.record(letter(c.request_id, c.operator, c.function, c.key, Verdict("Quarantined", msg, c.fallback),
                           epoch, c.root))
        out.append(c.request_id)
    return out


# -- Spark: which transaction kills its Python worker --------------------------------------------------------------
@contextlib.contextmanager
def probing(probe_dir: str | None) -> Iterator[None]:
    """In a Spark task of an epoch being probed (it failed before): every invocation step writes ``S tid phase``
    before it runs and ``E`` after, unbuffered, to a file of this worker process under ``probe_dir``; a worker
    that dies leaves its file ending in ``S``: :func:`culprit_in` finds the transaction. (The class is patched for
    the task's duration: a Python worker runs one task at a time.)"""
    if probe_dir is None:
        yield
        return
    os.makedirs(probe_dir, exist_ok=True)
    fd = os.open(os.path.join(probe_dir, f"{os.getpid()}.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    run, replay = PartitionUnit._run, PartitionUnit._replay_cached

    def probed_run(unit: PartitionUnit, frame: Any) -> Any:
        os.write(fd, f"S {frame.tid} {0 if unit._recording else 1}\n".encode())
        try:
            return run(unit, frame)
        finally:
            os.write(fd, b"E\n")

    def probed_replay(unit: PartitionUnit, tid: int, cached: Any) -> bool:
        os.write(fd, f"S {tid} 1\n".encode())
        try:
            return replay(unit, tid, cached)
        finally:
            os.write(fd, b"E\n")

    # patched for the task's duration (the probing worker's steps), restored after
    PartitionUnit._run = probed_run  # type: ignore[method-assign,assignment]
    PartitionUnit._replay_cached = probed_replay  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        PartitionUnit._run, PartitionUnit._replay_cached = run, replay  # type: ignore[method-assign]
        os.close(fd)


def culprit_in(probe_dir: str) -> tuple[int, bool] | None:
    """The (tid, in its fallback) a probed worker was running when it died: the step the files ending in a started
    step (an ``S`` line without its ``E``) name. None when none does (the workers died outside any step: nobody is
    to blame), or when they name different steps (it cannot tell which killed its worker)."""
    dangling = []
    try:
        names = sorted(os.listdir(probe_dir))
    except FileNotFoundError:
        return None
    for name in names:
        with open(os.path.join(probe_dir, name), "rb") as f:
            data = f.read()
        # complete lines only: a marker torn by the worker's death (``S 1`` of ``S 12 0``) was never a step that
        # started (the start is written before the step runs); a worker whose last step ended blames nobody
        lines = data[:data.rfind(b"\n") + 1].splitlines()
        last = lines[-1].split() if lines else []
        if len(last) == 3 and last[0] == b"S" and last[1].isdigit():
            dangling.append((int(last[1]), last[2] == b"1"))
    found = set(dangling)  # Spark's task retries leave one file per dead worker: the same step each time
    return found.pop() if len(found) == 1 else None
