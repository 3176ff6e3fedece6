"""OpenTelemetry traces (issue 26): a transfer through a real gateway (uvicorn on a port, a durable in-process
node) leaves a server span under the client's ``traceparent``, the log append and the epoch under it, with the
request's epoch, tid and position, one span per function of its call graph (from the invocation inspector);
an aborted one marks the function that raised; the guide's sample trace is what the exporter receives; the
call-graph converter turns the inspector's nodes into a tree of function spans; off, the direct invoke lane
serves and no span exists; the OTLP/HTTP exporter delivers to a real HTTP receiver that decodes the protobuf."""

from __future__ import annotations

import http.server
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from charon import Application, Context, InProcessRuntime, Operator
from charon.config import GatewayConfig
from charon.runtime.control.inspector import InspectorSettings
from charon.server.serve import BackgroundServer
from charon.server.tracing import CallGraphError, call_graph_spans, otlp_endpoint
from tests.support.contract_app import v1 as APP

TOKEN = "trace-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class InsufficientFunds(Exception):
    """The bank app's abort: an account short of the amount."""


def _bank() -> Application:
    """A transfer that is its own function (``bank.transfer`` on the transfer's id) calling ``acct.withdraw`` on
    the payer, then ``acct.deposit`` on the payee: a call graph of three functions."""
    acct, bank = Operator("acct"), Operator("bank")

    @acct.function(public=True)
    async def deposit(ctx: Context, amount: int) -> int:
        ctx.put(ctx.get(default=0) + amount)
        return int(ctx.get())

    @acct.function(public=True)
    async def withdraw(ctx: Context, amount: int) -> int:
        b = ctx.get(default=0)
        if b < amount:
            raise InsufficientFunds(f"{ctx.key} has {b}, needs {amount}")
        ctx.put(b - amount)
        return b - amount

    @bank.function(public=True)
    async def transfer(ctx: Context, src: str, dst: str, amount: int) -> int:
        left = await ctx.call(acct, src, "withdraw", amount)
        await ctx.call(acct, dst, "deposit", amount)
        return int(left)

    return Application("bank", [acct, bank])


BANK = _bank()
SERVER = "POST /invoke/{operator}/{key}/{function}"
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "tracing.md"
BEGIN, END = "<!-- received-spans:begin -->", "<!-- received-spans:end -->"


def _children(spans: list) -> dict[int | None, list]:
    """Spans by their parent's span id (None: the trace's root here), each list in start, then call, order."""
    ids = {s.context.span_id for s in spans}
    out: dict[int | None, list] = {}
    for s in spans:
        up = s.parent.span_id if s.parent is not None and s.parent.span_id in ids else None
        out.setdefault(up, []).append(s)
    for kids in out.values():
        kids.sort(key=lambda s: (s.start_time, s.attributes.get("charon.call.index", -1), s.name))
    return out


def _render(spans: list) -> list[str]:
    """The spans as a tree: a line per span (name, kind, remote parent, error status), then its attributes (http.*
    and the epoch's figures left out) in braces."""
    kids = _children(spans)
    lines: list[str] = []

    def walk(span, prefix: str, last: bool, top: bool) -> None:
        head = "" if top else prefix + ("└── " if last else "├── ")
        attrs = {k: v for k, v in span.attributes.items() if not k.startswith(("http.", "charon.epoch."))}
        tags = [span.kind.name] if span.kind is not SpanKind.INTERNAL else []
        if top and span.parent is not None and span.parent.is_remote:
            tags.append("parent=traceparent")
        if span.status.status_code is StatusCode.ERROR:
            tags.append("status=ERROR")
        lines.append(f"{head}{span.name}" + ("  " + " ".join(tags) if tags else ""))
        more = prefix + ("" if top else ("    " if last else "│   "))
        below = kids.get(span.context.span_id, [])
        pairs = [f"{k}={v}" for k, v in sorted(attrs.items())]
        for i in range(0, len(pairs), 4):  # the attributes, four a line, in braces under the name
            lines.append(more + ("│" if below else " ") + "   {" + ", ".join(pairs[i:i + 4]) + "}")
        for i, k in enumerate(below):
            walk(k, more, i == len(below) - 1, False)

    roots = kids.get(None, [])
    for r in roots:
        walk(r, "", True, True)
    return lines


