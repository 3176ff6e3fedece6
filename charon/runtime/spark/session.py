"""Java and the Spark session: the JVM (started with its output in ``spark.log``), a dead JVM's handles discarded,
the application's code loaded and shipped to executors, and a query failure's one-line reason."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import tempfile
from collections.abc import Iterable
from typing import Any

from charon.config import SparkConfig
from charon.operator import Application
from charon.runtime.control.codeversions import forget_module


def jvm_exit_code() -> int | None:
    """The exit code of the JVM this process started for Spark, None while it runs (or if there is none)."""
    from pyspark import SparkContext

    proc = getattr(SparkContext._gateway, "proc", None)
    return None if proc is None else proc.poll()


def discard_dead_jvm() -> None:
    """Forget PySpark's handles on a JVM that died (SIGKILL, OutOfMemoryError), without calling into it, so that
    :func:`make_session` starts a new one."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    with SparkContext._lock:
        sc = SparkContext._active_spark_context
        if sc is not None:
            sc._jsc = None  # stop() would call the dead JVM
            with contextlib.suppress(Exception):
                sc.stop()
        gw, SparkContext._gateway, SparkContext._jvm = SparkContext._gateway, None, None
        SparkContext._active_spark_context = None
    SparkSession._instantiatedSession = None
    SparkSession._activeSession = None
    with contextlib.suppress(Exception):
        from pyspark.sql.context import SQLContext

        SQLContext._instantiatedContext = None
    if gw is not None:
        with contextlib.suppress(Exception):
            gw.shutdown_callback_server()
        with contextlib.suppress(Exception):
            gw.close()
        proc = getattr(gw, "proc", None)
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(timeout=10)


def trim_native_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere), and Arrow's.

    The driver allocates from many threads (py4j callbacks, the gateway's read pool, the log pump, Spark's
    batch thread, a compaction thread each time), and glibc keeps the freed memory of its per-thread arenas
    mapped; called after each compaction, so a long run's RSS follows what is live."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)
    pa = sys.modules.get("pyarrow")  # the durable copy's reads and compactions allocate from Arrow's pool
    if pa is not None:
        pa.default_memory_pool().release_unused()


_LIBC: Any = None


def check_java() -> str:
    """Point ``JAVA_HOME`` at a Java Spark runs on (a system Java 17+, else the packaged JDK, installed into
    the venv when missing; :mod:`charon.runtime.spark.java`) and return it. Raises ``JavaUnavailable`` otherwise."""
    from charon.runtime.spark.java import ensure_java

    return ensure_java().home


LOG4J2_CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2.properties")


def spark_log_path(config: SparkConfig) -> str:
    """Where the JVM that :func:`make_session` starts writes everything it prints: ``<data_dir>/spark.log``."""
    return os.path.join(os.path.abspath(config.data_dir), "spark.log")


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def master_with_retries(master: str, failures: int) -> str:
    """``local``/``local[N]``/``local[*]`` with Spark's task retries on (``local[N,F]``); others unchanged
    (they take ``spark.task.maxFailures``). Local mode otherwise gives up on a job at the first failure."""
    m = re.fullmatch(r"local(?:\[\s*(\*|\d+)\s*(?:,\s*\d+\s*)?\])?", master.strip())
    return f"local[{m.group(1) or 1},{failures}]" if m else master


