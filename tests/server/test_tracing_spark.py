"""OpenTelemetry traces on the Spark engine (issue 26): a transfer through a real gateway over a real PySpark
runtime (local[2]) keeps the client's trace and gets its epoch span, placed by the driver's epoch record (Spark
records an epoch after its replies: the gateway waits for the figures), and under it one span per function of its
call graph from the Spark runtime's invocation inspector; an aborted transfer's raising function is marked."""

from __future__ import annotations

import time

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from charon.apps import ycsb
from charon.config import SparkConfig
from charon.runtime.spark.runtime import SparkRuntime
from charon.server.serve import BackgroundServer

pytestmark = pytest.mark.spark
TOKEN = "trace-spark"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


def test_a_transfer_traced_on_spark(spark, tmp_path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, log_partitions=1, idle_wait_ms=100)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg, spark=spark)
    rt.load("account", ycsb.initial_state(4, 100))
    srv = BackgroundServer(rt, token=TOKEN, tracer_provider=provider).start(timeout=120)
    try:
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
            r = c.post(f"/invoke/account/{ycsb.key(0)}/transfer", json={"args": [ycsb.key(1), 30]},
                       headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "Idempotency-Key": "spark-t1"})
            assert r.status_code == 200, r.text
            reply = r.json()
            bad = c.post(f"/invoke/account/{ycsb.key(2)}/transfer", json={"args": [ycsb.key(1), 10_000]})
            assert bad.status_code == 409
        deadline = time.monotonic() + 30
        while sum(s.name == "account.transfer" for s in exporter.get_finished_spans()) < 2:
            assert time.monotonic() < deadline, [s.name for s in exporter.get_finished_spans()]
            time.sleep(0.05)
    finally:
        srv.stop()
        rt.close()
    spans = [s for s in exporter.get_finished_spans() if format(s.context.trace_id, "032x") == TRACE_ID]
    server = next(s for s in spans if s.kind is SpanKind.SERVER)
    epoch = next(s for s in spans if s.name == "charon.epoch")
    assert format(server.parent.span_id, "016x") == PARENT_ID
    assert epoch.parent.span_id == server.context.span_id
    assert (server.attributes["charon.epoch"], server.attributes["charon.tid"], server.attributes["charon.position"]) \
        == (reply["epoch"], reply["tid"], reply["position"]) == \
        (epoch.attributes["charon.epoch"], epoch.attributes["charon.tid"], epoch.attributes["charon.position"])
    assert epoch.start_time < epoch.end_time and epoch.attributes["charon.epoch.size"] >= 1
    assert not any(s.name == "charon.log.append" for s in spans)  # Spark's append is the submit's own
    transfer = next(s for s in spans if s.name == "account.transfer")
    deposit = next(s for s in spans if s.name == "account.deposit")
    assert transfer.parent.span_id == epoch.context.span_id and deposit.parent.span_id == transfer.context.span_id
    ident = {"charon.request_id": "spark-t1", "charon.epoch": reply["epoch"], "charon.tid": reply["tid"],
             "charon.position": reply["position"]}
    assert dict(transfer.attributes) == {**ident, "charon.operator": "account", "charon.function": "transfer",
                                         "charon.key": ycsb.key(0), "charon.call.kind": "root",
                                         "charon.call.index": 0}
    assert dict(deposit.attributes) == {**ident, "charon.operator": "account", "charon.function": "deposit",
                                        "charon.key": ycsb.key(1), "charon.call.kind": "call", "charon.call.index": 1}
    assert (deposit.start_time, deposit.end_time) == (epoch.start_time, epoch.end_time)
    aborted = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER and s is not server]
    assert aborted and aborted[0].status.status_code is StatusCode.ERROR
    assert aborted[0].attributes["charon.error_type"] == "NotEnoughCredit"
    mine = [s for s in exporter.get_finished_spans() if s.context.trace_id == aborted[0].context.trace_id]
    raised = next(s for s in mine if s.name == "account.transfer")  # the root raised: no deposit ran
    assert not any(s.name == "account.deposit" for s in mine)
    assert raised.status.status_code is StatusCode.ERROR and raised.attributes["error.type"] == "NotEnoughCredit"
    assert [(e.name, e.attributes["exception.type"]) for e in raised.events] == [("exception", "NotEnoughCredit")]