def _shape(lines: list[str]) -> list[tuple[int, str]]:
    """(depth, span name) of each rendered line: the tree's names and parent links, not the varying values."""
    out = []
    for line in lines:
        if line.lstrip("│ ").startswith("{"):  # a line of attributes
            continue
        m = re.match(r"^((?:│   |    )*)(?:├── |└── )?(\S+(?: /\S+)?)(?:  |$)", line)
        assert m, line
        depth = len(m.group(1)) // 4 + (1 if line[len(m.group(1)):].startswith(("├", "└")) else 0)
        out.append((depth, m.group(2)))
    return out


def _guide_block() -> list[str]:
    text = GUIDE.read_text()
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return body.strip().removeprefix("```text").removesuffix("```").strip("\n").splitlines()


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _wait_spans(exporter: InMemorySpanExporter, names: set[str], timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        spans = list(exporter.get_finished_spans())
        if names <= {s.name for s in spans}:
            return spans
        assert time.monotonic() < deadline, f"spans seen: {[s.name for s in spans]}"
        time.sleep(0.02)


def test_a_transfer_traced_through_a_real_gateway(tmp_path: Path) -> None:
    provider, exporter = _provider()
    rt = InProcessRuntime(APP, partitions=2, data_dir=str(tmp_path))
    with BackgroundServer(rt, token=TOKEN, tracer_provider=provider) as srv, \
            httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
        assert srv.app.direct is None  # traced invokes take the ASGI route
        assert c.post("/invoke/acct/alice/deposit", json={"args": [100]}).status_code == 200
        exporter.clear()
        r = c.post("/invoke/acct/alice/transfer", json={"args": ["bob", 40]},
                   headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "Idempotency-Key": "transfer-1"})
        assert r.status_code == 200, r.text
        reply = r.json()
        spans = _wait_spans(exporter, {"POST /invoke/{operator}/{key}/{function}", "charon.log.append",
                                       "charon.epoch"})
    by_name = {s.name: s for s in spans}
    server = by_name["POST /invoke/{operator}/{key}/{function}"]
    log, epoch = by_name["charon.log.append"], by_name["charon.epoch"]
    # the client's trace goes on: same trace id, the server span's parent is the client's span
    assert {format(s.context.trace_id, "032x") for s in spans} == {TRACE_ID}
    assert server.kind is SpanKind.SERVER and format(server.parent.span_id, "016x") == PARENT_ID
    assert server.parent.is_remote
    assert log.parent.span_id == server.context.span_id and epoch.parent.span_id == server.context.span_id
    attrs = dict(server.attributes)
    assert attrs["charon.operator"] == "acct" and attrs["charon.function"] == "transfer"
    assert attrs["charon.key"] == "alice" and attrs["charon.request_id"] == "transfer-1"
    assert (attrs["charon.epoch"], attrs["charon.tid"], attrs["charon.position"]) == \
        (reply["epoch"], reply["tid"], reply["position"])
    assert attrs["http.response.status_code"] == 200
    for child in (log, epoch):
        assert child.attributes["charon.request_id"] == "transfer-1"
        assert child.attributes["charon.epoch"] == reply["epoch"]
    assert epoch.attributes["charon.epoch.size"] >= 1
    # the engine's own timings place them: the append before the epoch, both inside the request
    assert server.start_time <= log.start_time <= log.end_time <= epoch.start_time + 1_000_000
    assert epoch.end_time <= server.end_time + 5_000_000
    assert server.status.status_code is StatusCode.UNSET


