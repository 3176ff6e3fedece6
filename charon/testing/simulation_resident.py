"""The simulated resident gang of the seeded simulator (``--exchange resident``, see
:class:`charon.testing.simulation.ResidentSimulation`).

The driver side is the real :class:`~charon.runtime.spark.resident.ResidentExchange` (its ``launch`` seam starts
a :class:`SimGang` instead of a barrier job; every task says hello through the real ``admit``, so a second hello
of a relaunched stage breaks the gang as it does on Spark). Each gang task is a :class:`SimTask`: the real
:class:`~charon.runtime.spark.resident.GangTask` (the frame handling, ``_round``, the real
``tasks.step_unit``) in a simulated Python process (its own live-coroutine table, reused by the next task
on the same worker as Spark reuses Python workers) of a simulated worker (its executor-local LMDB directory).
The link is deterministic, on one thread: the driver's frames go straight to the task's queue (:class:`SimLink`);
the task's hello and replies go over a real socket pair, which the driver reads with its real framing and polls.

Per frame, drawn from the seed (:class:`GangFaults`): the task runs it at once, or late (a slow socket: when the
driver first waits for that task's reply, after the other tasks'), or dies running it (before its first
partition, after some, or after all of them, i.e. after a finalize wrote its deltas, before replying: its
process and live coroutines are gone, the driver sees EOF), or its socket drops (before or after it ran the
frame: the driver sees EOF, the task ends, its process lives on), or its socket drops while the task keeps the
frame and runs it later as a *zombie*: a few rounds into the next gangs (which replay the epoch), in its old
process, its reply going nowhere. A gang abandoned with frames not run yet (a driver crash; the runtime
replacing a broken gang) leaves its tasks as zombies with chance ``linger``.

The runtime's epoch gate is a :class:`SimGate`: an epoch that would wait at the closed gate (a pause, a rescale's
hold) lets the simulation run what the other threads do meanwhile (the operator's resume, the rescale's move)
instead of blocking the one thread. The first round of a gang launched after a rescale may be *doomed*: a task dies
running it (``SimTask.receive``).

The bounds of the direct sequencer are written by a :class:`LazyWriter`: as late as the sequencer allows (when
something waits for them), and never when the driver crashes first.
"""

from __future__ import annotations

import contextlib
import pickle
import random
import socket
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

from charon.core import partition
from charon.runtime.control.gate import EpochGate
from charon.runtime.spark import tasks as spark_tasks
from charon.runtime.spark.resident import NO_REPLY, GangTask, ResidentExchange, hello

_LEN = struct.Struct(">I")  # the gang's framing (see charon.runtime.spark.resident): 4-byte length, then a pickle


class TaskDeath(BaseException):
    """A simulated gang task's process dies here (a BaseException: the task's own error handling, which reports
    an ``Exception`` to the driver, does not see it, as it would not see a SIGKILL)."""


@dataclass
class GangFaults:
    """Per-seed rates of the resident gang's fault points (per frame, except ``relaunch``: per round)."""

    die: float  # the task dies running the frame (before / after some / after all of its partitions)
    drop: float  # the socket drops (before or after the task ran the frame)
    slow: float  # the reply comes after the other tasks' (the task runs when the driver waits for it)
    zombie: float  # the socket drops; the task runs the frame later, while newer gangs run
    linger: float  # a task of an abandoned gang with frames not run yet runs them later (a zombie)
    relaunch: float  # per round: Spark relaunches the stage; a second hello breaks the gang
    max_losses: int = 0  # at most this many gangs lost to these faults (the run must finish)

    @classmethod
    def calm(cls) -> GangFaults:
        return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)

    def lose(self) -> bool:
        """Whether a gang-losing fault may still happen (then it counts)."""
        if self.max_losses <= 0:
            return False
        self.max_losses -= 1
        return True

    @classmethod
    def draw(cls, rng: random.Random) -> GangFaults:
        if rng.random() < 0.2:  # some seeds without gang faults
            return cls.calm()
        p = (lambda hi: rng.choice([0.0, hi / 4, hi]))  # noqa: E731
        return cls(p(0.15), p(0.1), p(0.3), p(0.1), p(0.6), p(0.05), rng.randint(1, 4))


