#!/usr/bin/env bash
# Create or refresh the project's virtual environment in .venv and install Charon with its dev tools.
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
if ! command -v java >/dev/null 2>&1; then
  echo "[charon] Java 17+ is required by Spark; install a JDK (e.g. apt-get install openjdk-17-jre-headless)" >&2
  exit 1
fi