def make_session(config: SparkConfig) -> Any:
    """A SparkSession configured for Charon (Unix-domain sockets to Python workers, small shuffles).

    When this process has no JVM yet, the JVM is started with its stdout and stderr appended to
    :func:`spark_log_path` (log4j output, JVM warnings, and the Python workers' stderr, which the JVM
    relays), so nothing of Spark's reaches the terminal; only a failure to start is raised, with the log's
    tail."""
    check_java()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # Every Python worker hashes str alike (set iteration order; see SparkConfig.python_hash_seed): PySpark
    # passes this process's PYTHONHASHSEED (default 0) to its workers, so it is pinned here, whatever the driver
    # was started with, and given to executors' own environment too (a cluster's).
    if not config.python_hash_seed.isdigit():
        raise ValueError(f"python_hash_seed must be a decimal integer, got {config.python_hash_seed!r}")
    os.environ["PYTHONHASHSEED"] = config.python_hash_seed
    if config.master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # no hostname warnings, nothing off-host
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway
    from pyspark.sql import SparkSession

    log4j = f"-Dlog4j.configurationFile={LOG4J2_CONF}"
    settings = {
        "spark.master": master_with_retries(config.master, config.task_max_failures),
        "spark.task.maxFailures": str(config.task_max_failures),
        "spark.app.name": config.app_name,
        "spark.driver.memory": config.driver_memory,  # applies when this process starts the JVM
        "spark.python.unix.domain.socket.enabled": "true",
        "spark.sql.shuffle.partitions": str(config.partitions),
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.streaming.noDataMicroBatches.enabled": "false",
        "spark.executorEnv.PYSPARK_PYTHON": os.environ["PYSPARK_PYTHON"],
        "spark.executorEnv.PYTHONHASHSEED": config.python_hash_seed,
        # A long run must not grow the driver: the status store (kept even without the UI) retains 1,000 jobs
        # and 100,000 tasks by default, and each epoch runs a few jobs; the cleaner's periodic GC (which
        # releases shuffles, broadcasts and RDDs the driver no longer references) runs every 30 min by default.
        "spark.ui.retainedJobs": "50",
        "spark.ui.retainedStages": "50",
        "spark.ui.retainedTasks": "1000",
        "spark.ui.retainedDeadExecutors": "10",
        "spark.sql.ui.retainedExecutions": "20",
        "spark.sql.streaming.numRecentProgressUpdates": "20",
        "spark.cleaner.periodicGC.interval": "5min",
        # A split rest's gang (barrier mode) asks for as many cores as it has tasks; when an executor was lost in
        # between, Spark re-checks every 15 s, 40 times, before failing the job: fail within seconds instead, so
        # the epoch's rerun sizes its gang by the cores left (SparkExchange.gang_slots)
        "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
        "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "3",
        # Spark's own query checkpoint keeps this many batches (offsets/commits files) and no more
        "spark.sql.streaming.minBatchesToRetain": str(config.checkpoint_batches),
        # object storage: the executors reach it configured as the driver is, by the standard AWS_* variables
        # (passed as their environment, never in a task's closure; Spark redacts secrets' values in its UI/logs)
        **({f"spark.executorEnv.{k}": v for k, v in os.environ.items() if k.startswith("AWS_")}
           if config.storage_url else {}),
        **config.spark_conf,
    }
    # executors elsewhere keep their cluster's log4j setup (this file's path is only known to exist here)
    same_machine = re.match(r"(local\b|spark://(127\.|localhost\b|\[::1\]))", config.master) is not None
    # a fixed, pre-touched heap: the JVM's RSS is its size from the start instead of stepping up toward -Xmx;
    # what a long run still adds outside the heap is JIT code (a 10-min soak: +14 MB in 3 min, native memory
    # tracking) and classes: both capped (the code cache flushes cold code when full; ~120 MB of classes live)
    heap = (f" -Xms{config.driver_memory} -XX:+AlwaysPreTouch -XX:ReservedCodeCacheSize=128m"
            " -XX:MaxMetaspaceSize=512m") if config.fixed_heap else ""
    # an OutOfMemoryError ends the JVM: one in Spark's scheduler thread once left it alive with no epoch ever
    # running again; a dead JVM is noticed and replaced by the supervisor (SparkRuntime._supervise_loop)
    oom = " -XX:+ExitOnOutOfMemoryError"
    for key in ("spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions"):
        if key.startswith("spark.driver") or same_machine:
            opts = log4j + oom + (heap if key.startswith("spark.driver") else "")
            settings[key] = f"{opts} {settings[key]}" if settings.get(key) else opts
    if SparkContext._gateway is None:  # no JVM in this process yet: start it with its output in the log
        log = spark_log_path(config)
        os.makedirs(os.path.dirname(log), exist_ok=True)
        conf = SparkConf()
        for k, v in settings.items():
            conf.set(k, v)
        with open(log, "ab") as out:
            try:
                gateway = launch_gateway(conf, popen_kwargs={"stdout": out, "stderr": out})
            except Exception as exc:  # noqa: BLE001 - the reason is in the log
                raise RuntimeError(f"Spark's JVM did not start ({exc}); the end of {log}:\n{_tail(log)}") from None
        SparkContext(conf=conf, gateway=gateway)
    b = SparkSession.builder
    for k, v in settings.items():
        b = b.config(k, v)
    return b.getOrCreate()


