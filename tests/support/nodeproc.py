"""``charon run`` (or another ``charon`` command) in a subprocess for the real-process tests: start it with its
output in a log file, wait for its ``/health``, kill it. One helper for the fault, bulk, effects and Spark tests that
each wrote "start a node, poll /health, assert it is alive" again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

SUPPORT = Path(__file__).resolve().parent


def support_env(**extra: str) -> dict[str, str]:
    """This environment with ``tests/support`` first on ``PYTHONPATH`` (the test apps), plus ``extra``."""
    path = os.pathsep.join(p for p in (str(SUPPORT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def tail(log: Path | None, chars: int = 3000) -> str:
    """The end of a child's log (empty when there is none yet)."""
    if log is None or not log.exists():
        return ""
    return log.read_text(errors="replace")[-chars:]


def wait_healthy(proc: subprocess.Popen[Any], url: str, *, timeout: float = 60.0, log: Path | None = None,
                 interval: float = 0.1) -> float:
    """Poll ``url``/health until it answers 200; the seconds it took. Fails (with the log's end) when the process
    exits first or ``timeout`` passes."""
    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        code = proc.poll()
        assert code is None, f"the server exited ({code}) during start-up:\n{tail(log)}"
        assert time.monotonic() - t0 < timeout, f"not healthy in {timeout} s:\n{tail(log)}"
        time.sleep(interval)


def start_charon(args: Sequence[str], *, port: int, log: Path, env: Mapping[str, str] | None = None,
                 timeout: float = 60.0, group: bool = False, stdout: bool = False, cwd: Path | None = None,
                 interval: float = 0.1) -> subprocess.Popen[bytes]:
    """``python -m charon.cli <args> --port <port>``, its stderr to ``log`` (appended; its stdout too with
    ``stdout``, else dropped), up and healthy. ``group``: in a session of its own (:func:`kill` then signals its
    whole process group: Spark's JVM too)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "charon.cli", *args, "--port", str(port)],
                                env=dict(env) if env is not None else None, cwd=cwd,
                                stdout=out if stdout else subprocess.DEVNULL, stderr=out, start_new_session=group)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", timeout=timeout, log=log, interval=interval)
    except BaseException:
        kill(proc, group=group)
        raise
    return proc


def kill(proc: subprocess.Popen[Any] | None, sig: int = signal.SIGKILL, *, group: bool = False,
         timeout: float = 60.0) -> None:
    """Send ``sig`` (SIGKILL unless told) to a live process (to its process group with ``group``) and reap it."""
    if proc is None:
        return
    if proc.poll() is None:
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass
    proc.wait(timeout)


def kill_tree(proc: subprocess.Popen[Any] | None, *, timeout: float = 10.0) -> float:
    """SIGKILL ``proc``'s process group and wait until every process of its tree is gone (at most ``timeout``): a
    Spark driver's JVM dies with the group, but PySpark's worker daemon runs in a process group of its own and
    exits once the JVM's pipe closes. Replaces a fixed sleep after the kill; returns the seconds waited."""
    import psutil

    if proc is None:
        return 0.0
    try:
        family = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    except psutil.NoSuchProcess:
        family = []
    t0 = time.monotonic()
    kill(proc, group=True)
    psutil.wait_procs(family, timeout=timeout)
    return time.monotonic() - t0
