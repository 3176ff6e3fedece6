"""OpenTelemetry traces of the gateway's transactions (off by default).

On (``charon run --otel-endpoint URL``, ``GatewayConfig.otel_endpoint``, or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` variables; ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none`` turn it off), each ``POST /invoke`` and ``POST /batch`` gets a trace:

- ``POST /invoke/{operator}/{key}/{function}``: the server span, a child of the client's ``traceparent`` (W3C
  trace context) when it sends one; ``charon.request_id``, ``charon.operator``, ``charon.function``,
  ``charon.key``, and once answered ``charon.epoch``, ``charon.tid``, ``charon.position`` (an aborted transaction:
  status error, ``charon.error_type``);
- ``charon.log.append`` (durable node): the append (and fsync) of the batch that carried the request to the
  input log, child of the server span;
- ``charon.epoch``: the epoch that ran it, child of the server span, with the epoch's figures (with
  ``otel_shared_epoch_spans``: one per epoch instead, the root of a trace of its own with a link to each of its
  traced requests' server spans and the log append under it: per request, two spans fewer);
- one span per function of its call graph (:func:`call_graph_spans`, from the invocation inspector through
  :meth:`charon.runtime.contract.RequestLog.call_graph`), children of the epoch span; the function that raised has
  status error, ``error.type`` and an ``exception`` event. With the inspector off (``--no-inspector``) there is no
  call graph, hence no function span; ``otel_function_spans`` bounds them per request (0: none).

The epoch and log spans are placed with the engine's own timings (its ``epoch_stats``: wall-clock start and
duration) once the reply is in, not by a span open in the engine thread: the engine runs no tracing code at all.
Off, nothing of this runs: the gateway holds ``None`` and tests it once per request; no span object exists.
On, invokes take the ASGI route (the direct invoke lane of :mod:`charon.server.lane` is not used: that lane
exists to shave the last microseconds off untraced requests, and a traced request costs more than it saves).

Spans wait in a bounded queue (``otel_max_queue`` spans, each attribute at most ``otel_max_attribute_chars``
characters; beyond, the SDK drops spans) and leave in batches over OTLP/HTTP (protobuf).
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NotRequired, TypedDict

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from charon.messages import Reply, Request

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import Sampler
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import Response

    from charon.config import GatewayConfig

__all__ = ["Tracing", "CallNode", "call_graph_spans", "otlp_endpoint", "sampler_for", "tracing_from_config",
           "CallGraphError"]

_PROPAGATOR = TraceContextTextMapPropagator()
STATS_WAIT_S = 0.1  # a reply whose epoch's figures are not in yet (Spark records after the replies) looks again...
STATS_TRIES = 50  # ... this many times
MAX_WAITING = 10_000  # replies waiting for their epoch's figures at most (beyond: no epoch span for them)
EPOCH_FIGURES = ("size", "rounds", "committed", "aborted", "conflicts", "duration_ms")  # on the epoch span
MAX_CALL_GRAPH_SPANS = 1000  # function spans per request at most (default of GatewayConfig.otel_function_spans)
SHARED_WAIT_S = 0.1  # shared epoch spans: how long an epoch's replies may keep joining its span once the first is in
MAX_SHARED_PENDING = 1024  # shared epoch spans waiting for their epoch's replies at most (beyond: none for an epoch)
MAX_LINKS = 128  # a shared epoch span's links to its requests at most (the SDK's default limit; the rest counted)
_NEW_TRACE = trace.set_span_in_context(trace.INVALID_SPAN)  # a context whose spans start a trace of their own
FIGURES_KEPT = 64  # recent epochs' figures looked up once and kept (the replies of one epoch share them)
#: where a reply's call graph comes from: the request id to the inspector's Node dicts, or None (not kept)
CallGraphSource = Callable[[str], Sequence[Mapping[str, object]] | None]


class CallNode(TypedDict):
    """One node of a request's call graph, as the inspector gives it (index 0 is the root, the invoked function)."""

    index: int
    parent: int | None
    operator: str
    key: str
    function: str
    kind: NotRequired[str]  # "root", "call" or "send"
    outcome: NotRequired[str | None]  # "ok", "raised" or None (did not run to an end)


class CallGraphError(ValueError):
    """A call graph that is not a tree rooted at index 0 (a node's parent unknown or not before it)."""