def test_one_transfer_as_the_exporter_received_it(tmp_path: Path) -> None:
    """The full tree of one traced transfer: the server span under the client's traceparent, the log append and
    the epoch under it, and under the epoch one span per function of the call graph (bank.transfer, then its
    calls acct.withdraw and acct.deposit), each with the request's charon.* identity and its own function's."""
    provider, exporter = _provider()
    rt = InProcessRuntime(BANK, partitions=2, data_dir=str(tmp_path))
    with BackgroundServer(rt, token=TOKEN, tracer_provider=provider) as srv, \
            httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
        assert c.post("/invoke/acct/alice/deposit", json={"args": [100]}).status_code == 200
        _wait_spans(exporter, {"acct.deposit"})
        exporter.clear()
        r = c.post("/invoke/bank/t1/transfer", json={"args": ["alice", "bob", 40]},
                   headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "Idempotency-Key": "transfer-1"})
        assert r.status_code == 200, r.text
        reply = r.json()
        spans = _wait_spans(exporter, {SERVER, "charon.log.append", "charon.epoch", "bank.transfer",
                                       "acct.withdraw", "acct.deposit"})
    assert len(spans) == 6 and {format(s.context.trace_id, "032x") for s in spans} == {TRACE_ID}
    by_name = {s.name: s for s in spans}
    server, log, epoch = by_name[SERVER], by_name["charon.log.append"], by_name["charon.epoch"]
    transfer, withdraw, deposit = by_name["bank.transfer"], by_name["acct.withdraw"], by_name["acct.deposit"]
    assert format(server.parent.span_id, "016x") == PARENT_ID and server.parent.is_remote
    assert log.parent.span_id == server.context.span_id and epoch.parent.span_id == server.context.span_id
    assert transfer.parent.span_id == epoch.context.span_id
    assert withdraw.parent.span_id == transfer.context.span_id and deposit.parent.span_id == transfer.context.span_id
    ident = {"charon.request_id": "transfer-1", "charon.epoch": reply["epoch"], "charon.tid": reply["tid"],
             "charon.position": reply["position"]}
    for span, (op, fn, key, kind, index) in ((transfer, ("bank", "transfer", "t1", "root", 0)),
                                             (withdraw, ("acct", "withdraw", "alice", "call", 1)),
                                             (deposit, ("acct", "deposit", "bob", "call", 2))):
        assert span.kind is SpanKind.INTERNAL and span.status.status_code is StatusCode.UNSET
        assert dict(span.attributes) == {**ident, "charon.operator": op, "charon.function": fn, "charon.key": key,
                                         "charon.call.kind": kind, "charon.call.index": index}
        # the call graph has no timings: each function covers its epoch
        assert (span.start_time, span.end_time) == (epoch.start_time, epoch.end_time)
    for span in (log, epoch):
        assert {k: span.attributes[k] for k in ident} == ident
    # the guide's sample is this trace: the same names under the same parents
    lines = _render(spans)
    if os.environ.get("CHARON_WRITE_GUIDE"):  # regenerate the guide's block from this run
        text = GUIDE.read_text()
        head, rest = text.split(BEGIN, 1)
        GUIDE.write_text(head + BEGIN + "\n```text\n" + "\n".join(lines) + "\n```\n" + END + rest.split(END, 1)[1])
    assert _shape(_guide_block()) == _shape(lines) == [
        (0, SERVER), (1, "charon.log.append"), (1, "charon.epoch"), (2, "bank.transfer"), (3, "acct.withdraw"),
        (3, "acct.deposit")]