class LazyWriter(Executor):
    """The direct sequencer's bound writer, as late as allowed: a job runs when its result (or a later job's) is
    waited for, or at :meth:`poke`; :meth:`drop` (the driver died) forgets the jobs not run."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Future[Any], Callable[[], Any]]] = []
        self.written = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        writer = self

        class Lazy(Future):
            def result(self, timeout: float | None = None) -> Any:
                writer.run_until(self)
                return super().result(timeout)

        f: Future[Any] = Lazy()
        self.jobs.append((f, lambda: fn(*args, **kwargs)))
        return f

    def run_until(self, target: Future[Any] | None) -> None:
        """Run the pending jobs in order, up to ``target`` (all when None)."""
        while self.jobs and (target is None or not target.done()):
            f, job = self.jobs.pop(0)
            self.written += 1
            try:
                f.set_result(job())
            except Exception as e:  # noqa: BLE001 - the waiter raises it, as a thread pool's future does
                f.set_exception(e)

    def poke(self, rng: random.Random) -> None:
        """The writer's thread got to run: maybe its pending jobs complete now."""
        if self.jobs and rng.random() < 0.5:
            self.run_until(None)

    def drop(self) -> None:
        self.jobs.clear()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.run_until(None)


class SimGate(EpochGate):
    """The real epoch gate, on one thread: an epoch about to wait at the closed gate first calls ``at_gate(epoch)``
    (the other threads' turn: they resume, or move the state and release); still closed after it, it raises (the
    one thread would wait forever)."""

    def __init__(self, at_gate: Callable[[int], None]) -> None:
        super().__init__()
        self.at_gate = at_gate

    def enter(self, epoch: int, timeout: float | None = None) -> None:
        if self.closed_for(epoch):
            self.at_gate(epoch)
        if self.closed_for(epoch):
            raise RuntimeError(f"epoch {epoch} would wait at the closed gate forever: {self.status(epoch - 1)}")
        super().enter(epoch, timeout)


class SimLink:
    """The driver's end of a gang task's link, as ``ResidentExchange`` uses a socket: ``sendall`` hands the frame to
    the task (which runs it now, later or never, per the fault drawn); ``fileno``/``recv_into`` read the task's
    replies from a real socket pair (a slow task runs its frame when the driver first waits for it)."""

    def __init__(self, task: SimTask) -> None:
        self.task = task

    def fileno(self) -> int:
        self.task.pump()
        return self.task.drv.fileno()

    def recv_into(self, buf: Any, n: int = 0) -> int:
        self.task.pump()
        return self.task.drv.recv_into(buf, n)

    def sendall(self, data: bytes) -> None:
        self.task.receive(data)

    def settimeout(self, timeout: float | None) -> None:
        """A socket's, for ``admit`` (nothing here blocks)."""

    def setsockopt(self, *args: Any) -> None:
        """A socket's, for ``admit`` (TCP_NODELAY means nothing on this link)."""

    def shutdown(self, how: int) -> None:
        with contextlib.suppress(OSError):
            self.task.drv.shutdown(how)

    def close(self) -> None:
        self.task.drv.close()
        self.task.driver_closed()