def otlp_endpoint(explicit: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The OTLP/HTTP traces URL to export to, or None (tracing off): ``explicit`` (a base URL such as
    ``http://collector:4318``, or a full ``.../v1/traces`` one), else the standard ``OTEL_*`` variables."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    if explicit:
        url = explicit.rstrip("/")
        return url if url.endswith("/v1/traces") else url + "/v1/traces"
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
    return None


def tracing_from_config(cfg: GatewayConfig, epoch_stats: Callable[[], Sequence[Mapping[str, float]]],
                        call_graph_of: CallGraphSource | None = None) -> Tracing | None:
    """The gateway's tracing when ``cfg`` (or the environment) names an OTLP endpoint, else None (off)."""
    url = otlp_endpoint(cfg.otel_endpoint)
    if url is None:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits
    from opentelemetry.sdk.trace import TracerProvider as SdkProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    ratio = cfg.otel_sample_ratio
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"otel_sample_ratio must be a number from 0 to 1, not {ratio!r}")
    named = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "charon"}
    provider = SdkProvider(resource=Resource.create(named), sampler=sampler_for(ratio),
                           span_limits=SpanLimits(max_attribute_length=cfg.otel_max_attribute_chars))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url), max_queue_size=cfg.otel_max_queue,
                                                   max_export_batch_size=min(512, cfg.otel_max_queue)))
    return Tracing(provider, epoch_stats, owns_provider=True, call_graph_of=call_graph_of,
                   max_function_spans=cfg.otel_function_spans, shared_epochs=cfg.otel_shared_epoch_spans)


def sampler_for(ratio: float) -> Sampler | None:
    """``ratio`` of the traces that start here (parent-based: a sampled ``traceparent`` is followed, an unsampled one
    too); 1.0: None, the SDK's own choice from ``OTEL_TRACES_SAMPLER`` (default: parent-based, always on)."""
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    return None if ratio >= 1.0 else ParentBased(TraceIdRatioBased(ratio))