def test_an_aborted_transfer_marks_the_function_that_raised(tmp_path: Path) -> None:
    """bob has nothing: acct.withdraw raises, its span has status error, error.type and an exception event;
    the transfer that called it is not the one that raised; deposit never ran, so it has no span."""
    provider, exporter = _provider()
    rt = InProcessRuntime(BANK, partitions=2, data_dir=str(tmp_path))
    with BackgroundServer(rt, token=TOKEN, tracer_provider=provider) as srv, \
            httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
        r = c.post("/invoke/bank/t2/transfer", json={"args": ["bob", "alice", 5]},
                   headers={"Idempotency-Key": "transfer-2"})
        assert r.status_code == 409 and r.json()["error"]["type"] == "InsufficientFunds", r.text
        spans = _wait_spans(exporter, {SERVER, "charon.epoch", "bank.transfer", "acct.withdraw"})
    by_name = {s.name: s for s in spans}
    assert "acct.deposit" not in by_name
    server, epoch = by_name[SERVER], by_name["charon.epoch"]
    transfer, withdraw = by_name["bank.transfer"], by_name["acct.withdraw"]
    assert withdraw.parent.span_id == transfer.context.span_id and transfer.parent.span_id == epoch.context.span_id
    assert withdraw.status.status_code is StatusCode.ERROR
    assert withdraw.status.description.startswith("InsufficientFunds: ") and "needs 5" in withdraw.status.description
    assert withdraw.attributes["error.type"] == "InsufficientFunds"
    (event,) = withdraw.events
    assert event.name == "exception" and event.attributes["exception.type"] == "InsufficientFunds"
    assert "bob has 0, needs 5" in event.attributes["exception.message"]
    assert transfer.status.status_code is StatusCode.UNSET and not transfer.events
    assert server.status.status_code is StatusCode.ERROR and epoch.status.status_code is StatusCode.ERROR
    assert server.attributes["charon.error_type"] == "InsufficientFunds"


@pytest.mark.parametrize("inspector, limit, functions", [(False, 1000, set()), (True, 0, set()),
                                                         (True, 2, {"bank.transfer", "acct.withdraw"})])
def test_function_spans_need_the_inspector_and_are_bounded(tmp_path: Path, inspector: bool, limit: int,
                                                           functions: set[str]) -> None:
    """With the inspector off there is no call graph, hence no function span (the rest of the trace stays);
    ``otel_function_spans`` bounds them per request (0: none; past it, the root counts what it left out)."""
    provider, exporter = _provider()
    rt = InProcessRuntime(BANK, partitions=2, inspector=InspectorSettings(enabled=inspector))
    cfg = GatewayConfig(otel_function_spans=limit)
    with BackgroundServer(rt, token=TOKEN, tracer_provider=provider, config=cfg) as srv, \
            httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
        assert c.post("/invoke/acct/alice/deposit", json={"args": [10]}).status_code == 200
        _wait_spans(exporter, {"charon.epoch"})
        exporter.clear()
        assert c.post("/invoke/bank/t3/transfer", json={"args": ["alice", "bob", 1]}).status_code == 200
        spans = _wait_spans(exporter, {SERVER, "charon.epoch"} | functions)
        time.sleep(0.3)  # nothing else arrives
        spans = list(exporter.get_finished_spans())
    assert {s.name for s in spans} == {SERVER, "charon.epoch"} | functions
    if functions:
        root = next(s for s in spans if s.name == "bank.transfer")
        assert root.attributes["charon.call_graph.dropped"] == 1


