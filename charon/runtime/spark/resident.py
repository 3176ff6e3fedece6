"""The resident exchange (the default, ``SparkConfig.exchange = "resident"``): one long-running barrier job whose
tasks host the partitions and take round after round, epoch after epoch, over sockets; no Spark job per round.

:class:`ResidentExchange` is the driver's side, an exchange like :class:`~charon.runtime.spark.exchange.SparkExchange`
(the coordinator and ``PartitionUnit.step`` unchanged); :func:`resident_task` is what each task of the gang runs.
See ``docs/internals/resident.md``.

Frames (both ways): 4-byte big-endian length, then a pickle. A task's hello (before any frame): the gang's 16-byte
token, its attempt number, its index, the gang's task count and its process id (4 bytes each), then its executor's
address (``host:port``, as Spark's ``BarrierTaskInfo`` names it; UTF-8, length-prefixed as a frame, at most
:data:`ADDRESS_MAX` bytes): :meth:`ResidentExchange.placement` reports where the gang runs. Then per round the
driver sends ``("round", control, {pid: inbox}, app_ref, previous, function_timeout, probe_dir, versions)``
(``versions``: the recorded code history, the units' code book, :func:`~charon.runtime.spark.tasks.code_book`) and
the task
answers ``([(pid, RoundOutput)], stats)``, or ``(None, {"error": traceback})`` when the round raised (the task then
ends: the driver raises :class:`GangTaskFailed` naming the error, as a failed Spark task's error names it);
``("stop",)`` ends the task.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import select
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial
from typing import Any, TypeVar

from charon.config import SparkConfig
from charon.core.epoch import EpochResult
from charon.core.partition import Control, PartitionUnit, Prior, RoundOutput
from charon.errors import EngineUnavailable
from charon.runtime.control.codeversions import CodeEntry
from charon.runtime.faults import crash_point
from charon.runtime.spark.exchange import SparkExchange
from charon.runtime.spark.layout import durable_location
from charon.state.records import EpochRecord

_T = TypeVar("_T")
_LEN = struct.Struct(">I")
_HELLO = struct.Struct(">16sIIII")
MEET_S = 120.0  # longest the driver waits for a new gang's tasks to connect
ADDRESS_MAX = 1024  # longest executor address a hello may carry
POLL_S = 0.5  # how often a waiting side checks that the other is still there

_log = logging.getLogger("charon.engine")


class GangLost(EngineUnavailable):
    """The resident gang failed (a task, worker or executor died, or Spark relaunched its stage): the epoch in
    flight fails and the runtime restarts the query, which builds a new exchange and a new gang."""


def gang_lost(err: BaseException | None) -> bool:
    """Whether ``err`` (or an error it was raised from) is a lost resident gang (:class:`GangLost`)."""
    seen = 0
    while err is not None and seen < 10:
        if isinstance(err, GangLost):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


class GangTaskFailed(RuntimeError):
    """A round raised in a task of the resident gang (e.g. its finalize could not write a delta): the message
    carries the task's traceback, so the failure names the innermost Python error as a failed Spark task's does
    (:func:`~charon.runtime.spark.session.short_error`). The task ended; its gang is broken (the epoch fails, and
    the runtime restarts it on a new gang, counting the failure as any epoch's)."""


def _readable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` has data (or EOF) within ``timeout`` seconds (``poll``: any descriptor number, where
    ``select`` refuses one past 1023)."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(timeout * 1000))


def _recv(sock: socket.socket, n: int, alive: Any = None) -> bytes:
    """``n`` bytes; ``alive()`` (when given) is asked every :data:`POLL_S` while none come, and a false answer
    raises :class:`GangLost` (a round may legitimately take long: a function runs up to its budget)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if alive is not None:
            if not _readable(sock, POLL_S):
                why = alive()
                if why:
                    raise GangLost(why)
                continue
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("resident gang: connection closed")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket, alive: Any = None) -> bytes:
    (n,) = _LEN.unpack(_recv(sock, 4, alive))
    return _recv(sock, n, alive)


def _send_frame(sock: socket.socket, frame: bytes) -> None:
    sock.sendall(_LEN.pack(len(frame)) + frame)


class ResidentExchange:
    """Rounds over sockets to a resident barrier gang (see the module's docstring). The same face as
    :class:`SparkExchange` toward the runtime: ``partitions``, ``round``, ``set_budget``, ``set_code``, ``stats``,
    ``pending``; plus :meth:`close`, which ends the gang (the runtime calls it when it replaces the exchange
    or stops). No ``rest``/``fallback`` hooks: the coordinator runs every round through :meth:`round`."""

    def __init__(self, spark: Any, app_ref: str, config: SparkConfig, previous: tuple[int, str] | None = None,
                 versions: tuple[CodeEntry, ...] = (), *,
                 launch: Callable[[ResidentExchange], None] | None = None) -> None:
        """``launch`` (a seam for the seeded simulator, :mod:`charon.testing.simulation_resident`): called with
        this exchange instead of starting the barrier job; it must start the gang's tasks, each of which says
        hello through :meth:`admit` (the exchange then waits for all of them as for Spark's). ``spark`` may then be
        None (with ``config.resident_tasks`` set)."""
        self.sc: Any = spark.sparkContext if spark is not None else None
        self.launch_hook = launch
        self.config = config
        self.partitions = config.partitions
        self.app_ref = app_ref
        self.previous = previous
        self.versions = versions
        self.durable_root = durable_location(config)
        self.fence = new_fence()  # this gang's writer generation (DurableState.claim)
        self.function_timeout: float | None = config.function_timeout
        self.probe_dir: str | None = None
        self.stats: dict[str, float] = {}
        self.pending: tuple[EpochRecord, EpochResult] | None = None  # as SparkExchange's
        self.tasks = max(1, min(config.resident_tasks or self._default_tasks(), config.partitions))
        self.groups = SparkExchange.groups(config.partitions, self.tasks)
        self.token = os.urandom(16)
        self.group_id = f"charon-resident-{self.token.hex()[:12]}"
        self.lock = threading.Lock()
        self.seated: dict[int, socket.socket] = {}
        self.attempts: dict[int, int] = {}
        self.pids: dict[int, int] = {}  # each seated task's Python worker (fault tests kill one)
        self.executors: dict[int, str] = {}  # each seated task's executor (host:port, from Spark's BarrierTaskInfo)
        self.broken: str | None = None
        self.closed = False
        self.launched = False
        self.listener: socket.socket | None = None
        self.job: threading.Thread | None = None
        self.job_done = threading.Event()
        self.launches = 0
        self.early_sent = 0  # deferred finalizes sent ahead of their round (prefinalize)

    def _default_tasks(self) -> int:
        """The gang's size when ``resident_tasks`` is 0. Local mode: its cores but one (at least one), so that a
        Spark job beside the gang (a ``state_frame`` query, a bulk load, ``driver_reads=False`` reads) finds a free
        slot. A cluster: every task slot of the executors registered now (:func:`task_slots`; a job beside the
        gang waits for a slot there: set ``resident_tasks`` lower when there are such jobs). After an executor is
        lost, the next gang is sized again: it takes the slots that are left."""
        if self.local:
            return max(1, int(self.sc.defaultParallelism) - 1)
        return max(1, task_slots(self.sc) or 1)

    @property
    def local(self) -> bool:
        return self.config.master.strip().startswith("local")

    def placement(self) -> dict[str, Any]:
        """Where the gang runs (``SparkRuntime.health()["gang"]``): its token (first 12 hex digits), size and
        launches, and per seated task its index, partitions, executor (``host:port``, Spark's ``BarrierTaskInfo``),
        Python worker's process id and attempt number."""
        with self.lock:
            seated = [{"task": i, "partitions": self.groups[i], "executor": self.executors.get(i),
                       "pid": self.pids.get(i), "attempt": self.attempts.get(i)} for i in sorted(self.seated)]
        return {"token": self.token.hex()[:12], "tasks": self.tasks, "launches": self.launches,
                "broken": self.broken, "seated": seated}

    # -- the runtime's face ------------------------------------------------------------------------------------
    def set_budget(self, timeout: float | None, probe_dir: str | None = None) -> None:
        """As :meth:`SparkExchange.set_budget`: sent with every round from now on."""
        self.function_timeout, self.probe_dir = timeout, probe_dir

    def set_code(self, app_ref: str, previous: tuple[int, str] | None = None,
                 versions: tuple[CodeEntry, ...] = ()) -> None:
        """As :meth:`SparkExchange.set_code`: the tasks load the refs the next round names."""
        self.app_ref, self.previous, self.versions = app_ref, previous, versions

    def round(self, control: Control, inboxes: list[list]) -> list[RoundOutput]:
        t0 = time.perf_counter()
        self._ensure_gang()
        busy = bool(control.apply or control.reset or control.fast or control.finalize or control.prior
                    or control.timers)
        outs: list[RoundOutput] = [RoundOutput() for _ in range(self.partitions)]
        frames: list[tuple[int, bytes]] = []
        for i, group in enumerate(self.groups):
            mine = {p: inboxes[p] for p in group if busy or inboxes[p]}
            if mine:
                frames.append((i, pickle.dumps(("round", control, mine, self.app_ref, self.previous,
                                                self.function_timeout, self.probe_dir, self.versions),
                                               protocol=pickle.HIGHEST_PROTOCOL)))
        got = 0
        task: dict[str, float] = {}
        if frames:
            socks = self.seated
            try:
                for i, frame in frames:
                    _send_frame(socks[i], frame)
                for i, _ in frames:
                    blob = _recv_frame(socks[i], self._dead)
                    got += len(blob)
                    results, stats = pickle.loads(blob)
                    if results is None:  # the round raised in that task (which ended): its error, named
                        tb = str(stats.get("error", "")).strip()
                        self._lost(f"task {i} failed: {tb.splitlines()[-1] if tb else '?'}")
                        raise GangTaskFailed(f"a round failed in task {i} of the resident gang:\n{tb}")
                    for pid, out in results:
                        outs[pid] = out
                    for k, v in stats.items():
                        task[k] = task.get(k, 0) + v
            except (OSError, EOFError, pickle.UnpicklingError) as e:
                raise self._lost(f"a task of the resident gang is gone ({type(e).__name__}: {e})") from e
            except GangLost as e:
                raise self._lost(str(e)) from e
        crash_point("after_round", control.epoch)  # fires after the epoch's first round (fault tests)
        s = self.stats
        s["round_s"] = s.get("round_s", 0.0) + time.perf_counter() - t0
        s["rounds"] = s.get("rounds", 0) + (1 if frames else 0)
        s["tasks"] = s.get("tasks", 0) + len(frames)
        s["bytes_out"] = s.get("bytes_out", 0) + sum(len(f) for _, f in frames)
        s["bytes_in"] = s.get("bytes_in", 0) + got
        s["task_cpu_s"] = s.get("task_cpu_s", 0.0) + task.get("cpu_us", 0) / 1e6
        s["step_s"] = s.get("step_s", 0.0) + task.get("step_us", 0) / 1e6
        s["restore_s"] = s.get("restore_s", 0.0) + task.get("restore_us", 0) / 1e6
        return outs

    def prefinalize(self, prior: Prior) -> None:
        """Send an epoch's deferred finalize to every task now, without waiting for it: each task writes it while
        the driver records the epoch and cuts the next, and the next epoch's first round (which carries the same
        ``prior``) takes the output it kept instead of writing then. Nothing is sent unless the whole gang is
        seated (the round then carries the finalize as before); a task that is gone is found by that round."""
        if self.closed or not self.launched or self._dead() or len(self.seated) != len(self.groups):
            return
        frames = [(i, pickle.dumps(("prior", prior, list(group), self.app_ref, self.previous, self.versions),
                                   protocol=pickle.HIGHEST_PROTOCOL)) for i, group in enumerate(self.groups)]
        try:
            for i, frame in frames:
                _send_frame(self.seated[i], frame)
        except (OSError, KeyError):
            return  # the next round finds the gang lost
        self.early_sent += 1

    def start(self) -> None:
        """Launch the gang now (else the first round does): the direct sequencer warms it up before any request."""
        self._ensure_gang()

    def failure(self) -> str | None:
        """Why this exchange cannot run a round any more (its gang failed or it was closed), or None."""
        if self.closed:
            return "the resident exchange is closed"
        return self._dead() if self.launched else None

    def close(self) -> None:
        """End the gang: its tasks are told to stop (their job then ends), its links closed; a job still running
        after that is cancelled. Idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            socks = list(self.seated.values())
            self.seated = {}
        for sock in socks:
            try:
                _send_frame(sock, pickle.dumps(("stop",)))
            except OSError:
                pass
            _shut(sock)
        if self.listener is not None:
            _shut(self.listener)
        if self.job is not None and self.job.is_alive():
            # told to stop, a whole gang's tasks return and its job ends at once; a broken one's (a task gone, a
            # gang still waiting for slots) may never end by itself: cancelled without waiting long
            if not self.job_done.wait(5.0 if self.broken is None else 0.5):
                try:
                    self.sc.cancelJobGroup(self.group_id)
                except Exception:  # noqa: BLE001 - the session is gone: the job went with it
                    pass
                self.job_done.wait(10.0)

    # -- the gang ----------------------------------------------------------------------------------------------
    def _dead(self) -> str | None:
        """Why the gang cannot answer any more (None: it still can)."""
        if self.broken is not None:
            return self.broken
        if self.job_done.is_set():
            return "the resident gang's job ended"
        return None

    def _lost(self, why: str) -> GangLost:
        """Mark the gang broken for good (its tasks' scratch is gone): every later round fails too, until the
        runtime replaces this exchange."""
        with self.lock:
            if self.broken is None:
                self.broken = why
        _log.warning("resident gang lost: %s", why, extra={"event": "gang_lost"})
        return GangLost(self.broken or why)

    def _ensure_gang(self) -> None:
        if self.closed:
            raise GangLost("the resident exchange is closed")
        if self.broken is not None:
            raise GangLost(self.broken)
        if not self.launched:
            self._launch()

    def _launch(self) -> None:
        """Start the gang (the barrier job, or ``launch``'s), wait for every task's hello."""
        self.launched = True
        self.launches += 1
        if self.launch_hook is not None:
            self.launch_hook(self)
        else:
            self._launch_job()
        deadline = time.monotonic() + MEET_S
        recount = time.monotonic() + POLL_S
        while True:
            with self.lock:
                if len(self.seated) == self.tasks:
                    return
            why = self._dead()
            if why is not None:
                raise self._lost(f"the resident gang did not start: {why}")
            if time.monotonic() > recount:
                recount = time.monotonic() + POLL_S
                self._check_slots()
            if time.monotonic() > deadline:
                raise self._lost(f"the resident gang's {self.tasks} tasks did not all start within {MEET_S:.0f} s "
                                 "(a barrier job needs a free slot per task)")
            time.sleep(0.005)

    def _launch_job(self) -> None:
        """Open the meeting socket, start the barrier job in a driver thread (its tasks connect to the socket)."""
        conf = self.sc.getConf()
        host = conf.get("spark.driver.host") or socket.gethostname()
        bind = conf.get("spark.driver.bindAddress") or "0.0.0.0"
        self.listener = socket.create_server((bind, 0))
        port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, name="charon-resident-meet", daemon=True).start()
        cfg = self.config
        fn = partial(resident_task, (host, port), self.token, self.tasks, self.partitions, cfg.local_dir,
                     self.durable_root, cfg.checkpoint_dir, cfg.gc_threshold, cfg.determinism_check, self.fence,
                     cfg.finalize_threads)
        self.job = threading.Thread(target=self._run_job, args=(fn,), name="charon-resident-gang", daemon=True)
        self.job.start()

    def _check_slots(self) -> None:
        """While a gang sized by the cluster (``resident_tasks`` 0) waits for its tasks: when fewer task slots are
        left than it has tasks (an executor or a Worker was lost meanwhile; Spark would hold the barrier job until
        its slot check gives up), it is lost now, so that the runtime's restart sizes the next gang by what is
        left."""
        if self.local or self.config.resident_tasks:
            return
        slots = task_slots(self.sc)
        if slots is not None and slots < self.tasks:
            raise self._lost(f"the cluster has {slots} task slot{'s' if slots != 1 else ''} left, fewer than the "
                             f"gang's {self.tasks} tasks (an executor was lost): the next gang takes {slots}")

    def _run_job(self, fn: Any) -> None:
        try:
            self.sc.setJobGroup(self.group_id, "charon resident gang", interruptOnCancel=True)
            self.sc.parallelize(range(self.tasks), self.tasks).barrier().mapPartitions(fn).collect()
            why = "the resident gang's job ended"
        except Exception as e:  # noqa: BLE001 - reported through the next round
            why = f"the resident gang's job failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        with self.lock:
            if not self.closed and self.broken is None:
                self.broken = why
        self.job_done.set()

    def _accept(self) -> None:
        listener = self.listener
        assert listener is not None
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return  # closed
            self.admit(sock)

    def admit(self, sock: Any) -> bool:
        """A task connected on ``sock``: read its hello and seat it, or fence it (``sock`` closed; False). A hello
        naming another token or gang size is refused; a second hello for a seated index (Spark relaunched the
        barrier stage) marks the gang broken, and the new attempt is never seated."""
        try:
            sock.settimeout(10.0)
            token, attempt, index, tasks, pid = _HELLO.unpack(_recv(sock, _HELLO.size))
            (n,) = _LEN.unpack(_recv(sock, _LEN.size))
            if n > ADDRESS_MAX:
                raise ValueError(f"an executor address of {n} bytes")
            executor = _recv(sock, n).decode("utf-8", "replace")
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, struct.error, ValueError):
            _shut(sock)
            return False
        with self.lock:
            fenced = (self.closed or token != self.token or tasks != self.tasks or not 0 <= index < tasks)
            if not fenced and index in self.attempts:
                # Spark relaunched the barrier stage: the seated tasks' scratch is gone, so this gang is broken
                # (the epoch in flight fails; the runtime replaces the exchange). The new attempt is never
                # seated: only the first attempt of a gang ever gets a frame.
                if self.broken is None:
                    self.broken = (f"Spark relaunched the resident gang (task {index}, attempt {attempt} after "
                                   f"{self.attempts[index]})")
                fenced = True
            if not fenced:
                self.attempts[index] = attempt
                self.pids[index] = pid
                self.executors[index] = executor
                self.seated[index] = sock
        if fenced:
            _shut(sock)
        return not fenced


_FENCES = [0]
_FENCE_LOCK = threading.Lock()


def new_fence() -> int:
    """A writer generation for a new gang: larger than every earlier one of this driver (the wall clock in
    nanoseconds, so also than a restarted driver's earlier gangs unless its clock went back)."""
    with _FENCE_LOCK:
        _FENCES[0] = max(time.time_ns(), _FENCES[0] + 1)
        return _FENCES[0]


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


# -- in the executors -----------------------------------------------------------------------------------------------
def resident_task(address: tuple[str, int], token: bytes, tasks: int, parts: int, local_dir: str | None,
                  durable_root: str, checkpoint: str, gc_threshold: int, determinism_check: bool,
                  fence: int | None, finalize_threads: int, items: Iterable[int]) -> Iterator[int]:
    """One task of the resident gang: meet the driver, then step this task's partitions round after round (their
    scratch and call-graph caches kept here between rounds and epochs) until told to stop or the driver's socket
    closes. Yields nothing."""
    from pyspark import BarrierTaskContext

    from charon.runtime.spark.layout import local_root
    from charon.runtime.spark.tasks import tune_worker_gc
    from charon.state.durable import preload

    for _ in items:
        pass
    ctx = BarrierTaskContext.get()
    index, attempt = ctx.partitionId(), ctx.attemptNumber()
    infos = ctx.getTaskInfos()  # ordered by partition: this task's is its executor's host:port
    executor = (infos[index].address if index < len(infos) else "").encode("utf-8")[:ADDRESS_MAX]
    preload()  # before the hello: the gang's first round does not pay the imports of its first restore
    tune_worker_gc(gc_threshold)
    task = GangTask(parts, local_root(local_dir, checkpoint, durable_root), durable_root, determinism_check, fence,
                    finalize_threads)
    sock = socket.create_connection(address, timeout=MEET_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(hello(token, attempt, index, tasks, os.getpid(), executor))
    sock.settimeout(None)
    try:
        while True:
            try:
                frame = _recv_frame(sock)
            except (ConnectionError, OSError):
                return  # the driver is gone or replaced this gang
            reply = task.handle(frame)
            if reply is None:
                return
            if reply == NO_REPLY:
                continue
            _send_frame(sock, reply)
            if task.failed:
                return  # the round raised: its error was told to the driver
    finally:
        sock.close()
        task.close()
    yield 0  # pragma: no cover - never reached: a generator for mapPartitions


def hello(token: bytes, attempt: int, index: int, tasks: int, pid: int, executor: bytes = b"") -> bytes:
    """A gang task's hello (see the module's docstring), the first bytes it sends the driver: ``executor`` its
    executor's ``host:port`` (at most ``ADDRESS_MAX`` bytes)."""
    return _HELLO.pack(token, attempt, index, tasks, pid) + _LEN.pack(len(executor)) + executor


class GangTask:
    """What a task of the gang keeps and does between frames: its partitions' scratch and call-graph caches
    (kept between rounds and epochs, dropped after a finalize). :func:`resident_task` runs it over its socket;
    the seeded simulator (:mod:`charon.testing.simulation_resident`) runs it in simulated workers."""

    def __init__(self, parts: int, root: str, durable_root: str, determinism_check: bool,
                 fence: int | None = None, finalize_threads: int = 1) -> None:
        self.parts = parts
        self.finalize_threads = finalize_threads  # a finalize's partitions written in this many threads (_round)
        self.pool: ThreadPoolExecutor | None = None
        self.fence = fence  # the gang's writer generation (see new_fence)
        self.root = root  # the executor-local stores' directory
        self.durable_root = durable_root
        self.determinism_check = determinism_check
        self.scratch: dict[int, PartitionUnit | None] = {}  # each partition's unit, with the epoch's scratch
        self.caches: dict[int, dict[int, list]] = {}
        self.epoch = -1
        self.failed = False  # a round raised: the task ends after telling the driver
        # an epoch's finalize written ahead of the round that carries it (ResidentExchange.prefinalize): per
        # partition (epoch, output), taken by that round; its error, told by the next round
        self.early: dict[int, tuple[int, RoundOutput]] = {}
        self.early_error: str | None = None

    def close(self) -> None:
        """The task ended: its finalize threads go (after the write they may be running)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

    def handle(self, frame: bytes) -> bytes | None:
        """The reply to one frame from the driver: a round's outputs, or its error's traceback when it raised
        (:attr:`failed` is then set); None for a stop frame (the task ends)."""
        msg = pickle.loads(frame)
        if msg[0] == "prior":
            self._early(*msg[1:])
            return NO_REPLY
        if msg[0] != "round":
            return None
        _, control, inboxes, app_ref, previous, function_timeout, probe_dir, versions = msg
        if self.pool is None and self.finalize_threads > 1 and len(inboxes) > 1:
            self.pool = ThreadPoolExecutor(self.finalize_threads, thread_name_prefix="charon-finalize")
        early, self.early = self.early, {}
        try:
            if self.early_error is not None:
                raise RuntimeError(f"an epoch's finalize written ahead failed:\n{self.early_error}")
            results, stats, self.epoch, self.caches = _round(
                control, inboxes, app_ref, previous, function_timeout, probe_dir, self.scratch, self.caches,
                self.epoch, self.parts, self.root, self.durable_root, self.determinism_check, self.fence, self.pool,
                versions, early)
        except Exception:  # noqa: BLE001 - told to the driver (its round raises it); this task then ends
            self.failed = True
            return pickle.dumps((None, {"error": traceback.format_exc()[-20_000:]}), protocol=pickle.HIGHEST_PROTOCOL)
        if control.finalize:  # the epoch is over: nothing of it stays
            self.scratch.clear()
            self.caches = {}
        return pickle.dumps((results, stats), protocol=pickle.HIGHEST_PROTOCOL)


    def _early(self, prior: Prior, pids: list[int], app_ref: str, previous: tuple[int, str] | None,
               versions: tuple[CodeEntry, ...]) -> None:
        """Write ``prior`` (an epoch's deferred finalize) for ``pids`` now, keeping each output for the round that
        carries it; an error is kept for the next round to tell (no reply goes to this frame)."""
        from charon.runtime.spark.session import load_app
        from charon.runtime.spark.tasks import code_book, unit_for

        if self.early_error is not None:
            return
        try:
            app = load_app(app_ref)
            prev = None if previous is None else (previous[0], load_app(previous[1]))
            book = code_book(versions)

            if self.pool is None and self.finalize_threads > 1 and len(pids) > 1:
                self.pool = ThreadPoolExecutor(self.finalize_threads, thread_name_prefix="charon-finalize")
            got = _finalize_priors(self.pool, pids, lambda pid: unit_for(
                app, self.parts, self.root, self.durable_root, pid, self.scratch.get(pid), prev,
                self.determinism_check, self.fence, book), prior)
            for pid, (unit, out) in zip(pids, got, strict=True):
                self.scratch[pid] = unit
                self.early[pid] = (prior.epoch, out)
        except Exception:  # noqa: BLE001 - told by the next round (the task then ends)
            self.early_error = traceback.format_exc()[-20_000:]


NO_REPLY = b""  # GangTask.handle's answer to a frame that takes no reply (an early finalize)


def _finalize_priors(pool: ThreadPoolExecutor | None, pids: list[int], unit: Callable[[int], PartitionUnit],
                     prior: Prior) -> list[tuple[PartitionUnit, RoundOutput]]:
    """``prior`` (an earlier epoch's deferred finalize) written for each of ``pids`` over its ``unit(pid)``: in
    ``pool``, one partition per thread, when there is one and several partitions; each unit with its output."""
    from charon.runtime.spark.tasks import finalize_prior

    def one(pid: int) -> tuple[PartitionUnit, RoundOutput]:
        u = unit(pid)
        return u, finalize_prior(u, prior)

    return _each(pool, one, pids) if pool is not None and len(pids) > 1 else [one(pid) for pid in pids]


def _each(pool: ThreadPoolExecutor, fn: Callable[[int], _T], pids: list[int]) -> list[_T]:
    """``fn`` of each of ``pids`` in ``pool``, in order; every call has ended when this returns (the first error
    is raised only then: no write of the round goes on after the task told the driver it failed)."""
    futures = [pool.submit(fn, pid) for pid in pids]
    wait(futures)
    return [f.result() for f in futures]


def _round(control: Control, inboxes: dict[int, list], app_ref: str, previous: tuple[int, str] | None,
           function_timeout: float | None, probe_dir: str | None, scratch: dict[int, PartitionUnit | None],
           caches: dict[int, dict[int, list]], epoch: int, parts: int, root: str, durable_root: str,
           determinism_check: bool, fence: int | None = None, pool: ThreadPoolExecutor | None = None,
           versions: tuple[CodeEntry, ...] = (), early: dict[int, tuple[int, RoundOutput]] | None = None,
           ) -> tuple[list[tuple[int, RoundOutput]], dict[str, int], int, dict[int, dict[int, list]]]:
    """One round in a gang task: each of ``inboxes``' partitions stepped over its store and ``scratch`` (updated in
    place); returns the outputs, the task's stats, and the epoch and call-graph caches the task keeps.

    ``pool`` (a task hosting several partitions): the writes of a finalize run there, one partition per thread,
    as the job-per-round rest's do (``SparkConfig.finalize_threads``): each partition's delta goes to its own
    durable files and LMDB environment, each with its fsyncs, and in threads the waits overlap. Only a finalize
    runs there (a carried one, or a round that only finalizes): no application code, which runs in this thread.

    ``early``: the outputs of a finalize the task wrote ahead (:meth:`GangTask._early`), per partition with its
    epoch: a round carrying that epoch's finalize (``control.prior``), or finalizing that epoch in a round of its
    own (a flush before a pause), takes the kept output instead of finalizing again."""
    from charon.runtime.guard.quarantine import probing
    from charon.runtime.spark.session import load_app
    from charon.runtime.spark.tasks import code_book, step_unit, unit_for

    c0 = time.thread_time()
    app = load_app(app_ref)
    prev = None if previous is None else (previous[0], load_app(previous[1]))
    book = code_book(versions)  # every recorded version imported now, before any step runs
    if control.epoch != epoch:  # the call-graph cache serves one epoch's fallback
        epoch = control.epoch
        caches = {}
    results: list[tuple[int, RoundOutput]] = []
    stats = {"step_us": 0, "restore_us": 0}
    done: dict[int, RoundOutput] = {}
    threaded = pool is not None and len(inboxes) > 1
    prior = control.prior
    only_finalize = (control.finalize and prior is None and not control.fast and control.timers is None
                     and not any(inboxes.values()))
    if early:
        if prior is not None:
            done = {pid: out for pid, (e, out) in early.items() if e == prior.epoch and pid in inboxes}
        elif only_finalize:
            kept = [(pid, out) for pid, (e, out) in early.items() if e == control.epoch and pid in inboxes]
            if len(kept) == len(inboxes):  # a flush's round: the finalize is written already
                for pid, _ in kept:
                    scratch[pid] = None
                stats["cpu_us"] = int((time.thread_time() - c0) * 1e6)
                return kept, stats, epoch, caches
    with probing(probe_dir):
        if threaded and only_finalize:
            assert pool is not None

            def whole(pid: int) -> tuple[PartitionUnit | None, RoundOutput]:
                return step_unit(app, parts, root, durable_root, pid, control, scratch.get(pid), [], None, prev,
                                 function_timeout, determinism_check, fence, book=book)

            for pid, (unit, out) in zip(inboxes, _each(pool, whole, list(inboxes)), strict=True):
                scratch[pid] = unit
                stats["step_us"] += out.stats.get("step_us", 0)
                stats["restore_us"] += out.stats.get("restore_us", 0)
                results.append((pid, out))
            stats["cpu_us"] = int((time.thread_time() - c0) * 1e6)
            return results, stats, epoch, caches
        if prior is not None and (done or threaded):  # the carried finalize first, of those not written ahead
            left = [pid for pid in inboxes if pid not in done]
            for pid, (unit, out) in zip(left, _finalize_priors(
                    pool, left, lambda pid: unit_for(app, parts, root, durable_root, pid, scratch.get(pid), prev,
                                                     determinism_check, fence, book), prior), strict=True):
                scratch[pid], done[pid] = unit, out
            control = copy.copy(control)
            control.prior = None
        for pid, inbox in inboxes.items():
            cache = caches.setdefault(pid, {})
            cached = {t: cache[t] for t in control.fast if t in cache} if control.fast else None
            mine = copy.copy(control) if control.prior is not None else control  # step clears its prior
            scratch[pid], out = step_unit(app, parts, root, durable_root, pid, mine, scratch.get(pid),
                                          inbox, cached, prev, function_timeout, determinism_check, fence,
                                          done.get(pid), book)
            if out.cached:
                for tid, entries in out.cached.items():
                    cache.setdefault(tid, []).extend(entries)
                out.cached = {}
            stats["step_us"] += out.stats.get("step_us", 0)
            stats["restore_us"] += out.stats.get("restore_us", 0)
            results.append((pid, out))
    stats["cpu_us"] = int((time.thread_time() - c0) * 1e6)
    return results, stats, epoch, caches


def task_slots(sc: Any) -> int | None:
    """How many tasks Spark can run at once now: the figure its barrier scheduling checks a gang against (the
    active executors' cores over ``spark.task.cpus``; ``SparkContext.maxNumConcurrentTasks`` of the default
    resource profile), so a lost executor no longer counts once Spark removed it. None when it cannot tell (a
    JVM gone, an API it lacks)."""
    try:
        jsc = sc._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - py4j errors of every kind: unknown, the caller keeps its own figure
        return None


def make_exchange(spark: Any, app_ref: str, config: SparkConfig, previous: tuple[int, str] | None = None,
                  versions: tuple[CodeEntry, ...] = ()) -> SparkExchange | ResidentExchange:
    """The exchange ``config.exchange`` names: :class:`ResidentExchange` (``"resident"``, the default: one
    long-running barrier job takes every round over sockets) or :class:`SparkExchange` (``"jobs"``: a Spark job
    per round)."""
    config.check_exchange()
    if config.exchange == "resident":
        return ResidentExchange(spark, app_ref, config, previous, versions)
    if config.exchange != "jobs":
        raise ValueError(f"exchange must be 'jobs' or 'resident', not {config.exchange!r}")
    return SparkExchange(spark, app_ref, config, previous, versions)