class SimTask:
    """One task of a simulated gang (see the module's docstring)."""

    def __init__(self, gang: SimGang, index: int, attempt: int, worker: Any) -> None:
        sim = gang.sim
        self.gang, self.sim, self.index, self.attempt, self.worker = gang, sim, index, attempt, worker
        self.proc: dict = worker.take_process()  # a Python worker of its executor (its live coroutines)
        root = sim.local_dir(worker)
        self.task = GangTask(sim.config.partitions, root, sim.state_root, sim.config.determinism_check,
                             gang.ex.fence)
        self.drv, self.sock = socket.socketpair()
        self.sock.settimeout(5.0)  # a reply never blocks the one simulated thread
        self.queue: list[bytes] = []
        self.slow = False
        self.zombie_after: int | None = None  # rounds (of any gang) before a zombie runs its queue
        self.state = "live"  # live, ended (its process reused), dead (its process gone)
        self.name = f"g{gang.number}t{index}a{attempt}@w{worker.wid}"
        self.sock.sendall(hello(gang.ex.token, attempt, index, gang.ex.tasks, 10_000 + gang.number))

    # -- the link ------------------------------------------------------------------------------------------------
    def receive(self, data: bytes) -> None:
        if self.state != "live" or self.zombie_after is not None:
            raise BrokenPipeError(f"gang task {self.name} is gone")
        (n,) = _LEN.unpack(data[:4])
        frame = data[4:]
        assert len(frame) == n, "one frame per sendall"
        self.queue.append(frame)
        if pickle.loads(frame)[0] != "round":  # a stop frame
            if len(self.queue) > 1 and self.sim.rng.random() < self.gang.faults.linger:
                self.queue.pop()
                self.become_zombie("its gang was replaced with a frame not run yet")
            else:
                self.run_queue()
            return
        if self.sim.doomed is self.gang.ex:  # the first round after a rescale: this task dies in it
            self.sim.doomed = None
            self.sim.doomed_deaths += 1
            self.run_queue(die_after=self.sim.brng.randint(0, len(pickle.loads(frame)[2])))
            return
        f, rng = self.gang.faults, self.sim.rng
        x = rng.random()
        if x < f.die + f.drop + f.zombie and not f.lose():
            x = 1.0  # no more gang losses this run
        if x < f.die:
            self.run_queue(die_after=rng.randint(0, len(pickle.loads(frame)[2])))
        elif x < f.die + f.drop:
            if rng.random() < 0.5:
                self.sim.trace(f"{self.name}: socket dropped before the task ran its frame")
                self.queue.clear()
            else:
                self.run_queue()
                self.sim.trace(f"{self.name}: socket dropped after the task ran its frame (reply lost)")
            self.end()
        elif x < f.die + f.drop + f.zombie:
            self.become_zombie("socket dropped, the task keeps its frame")
        elif x < f.die + f.drop + f.zombie + f.slow:
            self.slow = True
        else:
            self.run_queue()

    def pump(self) -> None:
        if self.state == "live" and self.zombie_after is None and self.queue:
            if self.slow:
                self.sim.trace(f"{self.name}: slow reply (ran after the other tasks')")
            self.slow = False
            self.run_queue()

    def driver_closed(self) -> None:
        """The driver closed its end: a live task without a frame to run ends (its recv sees EOF)."""
        if self.state == "live" and self.zombie_after is None:
            if self.queue and self.sim.rng.random() < self.gang.faults.linger:
                self.become_zombie("its link was closed with a frame not run yet")
            else:
                self.end()

    def become_zombie(self, why: str) -> None:
        self.zombie_after = self.sim.rng.randint(0, 4)
        self.sim.trace(f"{self.name}: ZOMBIE ({why}); runs {len(self.queue)} frame(s) in "
                       f"{self.zombie_after} round(s)")
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # the driver sees EOF
        self.gang.sim.zombies.append(self)

    # -- running -------------------------------------------------------------------------------------------------
    def run_queue(self, die_after: int | None = None) -> None:
        """Run the queued frames in this task's process; the last one dies after ``die_after`` partitions."""
        while self.queue and self.state == "live":
            frame = self.queue.pop(0)
            dying = die_after if not self.queue else None
            reply = self.run(frame, dying)
            if reply is None:  # stop frame: the task ends
                self.end()
                return
            if reply == NO_REPLY:  # an early finalize: no answer
                if self.task.failed:
                    self.end()
                    return
                continue
            if self.zombie_after is None:
                try:
                    self.sock.sendall(_LEN.pack(len(reply)) + reply)
                except OSError:  # the driver closed the link
                    self.end()
                    return
            if self.task.failed:
                self.end()
                return

    def run(self, frame: bytes, die_after: int | None) -> bytes | None:
        sim = self.sim
        judging = self.zombie_after is None and sim.judging_budget()
        try:
            with self.in_process(), self.dying(die_after), sim.overrunning(judging):
                reply = self.task.handle(frame)
                if die_after is not None:
                    raise TaskDeath("after all its partitions, before replying")
            return reply
        except TaskDeath as e:
            sim.trace(f"{self.name}: TASK DEATH mid-round ({e})")
            self.die()
            return None

    @contextlib.contextmanager
    def in_process(self) -> Iterator[None]:
        saved = partition._LIVE
        partition._LIVE = self.proc
        try:
            yield
        finally:
            partition._LIVE = saved

    @contextlib.contextmanager
    def dying(self, after: int | None) -> Iterator[None]:
        """The task's process dies before stepping partition number ``after`` (counting from 0) of this frame."""
        if after is None:
            yield
            return
        real = spark_tasks.step_unit
        count = [0]

        def step(*args: Any, **kwargs: Any) -> Any:
            if count[0] == after:
                raise TaskDeath(f"after {after} of its partitions")
            count[0] += 1
            return real(*args, **kwargs)

        spark_tasks.step_unit = step  # a deliberate patch (restored below)
        try:
            yield
        finally:
            spark_tasks.step_unit = real

    def end(self) -> None:
        """The task returned: its socket closes, its Python process goes back to its worker's pool."""
        if self.state == "live":
            self.state = "ended"
            self.queue.clear()
            self.sock.close()
            self.worker.give_back(self.proc)

    def die(self) -> None:
        """The task's process is gone: its live coroutines with it, its socket closes (the driver sees EOF)."""
        if self.state == "live":
            self.state = "dead"
            self.queue.clear()
            self.sock.close()
            self.worker.close_stores()  # the process's LMDB handles

    def tick(self) -> bool:
        """A zombie's clock (one round of any gang went by); True once it ran its frames and ended."""
        assert self.zombie_after is not None
        if self.zombie_after > 0:
            self.zombie_after -= 1
            return False
        self.sim.trace(f"{self.name}: the zombie runs {len(self.queue)} frame(s) now")
        self.run_queue()
        self.zombie_after = None
        self.end()
        return True


