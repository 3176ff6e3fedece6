"""Run the benchmark suite (JSON, PNG plots and a report in ``--out``, default
benchmarks/results/workloads/suite) in one command.

benchmarks/RESULTS.md itself is rendered by ``benchmarks/run.py`` (which runs this suite among others).

    .venv/bin/python benchmarks/workloads/suite.py --systems inprocess,postgres,spark

The suite lives in :mod:`charon.bench.suite` (also reachable as ``charon bench``); see its ``--help``.
"""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    os.chdir(Path(__file__).resolve().parents[2])
    from charon.bench.harness import run
    from charon.bench.suite import main

    raise SystemExit(run(main(sys.argv[1:])))
