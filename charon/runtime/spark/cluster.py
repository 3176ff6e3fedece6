"""A Spark standalone cluster on 127.0.0.1 from the pip package: one Master and N Workers (``bin/spark-class``).

Used by the cluster tests, the CLI and the benchmarks::

    with StandaloneCluster("/tmp/cl", workers=2) as cl:
        cfg = SparkConfig(master=cl.master_url, spark_conf=cl.app_conf())
        ...
        cl.kill_worker(0)          # SIGKILL a Worker with its executor and Python workers

Every daemon runs in its own session (process group), so stopping or killing one also ends the executor
JVM and the Python workers it started. Each Worker gets its own directories: ``work`` (``--work-dir``),
``local`` (``SPARK_LOCAL_DIRS``, Spark's scratch space) and ``charon`` (``CHARON_LOCAL_DIR``, where the
executors keep their resident partition stores, see :func:`charon.runtime.spark.layout.executor_local_dir`).
Executors inherit the Worker's environment (the Worker launches them with a ``ProcessBuilder`` that
copies its own environment and adds the application's ``spark.executorEnv.*``), so a per-Worker
``CHARON_LOCAL_DIR`` reaches the executors and their Python workers; the application must therefore not
set ``spark.executorEnv.CHARON_LOCAL_DIR`` (nor ``SparkConfig.local_dir``), which would override it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

HOST = "127.0.0.1"


def spark_home() -> str:
    """``SPARK_HOME`` if set, else the installed pyspark package (it ships ``bin/spark-class`` and the jars)."""
    home = os.environ.get("SPARK_HOME")
    if home and os.path.exists(os.path.join(home, "bin", "spark-class")):
        return home
    import pyspark

    return os.path.dirname(os.path.abspath(pyspark.__file__))


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Daemon:
    """One Master or Worker JVM started by :class:`StandaloneCluster`."""

    name: str
    proc: subprocess.Popen
    log_path: str
    dirs: dict[str, str] = field(default_factory=dict)

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def __post_init__(self) -> None:
        self.tree = ProcessTree(self.proc)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Signal the daemon's process group (the JVM and the executors it launched)."""
        self.tree.scan()
        if self.proc.poll() is None or _group_alive(self.proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def kill(self, timeout: float = 20.0) -> bool:
        """SIGKILL the daemon, its executors and their Python workers; wait until they are gone."""
        return self.tree.kill(timeout)


def _proc_stat(pid: int) -> tuple[int, int, int] | None:
    """``(ppid, pgid, start time)`` of a live process from ``/proc`` (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[2]), int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """The live descendants of ``pid`` as ``{pid: start time}`` (empty where ``/proc`` is unavailable)."""
    children: dict[int, list[int]] = {}
    start: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    for name in names:
        if name.isdigit():
            st = _proc_stat(int(name))
            if st is not None:
                children.setdefault(st[0], []).append(int(name))
                start[int(name)] = st[2]
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out[c] = start[c]
                todo.append(c)
    return out


class ProcessTree:
    """A process started in its own session plus every descendant seen so far (call :meth:`scan` often).

    Python workers forked by PySpark's daemon move to their own process group, and a JVM outlives its
    parent for a moment, so killing the session's group is not enough: :meth:`kill` also kills every
    descendant recorded by :meth:`scan` that still runs (same pid and start time, never a reused pid).
    """

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.seen: dict[int, int] = {}

    def scan(self) -> None:
        self.seen.update(descendants(self.proc.pid))

    def _alive(self) -> list[int]:
        out = []
        for pid, t in self.seen.items():
            st = _proc_stat(pid)
            if st is not None and st[2] == t:
                out.append(pid)
        return out

    def kill(self, timeout: float = 20.0) -> bool:
        """SIGKILL the group and every recorded descendant; wait until they are gone. Returns whether they are."""
        self.scan()
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in self._alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.2)
            if self.proc.poll() is not None and not self._alive() and not _group_alive(self.proc.pid):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class StandaloneCluster:
    """A Master and ``workers`` Workers on 127.0.0.1, all files under ``root``."""

    def __init__(
        self,
        root: str,
        workers: int = 2,
        *,
        cores: int = 1,
        memory: str = "1g",
        python: str | None = None,
        env: dict[str, str] | None = None,
        start_timeout: float = 180.0,
    ) -> None:
        self.root = os.path.abspath(root)
        self.n_workers = workers
        self.cores = cores
        self.memory = memory
        self.python = python or os.environ.get("PYSPARK_PYTHON") or sys.executable
        self.extra_env = dict(env or {})
        self.start_timeout = start_timeout
        self.home = spark_home()
        self.port = 0
        self.master: Daemon | None = None
        self.workers: list[Daemon] = []

    # -- lifecycle --------------------------------------------------------------------------------
    @property
    def master_url(self) -> str:
        return f"spark://{HOST}:{self.port}"

    def _env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        for k in ("CHARON_LOCAL_DIR", "SPARK_LOCAL_DIRS", "SPARK_EXECUTOR_DIRS", "CHARON_CRASH_AT"):
            env.pop(k, None)
        env.update(
            SPARK_HOME=self.home,
            SPARK_LOCAL_IP=HOST,
            PYSPARK_PYTHON=self.python,
            PYSPARK_DRIVER_PYTHON=self.python,
        )
        env.update(self.extra_env)
        env.update(extra)
        return env

    def _spawn(self, name: str, args: list[str], env: dict[str, str], dirs: dict[str, str] | None = None) -> Daemon:
        os.makedirs(self.root, exist_ok=True)
        log_path = os.path.join(self.root, f"{name}.log")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [os.path.join(self.home, "bin", "spark-class"), *args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
                start_new_session=True,
            )
        return Daemon(name, proc, log_path, dirs or {})

    def _await_log(self, d: Daemon, needle: str, deadline: float) -> None:
        while True:
            if needle in d.log():
                return
            if not d.alive():
                raise RuntimeError(f"{d.name} exited with {d.proc.returncode}:\n{d.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{d.name} did not log {needle!r} in time:\n{d.log()[-4000:]}")
            time.sleep(0.2)

    def start(self) -> StandaloneCluster:
        """Start the Master, then the Workers; returns when every Worker is registered with the Master."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        for attempt in range(3):  # the free port may be taken between probing and binding
            self.port = free_port()
            self.master = self._spawn(
                "master",
                ["org.apache.spark.deploy.master.Master", "--host", HOST, "--port", str(self.port),
                 "--webui-port", "0"],
                self._env(),
            )
            try:
                self._await_log(self.master, "I have been elected leader", deadline)
                break
            except RuntimeError:
                if attempt == 2 or "BindException" not in self.master.log():
                    raise
                self.master.kill()
        for i in range(self.n_workers):
            self.workers.append(self._start_worker(i))
        for w in self.workers:
            self._await_log(w, "Successfully registered with master", deadline)

    def _start_worker(self, i: int) -> Daemon:
        base = os.path.join(self.root, f"worker{i}")
        dirs = {k: os.path.join(base, k) for k in ("work", "local", "charon")}
        for d in dirs.values():
            os.makedirs(d, exist_ok=True)
        env = self._env(SPARK_LOCAL_DIRS=dirs["local"], CHARON_LOCAL_DIR=dirs["charon"],
                        SPARK_WORKER_DIR=dirs["work"])
        return self._spawn(
            f"worker{i}",
            ["org.apache.spark.deploy.worker.Worker", self.master_url, "--host", HOST,
             "--cores", str(self.cores), "--memory", self.memory, "--work-dir", dirs["work"], "--webui-port", "0"],
            env, dirs,
        )

    def app_conf(self, executor_cores: int = 1, max_cores: int | None = None) -> dict[str, str]:
        """Spark settings for an application on this cluster (one executor of ``executor_cores`` per Worker).
        The application's first job waits until executors with all ``spark.cores.max`` cores registered (at most
        120 s: ``spark.scheduler.minRegisteredResourcesRatio``), so that a resident gang sized by the cluster
        (``resident_tasks`` 0: every task slot registered when it launches) takes every Worker."""
        total = max_cores if max_cores is not None else executor_cores * self.n_workers
        return {
            "spark.executor.cores": str(executor_cores),
            "spark.cores.max": str(total),
            "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s",
            "spark.executor.memory": "512m",
            "spark.driver.host": HOST,
            "spark.driver.bindAddress": HOST,
        }

    def worker_store_dir(self, i: int) -> str:
        """Where Worker ``i``'s executors keep their resident partition stores (``CHARON_LOCAL_DIR``)."""
        return self.workers[i].dirs["charon"]

    def scan(self) -> None:
        """Record the daemons' current descendants (executors, Python workers) so that kills reach them."""
        for d in self.daemons:
            d.tree.scan()

    @property
    def daemons(self) -> list[Daemon]:
        return [*self.workers, *([self.master] if self.master else [])]

    def kill_worker(self, i: int) -> bool:
        """SIGKILL Worker ``i`` with its executor and Python workers (a lost machine)."""
        return self.workers[i].kill()

    def add_worker(self, timeout: float | None = None) -> int:
        """Start one more Worker (e.g. replacing a killed one) with fresh directories; returns its index once
        it is registered with the Master."""
        i = len(self.workers)
        w = self._start_worker(i)
        self.workers.append(w)
        self._await_log(w, "Successfully registered with master", time.monotonic() + (timeout or self.start_timeout))
        return i

    def stop(self, grace: float = 10.0) -> None:
        """Stop the Workers then the Master (SIGTERM, then SIGKILL after ``grace`` s); safe to call twice."""
        for d in self.daemons:
            d.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for d in self.daemons:
            with contextlib.suppress(subprocess.TimeoutExpired):
                d.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for d in self.daemons:
            d.kill()

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