_PY_ERROR = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception): .+")
_WRAPPERS = ("py4j.", "org.apache.", "java.", "pyspark.errors.", "scala.")


def short_error(e: BaseException) -> str:
    """One line naming a (Java-wrapped) query failure: the innermost application/engine Python error if the
    text has one, else Spark's reason (a crashed worker, a failed stage), else the first line."""
    text = str(e)
    lines = [ln.strip() for ln in text.splitlines()]
    py = [ln for ln in lines if _PY_ERROR.match(ln) and not ln.startswith(_WRAPPERS)]
    if py:
        return py[-1][:300]
    for needle in ("Python worker exited unexpectedly (crashed)", "Job aborted due to stage failure"):
        if needle in text:
            return needle
    return (lines[0] if lines else type(e).__name__)[:300]


_APPS: dict[str, Application] = {}


def load_app(ref: str) -> Application:
    """Import ``module:attribute`` (an installed module: code is only loaded from what is deployed)."""
    app = _APPS.get(ref)
    if app is None:
        mod, _, attr = ref.partition(":")
        app = getattr(importlib.import_module(mod), attr or "app")
        if not isinstance(app, Application):
            raise TypeError(f"{ref} is not a charon.Application")
        _APPS[ref] = app
    return app


def forget_app(ref: str, keep: Iterable[Application]) -> None:
    """Unload ``ref``'s application (a drained code version): out of :func:`load_app`'s cache, and its module out
    of the import cache unless it holds an application of ``keep`` or of that cache (the running code's):
    :func:`~charon.runtime.control.codeversions.forget_module`."""
    _APPS.pop(ref, None)
    forget_module(ref, [*keep, *_APPS.values()])


def ship_app_module(spark: Any, app_ref: str) -> bool:
    """Make an application module that is not installed (e.g. ``bank.py`` beside the CLI) importable on
    the executors, with ``addPyFile`` (True); installed modules and Charon's own apps need nothing (False)."""
    import importlib.util
    import zipfile

    name = app_ref.partition(":")[0]
    if name.split(".")[0] == "charon":
        return False
    spec = importlib.util.find_spec(name.split(".")[0])
    origin = getattr(spec, "origin", None) if spec else None
    if not origin or "site-packages" in origin or "dist-packages" in origin:
        return False
    if os.path.basename(origin) == "__init__.py":  # a package: ship it zipped
        pkg_dir = os.path.dirname(origin)
        zpath = os.path.join(tempfile.mkdtemp(prefix="charon-app-"), f"{os.path.basename(pkg_dir)}.zip")
        with zipfile.ZipFile(zpath, "w") as z:
            for root, _, files in os.walk(pkg_dir):
                for f in files:
                    if f.endswith(".py"):
                        full = os.path.join(root, f)
                        z.write(full, os.path.relpath(full, os.path.dirname(pkg_dir)))
        spark.sparkContext.addPyFile(zpath)
    else:
        spark.sparkContext.addPyFile(origin)
    return True