def test_shared_epoch_spans_link_their_requests(tmp_path: Path) -> None:
    """``otel_shared_epoch_spans``: one charon.epoch span per epoch, the root of its own trace, linked to the
    server span of each traced request it ran (the log append under it); each request's function spans hang from
    its server span; per request two spans fewer."""
    provider, exporter = _provider()
    rt = InProcessRuntime(BANK, partitions=2, data_dir=str(tmp_path))
    cfg = GatewayConfig(otel_shared_epoch_spans=True)
    with BackgroundServer(rt, token=TOKEN, tracer_provider=provider, config=cfg) as srv:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
            assert c.post("/invoke/acct/alice/deposit", json={"args": [100]}).status_code == 200
        _wait_spans(exporter, {"charon.epoch"})
        exporter.clear()

        def transfer(i: int) -> dict:
            with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
                r = c.post(f"/invoke/bank/s{i}/transfer", json={"args": ["alice", f"b{i}", 1]},
                           headers={"Idempotency-Key": f"s{i}"})
                assert r.status_code == 200, r.text
                return r.json()

        replies = [None] * 8
        threads = [threading.Thread(target=lambda i=i: replies.__setitem__(i, transfer(i))) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        epochs = {r["epoch"] for r in replies}
        deadline = time.monotonic() + 10
        while sum(s.name == "charon.epoch" for s in exporter.get_finished_spans()) < len(epochs):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.3)
    spans = list(exporter.get_finished_spans())
    servers = {s.attributes["charon.request_id"]: s for s in spans if s.name == SERVER}
    shared = [s for s in spans if s.name == "charon.epoch"]
    assert sorted(s.attributes["charon.epoch"] for s in shared) == sorted(epochs)  # one span per epoch
    assert len(spans) == 8 * 4 + 2 * len(epochs)  # per request: server + 3 functions; per epoch: epoch + log
    for ep in shared:
        assert ep.parent is None and ep.links  # a trace of its own
        mine = [r for r in replies if r["epoch"] == ep.attributes["charon.epoch"]]
        assert ep.attributes["charon.epoch.traced_requests"] == len(mine)
        assert {link.context.span_id for link in ep.links} == {servers[r["request_id"]].context.span_id
                                                               for r in mine}
        (log,) = [s for s in spans if s.name == "charon.log.append" and s.parent.span_id == ep.context.span_id]
        assert log.context.trace_id == ep.context.trace_id
    for r in replies:
        server = servers[r["request_id"]]
        root = next(s for s in spans if s.name == "bank.transfer" and s.attributes["charon.request_id"] ==
                    r["request_id"])
        assert root.parent.span_id == server.context.span_id
        assert root.attributes["charon.epoch"] == r["epoch"] and root.attributes["charon.tid"] == r["tid"]


def test_an_aborted_transaction_is_an_error_span(tmp_path: Path) -> None:
    provider, exporter = _provider()
    rt = InProcessRuntime(APP, partitions=2)
    with BackgroundServer(rt, token=TOKEN, tracer_provider=provider) as srv, \
            httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
        r = c.post("/invoke/acct/carol/transfer", json={"args": ["bob", 5]})
        assert r.status_code == 409
        spans = _wait_spans(exporter, {"POST /invoke/{operator}/{key}/{function}", "charon.epoch"})
    server = next(s for s in spans if s.kind is SpanKind.SERVER)
    assert server.status.status_code is StatusCode.ERROR and "ValueError" in server.status.description
    assert server.attributes["charon.error_type"] == "ValueError"
    assert not any(s.name == "charon.log.append" for s in spans)  # a volatile runtime has no input log
    # a new trace (no traceparent): the server span is a root
    assert server.parent is None


def test_untraced_gateway_keeps_the_direct_lane_and_makes_no_spans(tmp_path: Path, monkeypatch) -> None:
    """Off (the default: no endpoint anywhere), no span object of any kind is made, recording or not."""
    import opentelemetry.sdk.trace as sdk_trace
    import opentelemetry.trace.span as api_span

    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "CHARON_GATEWAY_OTEL_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    made: list[str] = []
    for cls in (sdk_trace.Span, api_span.NonRecordingSpan):
        init = cls.__init__

        def counting(self, *a, _init=init, _name=cls.__name__, **kw) -> None:
            made.append(_name)
            _init(self, *a, **kw)

        monkeypatch.setattr(cls, "__init__", counting)
    rt = InProcessRuntime(APP, partitions=2, data_dir=str(tmp_path))
    with BackgroundServer(rt, token=TOKEN) as srv, httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
        assert srv.app.direct is not None and srv.app.state.gateway.tracing is None
        for i in range(20):
            assert c.post(f"/invoke/acct/x{i}/deposit", json={"args": [1]},
                          headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}).status_code == 200
        assert c.post("/batch", json={"calls": [["acct", "y", "deposit", [2]]]}).status_code == 200
    assert made == []
    # the counting itself works: a traced gateway makes spans through the same classes
    provider, exporter = _provider()
    with BackgroundServer(InProcessRuntime(APP, partitions=2), token=TOKEN, tracer_provider=provider) as srv:
        assert httpx.post(f"{srv.url}/invoke/acct/z/deposit", json={"args": [1]}, headers=AUTH).status_code == 200
        _wait_spans(exporter, {"charon.epoch"})
    assert "Span" in made and "NonRecordingSpan" in made


