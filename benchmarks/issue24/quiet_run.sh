#!/usr/bin/env bash
# The quiet run of issue 24 (nothing else running on the machine). Usage: bash benchmarks/issue24/quiet_run.sh .
# /tmp/gw-main: the baseline, `mkdir /tmp/gw-main && git archive 35ccc3b charon | tar -x -C /tmp/gw-main`, with
# uvloop blocked (`mkdir /tmp/gw-main/uvloop && echo "raise ImportError" > /tmp/gw-main/uvloop/__init__.py`).
set -x
cd "$1"
export JAVA_HOME=$(cat .venv/java-home) PYSPARK_PYTHON=$PWD/.venv/bin/python PYSPARK_DRIVER_PYTHON=$PWD/.venv/bin/python PATH=$PATH:/usr/sbin
uptime
# 0. the engine alone, before (main 35ccc3b) and after, alternating
.venv/bin/python benchmarks/issue24/engine_ab.py --before-src /tmp/gw-main --repeat 6 --out benchmarks/issue24/engine_ab_quiet.json
uptime
# 1. gateway CPU per request, baseline (main 35ccc3b, no uvloop) and now, alternating
for i in 1 2; do
  .venv/bin/python benchmarks/issue24/gateway_cpu.py --concurrency 1,16,64 --duration 10 --src /tmp/gw-main --out benchmarks/issue24/quiet_gateway_base_$i.json
  .venv/bin/python benchmarks/issue24/gateway_cpu.py --concurrency 1,16,64 --duration 10 --out benchmarks/issue24/quiet_gateway_now_$i.json
done
uptime
# 2. end to end through HTTP: baseline node, node now, PostgreSQL (RC, SERIALIZABLE), Spark
.venv/bin/python benchmarks/e2e/run.py --targets charon-base,charon,pg-rc,pg-ser --spark --base-src /tmp/gw-main \
   --rates 500,1000,2000,4000,6000,8000,10000,12000 --duration 10 --pool-sweep 4,8,16,32 --pool-rate 2000 \
   --out benchmarks/e2e/results.json
uptime
# 3. the results tables (engine, suite, spark_max) and the plug-ins
.venv/bin/python benchmarks/results.py run
uptime
# 4. Spark scaling: standalone cluster one vs two Workers
.venv/bin/python benchmarks/issue24/spark_scaling.py --mode cluster --cores 1,2 --sizes 2000,10000 --epochs 10 --repeat 2 --set split_rest=cluster --out benchmarks/issue24/spark_scaling
uptime
.venv/bin/python benchmarks/results.py render