class Tracing:
    """The gateway's spans over one tracer provider (see the module docstring). ``epoch_stats``: the engine's
    recent epochs' figures (:meth:`charon.runtime.contract.Engine.epoch_stats`). ``call_graph_of``: where a
    reply's call graph comes from (the engine's :meth:`~charon.runtime.contract.RequestLog.call_graph`), if
    anywhere; ``max_function_spans``: function spans per request at most (0: none); ``shared_epochs``: one epoch
    span per epoch, in a trace of its own, linked to its requests' server spans (the function spans then hang from
    the server span), instead of one child per request."""

    def __init__(self, provider: TracerProvider, epoch_stats: Callable[[], Sequence[Mapping[str, float]]], *,
                 owns_provider: bool = False, call_graph_of: CallGraphSource | None = None,
                 max_function_spans: int = MAX_CALL_GRAPH_SPANS, shared_epochs: bool = False) -> None:
        if max_function_spans < 0:
            raise ValueError("max_function_spans must be 0 (no function spans) or more")
        self.provider = provider
        self.tracer = provider.get_tracer("charon")
        self._stats = epoch_stats
        self.owns_provider = owns_provider
        self.call_graph_of = call_graph_of
        self.max_function_spans = max_function_spans
        self.shared_epochs = shared_epochs
        self._shared: dict[int, tuple[list[trace.Link], list[int]]] = {}  # epoch -> its requests' links, count
        self._waiting = 0
        # epoch -> its figures and span attributes, looked up once for all its replies (the newest FIGURES_KEPT)
        self._figures: OrderedDict[int, tuple[Mapping[str, float], dict[str, AttributeValue]]] = OrderedDict()

    def shutdown(self) -> None:
        """Export what is queued and stop (a provider given by the caller is the caller's to shut down)."""
        if self.owns_provider:
            self.provider.shutdown()

    def route(self, handler: Callable[[HTTPRequest], Awaitable[Response]], name: str
              ) -> Callable[[HTTPRequest], Awaitable[Response]]:
        """``handler`` (a guarded route: it answers every error itself) inside a server span named ``name``."""
        tracer = self.tracer
        route = name.split(" ", 1)[-1]

        async def traced(request: HTTPRequest) -> Response:
            parent = _PROPAGATOR.extract(request.headers)
            params = request.path_params
            attrs: dict[str, AttributeValue] = {"http.request.method": request.method, "http.route": route}
            for p in ("operator", "key", "function"):
                if p in params:
                    attrs["charon." + p] = params[p]
            rid = request.headers.get("idempotency-key")
            if rid is not None:
                attrs["charon.request_id"] = rid
            with tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER, attributes=attrs) as span:
                response = await handler(request)
                span.set_attribute("http.response.status_code", response.status_code)
                if response.status_code >= 500:
                    span.set_status(Status(StatusCode.ERROR, f"HTTP {response.status_code}"))
            return response

        return traced

    def watch(self, req: Request, fut: asyncio.Future[Reply]) -> None:
        """The request ``fut`` answers runs under the current (server) span: its reply completes the span and
        places the log, epoch and function spans under it."""
        span = trace.get_current_span()
        if not span.is_recording():
            return
        span.set_attribute("charon.request_id", req.request_id)
        fut.add_done_callback(lambda f: self._replied(span, f))

    def _replied(self, span: trace.Span, fut: asyncio.Future[Reply]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            if span.is_recording():
                span.set_attribute("error.type", type(exc).__name__)
            return
        rep = fut.result()
        if span.is_recording():  # still open (a 202 answered first ended it)
            span.set_attributes({"charon.epoch": rep.epoch, "charon.tid": rep.tid})
            if rep.position is not None:
                span.set_attribute("charon.position", rep.position)
            if not rep.ok:
                span.set_attribute("charon.error_type", rep.error_type)
                span.set_status(Status(StatusCode.ERROR, f"{rep.error_type}: {rep.error_message}"[:500]))
        if rep.epoch >= 0:
            self._epoch_spans(NonRecordingSpan(span.get_span_context()), rep, 0)

    def _epoch_figures(self, epoch: int) -> tuple[Mapping[str, float], dict[str, AttributeValue]] | None:
        """The epoch's record and its span attributes: from the cache, else found in the engine's recent epochs
        (newest first, at most 256 looked at) and kept for the epoch's other replies."""
        kept = self._figures
        hit = kept.get(epoch)
        if hit is not None:
            return hit
        stats = self._stats()
        for i in range(len(stats) - 1, max(-1, len(stats) - 257), -1):
            rec = stats[i]
            e = rec.get("epoch")
            if e == epoch:
                hit = (rec, {f"charon.epoch.{k}": float(rec[k]) for k in EPOCH_FIGURES if k in rec})
                kept[epoch] = hit
                if len(kept) > FIGURES_KEPT:
                    kept.popitem(last=False)
                return hit
            if e is not None and e < epoch:
                return None
        return None

    def _epoch_spans(self, parent: trace.Span, rep: Reply, tries: int) -> None:
        if tries:
            self._waiting -= 1
        found = self._epoch_figures(rep.epoch)
        if found is None:
            if tries < STATS_TRIES and self._waiting < MAX_WAITING:
                self._waiting += 1
                asyncio.get_running_loop().call_later(STATS_WAIT_S, self._epoch_spans, parent, rep, tries + 1)
            return
        rec, figures = found
        duration_s = float(rec.get("duration_ms", 0.0)) / 1000.0
        if "started_at" in rec:
            start = float(rec["started_at"])
            end = start + duration_s
        elif "recorded_at" in rec:  # Spark: the epoch's record (its commit point) is its end
            end = float(rec["recorded_at"])
            start = end - duration_s
        else:
            return
        ctx = trace.set_span_in_context(parent)
        ids: dict[str, AttributeValue] = {"charon.request_id": rep.request_id, "charon.epoch": rep.epoch,
                                          "charon.tid": rep.tid}
        if rep.position is not None:
            ids["charon.position"] = rep.position
        if self.shared_epochs:  # the request's functions under its own span; the epoch's span is shared
            self._share(rep.epoch, parent.get_span_context(), rec, figures, start, end)
            self._function_spans(rep, ctx, start, end, ids)
            return
        if "log_started_at" in rec:
            self._log_span(rec, ctx, ids)
        epoch = self.tracer.start_span("charon.epoch", context=ctx, start_time=_ns(start),
                                       attributes={**ids, **figures})
        if not rep.ok:
            epoch.set_status(Status(StatusCode.ERROR, rep.error_type))
        self._function_spans(rep, trace.set_span_in_context(epoch), start, end, ids)
        epoch.end(end_time=_ns(end))

    def _log_span(self, rec: Mapping[str, float], ctx: Context, attrs: Mapping[str, AttributeValue]) -> None:
        t0 = float(rec["log_started_at"])
        log = self.tracer.start_span("charon.log.append", context=ctx, start_time=_ns(t0), attributes=attrs)
        log.end(end_time=_ns(t0 + float(rec.get("log_ms", 0.0)) / 1000.0))

    def _function_spans(self, rep: Reply, ctx: Context, start: float, end: float,
                        ids: Mapping[str, AttributeValue]) -> None:
        if self.call_graph_of is not None and self.max_function_spans:
            nodes = self.call_graph_of(rep.request_id)
            if nodes:
                call_graph_spans(self.tracer, nodes, ctx, _ns(start), _ns(end), ids, self.max_function_spans,
                                 None if rep.ok else (rep.error_type, rep.error_message))

    def _share(self, epoch: int, request: trace.SpanContext, rec: Mapping[str, float],
               figures: dict[str, AttributeValue], start: float, end: float) -> None:
        """Count ``request`` in its epoch's shared span, made once the epoch's replies had a moment to come in."""
        pending = self._shared.get(epoch)
        if pending is None:
            if len(self._shared) >= MAX_SHARED_PENDING:
                return
            pending = self._shared[epoch] = ([], [0])
            asyncio.get_running_loop().call_later(SHARED_WAIT_S, self._shared_epoch_span, epoch, rec, figures,
                                                  start, end)
        links, count = pending
        count[0] += 1
        if len(links) < MAX_LINKS:
            links.append(trace.Link(request))

    def _shared_epoch_span(self, epoch: int, rec: Mapping[str, float], figures: dict[str, AttributeValue],
                           start: float, end: float) -> None:
        links, count = self._shared.pop(epoch)
        attrs: dict[str, AttributeValue] = {"charon.epoch": epoch, "charon.epoch.traced_requests": count[0],
                                            **figures}
        span = self.tracer.start_span("charon.epoch", context=_NEW_TRACE, start_time=_ns(start), links=links,
                                      attributes=attrs)
        if "log_started_at" in rec:
            self._log_span(rec, trace.set_span_in_context(span), {"charon.epoch": epoch})
        span.end(end_time=_ns(end))


def call_graph_spans(tracer: trace.Tracer, nodes: Sequence[CallNode] | Sequence[Mapping[str, object]],
                     parent: Context | None, start_ns: int, end_ns: int,
                     attributes: Mapping[str, AttributeValue] | None = None, max_spans: int = MAX_CALL_GRAPH_SPANS,
                     error: tuple[str, str] | None = None) -> list[trace.Span]:
    """One span per node of a request's call graph (the inspector's Node dicts: ``index``, ``parent``,
    ``kind``, ``operator``, ``key``, ``function``, ``outcome``), named ``operator.function``, each the child of its
    node's parent's span and the root's of ``parent`` (a context, e.g. the epoch span's), all from ``start_ns``
    to ``end_ns`` (the epoch's: the call graph has no timings of its own). A node whose outcome is ``raised``
    has status error; with ``error`` (the reply's error type and message) also ``error.type`` and an
    ``exception`` event (``exception.type``, ``exception.message``). At most ``max_spans`` nodes (the rest:
    ``charon.call_graph.dropped`` on the root span). Returns the spans, ended, in the nodes' index order."""
    by_index = [_node(n) for n in nodes]
    if any(n[0] != i for i, n in enumerate(by_index)):  # the inspector's come in index order: no sort then
        by_index.sort(key=lambda n: n[0])
    if by_index and (by_index[0][0] != 0 or by_index[0][1] is not None):
        raise CallGraphError("a call graph's node 0 is its root (no parent)")
    spans: dict[int, trace.Span] = {}
    out: list[trace.Span] = []
    for i, up, op, key, fn, kind, outcome in by_index[:max_spans]:
        if up is not None and up not in spans:
            raise CallGraphError(f"node {i}'s parent {up} is not an earlier node of the call graph")
        ctx = parent if up is None else trace.set_span_in_context(spans[up])
        attrs: dict[str, AttributeValue] = dict(attributes or {})
        attrs.update({"charon.operator": op, "charon.function": fn, "charon.key": key, "charon.call.kind": kind,
                      "charon.call.index": i})
        span = tracer.start_span(f"{op}.{fn}", context=ctx, start_time=start_ns, attributes=attrs)
        if outcome == "raised":
            if error is None:
                span.set_status(Status(StatusCode.ERROR, "raised"))
            else:
                span.set_status(Status(StatusCode.ERROR, f"{error[0]}: {error[1]}"[:500]))
                span.set_attribute("error.type", error[0])
                span.add_event("exception", {"exception.type": error[0], "exception.message": error[1]},
                               timestamp=end_ns)
        spans[i] = span
        out.append(span)
    if len(by_index) > max_spans and out:
        out[0].set_attribute("charon.call_graph.dropped", len(by_index) - max_spans)
    for span in reversed(out):
        span.end(end_time=end_ns)
    return out


def _node(n: Mapping[str, object]) -> tuple[int, int | None, str, str, str, str, object]:
    """(index, parent, operator, key, function, kind, outcome) of one Node dict, checked."""
    i, up, op, key, fn, kind = (n.get(f) for f in ("index", "parent", "operator", "key", "function", "kind"))
    if not isinstance(i, int) or not (up is None or isinstance(up, int)):
        raise CallGraphError(f"a call graph node's index and parent are integers: {dict(n)!r}")
    if not (isinstance(op, str) and isinstance(key, str) and isinstance(fn, str)):
        raise CallGraphError(f"a call graph node names its operator, key and function: {dict(n)!r}")
    return i, up, op, key, fn, kind if isinstance(kind, str) and kind else "call", n.get("outcome")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