def test_call_graph_becomes_a_tree_of_function_spans() -> None:
    provider, exporter = _provider()
    tracer = provider.get_tracer("test")
    nodes = [  # a transfer that calls deposit, which sends a notification; the send raised
        {"index": 2, "parent": 1, "kind": "send", "operator": "notify", "key": "bob", "function": "push",
         "outcome": "raised"},
        {"index": 0, "parent": None, "kind": "root", "operator": "acct", "key": "alice", "function": "transfer",
         "outcome": "ok"},
        {"index": 1, "parent": 0, "kind": "call", "operator": "acct", "key": "bob", "function": "deposit",
         "outcome": None},
        {"index": 3, "parent": 0, "kind": "call", "operator": "audit", "key": "t1", "function": "record",
         "outcome": "ok"},
    ]
    with tracer.start_as_current_span("charon.epoch") as epoch:
        from opentelemetry import trace

        made = call_graph_spans(tracer, nodes, trace.set_span_in_context(epoch), 1_000, 2_000,
                                {"charon.request_id": "r9"})
    assert [s.name for s in made] == ["acct.transfer", "acct.deposit", "notify.push", "audit.record"]
    finished = {s.name: s for s in exporter.get_finished_spans()}
    root, dep, push, rec = (finished[n] for n in ("acct.transfer", "acct.deposit", "notify.push", "audit.record"))
    assert root.parent.span_id == finished["charon.epoch"].context.span_id
    assert dep.parent.span_id == root.context.span_id and rec.parent.span_id == root.context.span_id
    assert push.parent.span_id == dep.context.span_id
    assert push.status.status_code is StatusCode.ERROR and root.status.status_code is StatusCode.UNSET
    assert (dep.attributes["charon.key"], dep.attributes["charon.call.kind"], dep.attributes["charon.request_id"]) \
        == ("bob", "call", "r9")
    assert push.attributes["charon.call.kind"] == "send" and push.attributes["charon.operator"] == "notify"
    assert (root.start_time, root.end_time) == (1_000, 2_000)
    # bounded: only the first nodes become spans, the root says how many were left out
    exporter.clear()
    made = call_graph_spans(tracer, nodes, None, 1_000, 2_000, max_spans=2)
    assert len(made) == 2 and made[0].attributes["charon.call_graph.dropped"] == 2
    with pytest.raises(CallGraphError):
        call_graph_spans(tracer, [{"index": 0, "parent": None, "operator": "a", "key": "k", "function": "f"},
                                  {"index": 1, "parent": 5, "operator": "a", "key": "k", "function": "g"}],
                         None, 0, 1)
    with pytest.raises(CallGraphError):
        call_graph_spans(tracer, [{"index": 1, "parent": None, "operator": "a", "key": "k", "function": "f"}],
                         None, 0, 1)


