"""The cost of OpenTelemetry tracing per request, off and on, through HTTP on the durable in-process node.

Modes, alternated round by round (so that the machine's drift hits each alike):
- ``before``: the server from the commit before tracing and the log setup existed (``--base``, default
  ``f37e7bc``, exported with ``git archive`` into a temporary directory and put first on ``PYTHONPATH``);
- ``off``: this checkout, tracing off (the default);
- ``off_asgi``: this checkout, tracing off, invokes through the ASGI route (``CHARON_GATEWAY_DIRECT_INVOKE=0``),
  as traced ones take it: ``on`` minus ``off_asgi`` is the spans' own cost, ``off_asgi`` minus ``off`` the lane's;
- ``on``: this checkout, ``--otel-endpoint`` naming a local OTLP/HTTP receiver (a separate process that decodes
  each export and counts its spans), so the spans are built, batched, encoded and sent: per transfer the server,
  log append and epoch spans and one span per function of its call graph (``account.transfer`` and its call
  ``account.deposit``);
- ``on_nofn``: ``on`` without function spans (``CHARON_GATEWAY_OTEL_FUNCTION_SPANS=0``): ``on`` minus ``on_nofn`` is
  the function spans' cost;
- ``on_shared``: ``on`` with one epoch span per epoch (``CHARON_GATEWAY_OTEL_SHARED_EPOCH_SPANS=1``, linked to its
  requests, the log append under it) instead of an epoch and a log span under each request;
- ``on_10pct``: ``on`` with ``CHARON_GATEWAY_OTEL_SAMPLE_RATIO=0.1``: one request in ten traced (the others take the
  ASGI route with a span that records nothing).
Then, in this process, the SDK alone (``sdk_only`` in the JSON; ``--sdk-only`` runs just that): the spans of one
request made through :class:`charon.server.tracing.Tracing` (as the gateway makes them once a reply is in) with the
SDK's batch processor, for call graphs of 0, 2 and 4 functions, with the OTLP protobuf encoding and without it.
Each round starts ``charon run charon.apps.ycsb:app`` (fsync per epoch) afresh, seeds the accounts, drives YCSB-T
transfers with gateway_cpu.py's lean closed-loop client (keep-alive HTTP/1.1, one Idempotency-Key each) and reads the
server's CPU seconds (psutil) over the window: CPU per request = delta / requests. JSON and a PNG.

    .venv/bin/python benchmarks/observability/tracing_cost.py --rounds 3 --duration 10 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil

from charon.bench.engines import free_port, start_node, wait_healthy

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = ROOT / "benchmarks" / "results" / "observability"
TOKEN = "t24"  # the token gateway_cpu's client sends
KEYS = 1000
MODES = ("before", "off", "off_asgi", "on", "on_nofn", "on_shared", "on_10pct")

_spec = importlib.util.spec_from_file_location("gateway_cpu", ROOT / "benchmarks" / "gateway" / "gateway_cpu.py")
assert _spec is not None and _spec.loader is not None
gateway_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gateway_cpu)

RECEIVER = r'''
import http.server, sys
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
spans = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        global spans
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        spans += sum(len(s.spans) for r in msg.resource_spans for s in r.scope_spans)
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def do_GET(self):
        body = str(spans).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


def one_round(mode: str, base_src: str, receiver: str, args: argparse.Namespace) -> dict:
    cmd: list[str] = []
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("OTEL_")}
    if mode.startswith("on"):
        cmd += ["--otel-endpoint", receiver]
    if mode == "on_nofn":
        env["CHARON_GATEWAY_OTEL_FUNCTION_SPANS"] = "0"
    if mode == "on_shared":
        env["CHARON_GATEWAY_OTEL_SHARED_EPOCH_SPANS"] = "1"
    if mode == "on_10pct":
        env["CHARON_GATEWAY_OTEL_SAMPLE_RATIO"] = "0.1"
    if mode == "off_asgi":
        env["CHARON_GATEWAY_DIRECT_INVOKE"] = "0"
    node = start_node("charon.apps.ycsb:app", engine="inprocess", token=TOKEN, args=cmd, env=env,
                      src=base_src if mode == "before" else ROOT)
    try:
        node.seed(KEYS, 1_000_000, timeout=120)
        spans0 = int(httpx.get(receiver).text)
        load0 = os.getloadavg()[0]
        row = asyncio.run(gateway_cpu.drive(node.url, args.concurrency, args.duration, args.warmup,
                                            psutil.Process(node.pid)))
        row.pop("server_thread_cpu_s", None)
        row["loadavg_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    finally:
        node.stop()
    row["spans_received"] = int(httpx.get(receiver).text) - spans0  # after the shutdown's flush
    row["mode"] = mode
    return row


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "server_cpu_us_per_request", "server CPU per request (µs)"),
                           (axes[1], "p50", "latency p50 (ms)")):
        for i, mode in enumerate(MODES):
            vals = [(r["latency_ms"]["p50"] if key == "p50" else r[key]) for r in rows if r["mode"] == mode]
            colors = ("#999999", "#4c72b0", "#55a868", "#dd8452", "#c44e52", "#8172b3", "#937860")
            ax.bar(i, statistics.median(vals), color=colors[i], alpha=0.7)
            ax.scatter([i] * len(vals), vals, color="black", s=12, zorder=3)
        ax.set_xticks(range(len(MODES)), MODES)
        ax.set_ylabel(label)
    fig.suptitle(f"tracing cost, durable in-process node, c={doc['concurrency']} "
                 f"({doc['rounds']} alternating rounds; bars: median, dots: rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def sdk_only(requests: int = 5000, functions: tuple[int, ...] = (0, 2, 4)) -> dict[str, float]:
    """CPU µs per request (this process, export thread included) of the spans :class:`Tracing` makes for one
    reply (server span, log append, epoch, ``n`` function spans), batched, then OTLP-encoded or dropped."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from charon.messages import Reply
    from charon.server.tracing import Tracing

    class Encoder(SpanExporter):
        def __init__(self, encode: bool) -> None:
            self.encode = encode

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            if self.encode:
                encode_spans(spans).SerializeToString()
            return SpanExportResult.SUCCESS

    out: dict[str, float] = {}
    for encode in (True, False):
        for n in functions:
            provider = TracerProvider()
            provider.add_span_processor(BatchSpanProcessor(Encoder(encode), max_queue_size=requests * (3 + n),
                                                           max_export_batch_size=512))
            now = time.time()
            records = [{"epoch": e, "started_at": now, "duration_ms": 1.0, "size": 10.0, "rounds": 1.0,
                        "committed": 10.0, "aborted": 0.0, "conflicts": 0.0, "log_started_at": now, "log_ms": 0.2}
                       for e in range(requests // 10 + 1)]
            stats: list[dict[str, float]] = []
            nodes = [{"index": i, "parent": None if i == 0 else 0, "kind": "root" if i == 0 else "call",
                      "operator": "account", "key": f"a{i}", "function": "transfer" if i == 0 else "deposit",
                      "outcome": "ok"} for i in range(n)]
            tracing = Tracing(provider, lambda s=stats: s, call_graph_of=lambda rid, g=nodes: g)
            replies = [Reply(request_id=f"r{i}", tid=i, epoch=i // 10, ok=True, position=i % 10)
                       for i in range(requests)]
            c0 = time.process_time()
            for r in replies:
                if r.position == 0:  # the engine records an epoch before its replies go out
                    stats.append(records[r.epoch])
                with tracing.tracer.start_as_current_span(
                        "POST /invoke/{operator}/{key}/{function}",
                        attributes={"charon.operator": "account", "charon.key": "a0", "charon.function": "transfer",
                                    "charon.request_id": r.request_id}) as span:
                    span.set_attributes({"charon.epoch": r.epoch, "charon.tid": r.tid, "charon.position": 0})
                    tracing._epoch_spans(span, r, 0)
            provider.force_flush()
            out[f"{'encoded' if encode else 'not_encoded'}_{n}_functions_us"] = round(
                (time.process_time() - c0) / requests * 1e6, 1)
            provider.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--duration", type=float, default=10)
    ap.add_argument("--warmup", type=float, default=2)
    ap.add_argument("--base", default="f37e7bc", help="the commit whose server is 'before'")
    ap.add_argument("--out", default=str(OUT / "tracing_cost.json"))
    ap.add_argument("--sdk-only", action="store_true", help="only the in-process SDK measurement (printed)")
    args = ap.parse_args(argv)
    spans_alone = sdk_only()
    print(json.dumps({"sdk_only": spans_alone}), flush=True)
    if args.sdk_only:
        return 0
    base_src = tempfile.mkdtemp(prefix="charon-i26-base-")
    archive = subprocess.run(["git", "archive", args.base, "charon"], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", base_src], input=archive.stdout, check=True)
    rport = free_port()
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(rport)])
    rows = []
    try:
        wait_healthy(f"http://127.0.0.1:{rport}", receiver)  # the receiver answers any GET
        for rnd in range(args.rounds):
            for mode in MODES:
                row = one_round(mode, base_src, f"http://127.0.0.1:{rport}", args)
                row["round"] = rnd
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("mode", "round", "requests_per_s",
                                                      "server_cpu_us_per_request", "spans_received")}), flush=True)
    finally:
        receiver.terminate()
        receiver.wait(10)
        shutil.rmtree(base_src, ignore_errors=True)
    summary = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {"server_cpu_us_per_request_median": statistics.median(r["server_cpu_us_per_request"]
                                                                               for r in mine),
                         "requests_per_s_median": statistics.median(r["requests_per_s"] for r in mine),
                         "p50_ms_median": statistics.median(r["latency_ms"]["p50"] for r in mine),
                         "spans_per_request_incl_warmup": round(sum(r["spans_received"] for r in mine)
                                                    / max(1, sum(r["requests"] for r in mine)), 2)}
    doc = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "cpus": os.cpu_count(),
           "concurrency": args.concurrency, "rounds": args.rounds, "duration_s": args.duration, "base": args.base,
           "summary": summary, "sdk_only": spans_alone, "rows": rows}
    out = Path(args.out)
    out.write_text(json.dumps(doc, indent=1))
    plot(doc, out.with_suffix(".png"))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
