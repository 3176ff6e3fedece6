"""`charon run` as a user starts and stops it (issue 9): flags fall back to their environment variables, the
Spark engine's port opens at once (503 ``starting`` until Spark is up, invokes logged meanwhile), and a
SIGINT under load exits 0 quickly, prints no traceback or Java error, and loses nothing acknowledged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from charon import serde
from charon.config import SparkConfig
from charon.core.routing import store_key
from charon.server.serve import free_port

TOKEN = "lifecycle-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _start(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "charon.cli", "run", "charon.apps.ycsb:app", "--port", str(port), "--token", TOKEN,
         *args],
        env={**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable, **(env or {})},
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    return proc, f"http://127.0.0.1:{port}"


def _wait_port(proc: subprocess.Popen, url: str, timeout: float) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(url + "/health", timeout=5)
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise AssertionError(f"charon run exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"the port did not open within {timeout} s")
        time.sleep(0.05)


def _stop(proc: subprocess.Popen, timeout: float = 30) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return proc.returncode, proc.stderr.read().decode() if proc.stderr else ""


@pytest.mark.parametrize(("flag", "env", "want"), [([], "3", 3), (["--partitions", "2"], "3", 2), ([], None, 4)])
def test_partitions_flag_falls_back_to_the_environment(
    tmp_path: Path, flag: list[str], env: str | None, want: int
) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "CHARON_PARTITIONS"}
    if env is not None:
        environ["CHARON_PARTITIONS"] = env
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "charon.cli", "run", "charon.apps.ycsb:app", "--ephemeral", "--token", TOKEN, *flag],
        env={**environ, "CHARON_PORT": str(port)}, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert _wait_port(proc, f"http://127.0.0.1:{port}", 30).status_code == 200  # CHARON_PORT applied too
    finally:
        code, err = _stop(proc)
    assert code == 0, err
    assert f"(inprocess, {want} partitions;" in err, err


def test_max_body_flag_falls_back_to_the_environment(tmp_path: Path) -> None:
    proc, url = _start(["--ephemeral"], {"CHARON_GATEWAY_MAX_BODY": "100"}, tmp_path)
    try:
        _wait_port(proc, url, 30)
        r = httpx.post(url + "/invoke/account/a/deposit", json={"args": [1], "pad": "x" * 200}, headers=AUTH)
        assert r.status_code == 413, r.text
    finally:
        code, err = _stop(proc)
    assert code == 0, err


@pytest.mark.spark
def test_spark_port_opens_at_once_and_sigint_under_load_exits_cleanly(tmp_path: Path) -> None:
    data = tmp_path / "data"
    t0 = time.monotonic()
    proc, url = _start(["--engine", "spark", "--partitions", "2", "--data-dir", str(data)],
                       {"CHARON_MASTER": "local[2]"}, tmp_path)
    acked: dict[str, int] = {}
    try:
        first = _wait_port(proc, url, 90)  # the gateway process's own start (seconds on a loaded host)
        opened = time.monotonic() - t0
        # the port is open long before Spark is (its JVM alone takes seconds): the gateway says so
        assert first.status_code == 200 or first.json()["status"] == "starting", (opened, first.text)
        early = httpx.post(url + "/invoke/account/early/deposit?mode=async", json={"args": [5]},
                           headers={**AUTH, "Idempotency-Key": "early-1"})
        assert early.status_code == 202, early.text  # accepted into the durable input log
        st = httpx.get(url + "/state/account/early", headers=AUTH)
        if st.status_code == 503:  # still starting (state reads need the engine)
            assert st.headers["retry-after"].isdigit() and st.json()["error"]["type"] == "Unavailable"
        deadline = time.monotonic() + 240
        while httpx.get(url + "/health", timeout=10).status_code != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "Spark did not come up"
            time.sleep(0.2)
        r = httpx.get(url + "/requests/early-1?wait=30", headers=AUTH, timeout=40)
        assert r.status_code == 200 and r.json()["status"] == "committed", r.text
        acked["early"] = 5

        # load from a few clients; SIGINT while requests are in flight (epochs running)
        stop = threading.Event()
        lock = threading.Lock()

        def client(i: int) -> None:
            with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
                n = 0
                while not stop.is_set():
                    key, rid = f"k{i}", uuid.uuid4().hex
                    try:
                        r = c.post(f"/invoke/account/{key}/deposit", json={"args": [1]},
                                   headers={"Idempotency-Key": rid})
                    except httpx.HTTPError:
                        return  # the server went away mid-request: not acknowledged
                    if r.status_code == 200:
                        n += 1
                        with lock:
                            acked[key] = n

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(6)
        with lock:
            assert sum(acked.values()) > 5, acked  # epochs are running
        t_int = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
        proc.wait(60)
        took = time.monotonic() - t_int
        stop.set()
        for t in threads:
            t.join(70)
    finally:
        stop_code, err = _stop(proc, 60)
    assert stop_code == 0, err
    assert took < 45, took
    for bad in ("Traceback", "StackOverflowError", "Exception", "ERROR"):
        assert bad not in err, err
    # everything acknowledged is in the durable copy as of the last recorded epoch (the stop finished its
    # epoch), read without starting Spark
    from charon.runtime.spark.runtime import SparkRuntime

    rt = SparkRuntime("charon.apps.ycsb:app", SparkConfig(data_dir=str(data), partitions=2))
    snap = rt.snapshot()
    for key, n in acked.items():
        raw = snap.get(store_key("account", key))
        assert raw is not None and serde.decode(raw) >= n, (key, n, raw)


@pytest.mark.spark
def test_spark_start_failure_turns_health_red_and_exits_unavailable(tmp_path: Path) -> None:
    proc, url = _start(["--engine", "spark", "--data-dir", str(tmp_path / "data")],
                       {"CHARON_MASTER": "nonsense://nowhere"}, tmp_path)
    try:
        try:  # the gateway process answers 503 starting, unless Spark failed before it came up (a loaded host)
            first = _wait_port(proc, url, 60)
            assert first.status_code == 503 and first.json()["status"] in ("starting", "failed", "driver unreachable")
        except AssertionError:
            assert proc.poll() == 3
        proc.wait(180)
    finally:
        code, err = _stop(proc)
    assert code == 3, err  # ExitCode.UNAVAILABLE
    assert "did not start" in err and "Traceback" not in err, err