def test_endpoint_from_flag_or_standard_variables() -> None:
    assert otlp_endpoint(None, {}) is None  # off by default
    assert otlp_endpoint("http://c:4318", {}) == "http://c:4318/v1/traces"
    assert otlp_endpoint("http://c:4318/v1/traces/", {}) == "http://c:4318/v1/traces"
    assert otlp_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://e:4318/"}) == "http://e:4318/v1/traces"
    assert otlp_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://e:4318",
                                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9/x"}) == "http://t:9/x"
    assert otlp_endpoint("http://c:4318", {"OTEL_SDK_DISABLED": "true"}) is None
    assert otlp_endpoint(None, {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://e"}) is None


class _Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP traces receiver: decodes each protobuf export request."""

    got: list[ExportTraceServiceRequest] = []

    def do_POST(self) -> None:  # noqa: N802 - the handler's protocol
        body = self.rfile.read(int(self.headers["Content-Length"]))
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(body)
        type(self).got.append((self.path, self.headers.get("Content-Type"), msg))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_otlp_export_reaches_a_real_receiver(tmp_path: Path) -> None:
    """The gateway's own exporter (configured by ``otel_endpoint``, as ``charon run --otel-endpoint``) sends
    OTLP/HTTP protobuf that decodes to the request's spans, under service.name ``charon``."""
    _Receiver.got = []
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    try:
        cfg = GatewayConfig(otel_endpoint=f"http://127.0.0.1:{receiver.server_address[1]}")
        rt = InProcessRuntime(APP, partitions=2, data_dir=str(tmp_path))
        with BackgroundServer(rt, token=TOKEN, config=cfg) as srv, \
                httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
            assert srv.app.state.gateway.tracing is not None
            r = c.post("/invoke/acct/dora/deposit", json={"args": [3]},
                       headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
            assert r.status_code == 200
        # stopping the gateway flushed the queue
        spans = [(res, span) for _, _, msg in _Receiver.got for res in msg.resource_spans
                 for scope in res.scope_spans for span in scope.spans]
    finally:
        receiver.shutdown()
        receiver.server_close()
    assert {p for p, _, _ in _Receiver.got} == {"/v1/traces"}
    assert {t for _, t, _ in _Receiver.got} == {"application/x-protobuf"}
    names = {span.name for _, span in spans}
    assert {"POST /invoke/{operator}/{key}/{function}", "charon.log.append", "charon.epoch"} <= names
    assert {span.trace_id.hex() for _, span in spans} == {TRACE_ID}
    res = spans[0][0].resource
    assert {a.key: a.value.string_value for a in res.attributes}["service.name"] == "charon"
    server = next(span for _, span in spans if span.name.startswith("POST"))
    attrs = {a.key: a.value for a in server.attributes}
    assert attrs["charon.operator"].string_value == "acct" and attrs["charon.epoch"].int_value >= 0


def test_a_sample_ratio_traces_a_share_and_follows_the_clients_decision(tmp_path: Path) -> None:
    """``otel_sample_ratio`` (``--otel-sample-ratio``): parent-based, so a client's sampled ``traceparent`` is traced
    in full even at 0, an unsampled one is not, and a request without one is traced at the ratio (0: never)."""
    from charon.server.tracing import sampler_for, tracing_from_config

    assert sampler_for(1.0) is None  # the SDK's own (OTEL_TRACES_SAMPLER, default parent-based always on)
    assert "TraceIdRatioBased{0.25}" in sampler_for(0.25).get_description()  # type: ignore[union-attr]
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="otel_sample_ratio"):
            tracing_from_config(GatewayConfig(otel_endpoint="http://127.0.0.1:9", otel_sample_ratio=bad), list)
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler_for(0.0))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    rt = InProcessRuntime(APP, partitions=2, data_dir=str(tmp_path))
    with BackgroundServer(rt, token=TOKEN, tracer_provider=provider) as srv, \
            httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
        for i in range(20):  # no traceparent: none of them traced at ratio 0
            assert c.post(f"/invoke/acct/s{i}/deposit", json={"args": [1]}).status_code == 200
        unsampled = f"00-{TRACE_ID}-{PARENT_ID}-00"
        assert c.post("/invoke/acct/u/deposit", json={"args": [1]}, headers={"traceparent": unsampled}).json()
        sampled = f"00-{TRACE_ID}-{PARENT_ID}-01"
        r = c.post("/invoke/acct/t/deposit", json={"args": [2]}, headers={"traceparent": sampled})
        assert r.status_code == 200 and r.json()["value"] == ["v1", 2]
        spans = _wait_spans(exporter, {SERVER, "charon.log.append", "charon.epoch"})
        time.sleep(0.3)  # what else would arrive (nothing)
        spans = list(exporter.get_finished_spans())
    assert {format(s.context.trace_id, "032x") for s in spans} == {TRACE_ID}
    assert [s.attributes["charon.key"] for s in spans if s.name == SERVER] == ["t"]  # the sampled one alone