class SimGang:
    """A launch of the gang for one :class:`ResidentExchange` (its ``launch`` hook): each task placed on a worker
    (its group's usual one, or another), says hello through the exchange's real ``admit``."""

    def __init__(self, sim: Any, ex: ResidentExchange, number: int, faults: GangFaults) -> None:
        self.sim, self.ex, self.number, self.faults = sim, ex, number, faults
        self.tasks: list[SimTask] = []

    def launch(self) -> None:
        for i, group in enumerate(self.ex.groups):
            t = SimTask(self, i, 0, self.sim.pick_worker(group[0]))
            self.tasks.append(t)
            if not self.ex.admit(SimLink(t)):
                raise AssertionError(f"the exchange refused its own gang's task {t.name}")
        self.sim.trace(f"gang {self.number} launched: {[t.name for t in self.tasks]}")

    def relaunch_hello(self) -> None:
        """Spark relaunched the barrier stage: a new attempt of one task says hello (the gang must break)."""
        i = self.sim.rng.randrange(len(self.tasks))
        t = SimTask(self, i, self.ex.attempts.get(i, 0) + 1, self.sim.pick_worker(self.ex.groups[i][0]))
        seated = self.ex.admit(SimLink(t))
        self.sim.trace(f"gang {self.number}: RELAUNCH, a second hello from {t.name} (seated: {seated})")
        t.end()
        if seated:
            raise AssertionError("a second hello for a seated task was seated")

    def driver_died(self) -> None:
        """The driver (and with it the application's executors) died: tasks with frames not run may linger."""
        for t in self.tasks:
            if t.state == "live" and t.zombie_after is None:
                if t.queue and self.sim.rng.random() < self.faults.linger:
                    t.become_zombie("its driver died with a frame not run yet")
                else:
                    t.die()

