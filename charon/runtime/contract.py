"""The engine contract: what every engine offers the layers above it, and what a controllable one adds.

The gateway, the admin routes, the metrics and the CLI hold an :class:`Engine` and use nothing else of it: no
attribute probing, no engine names, no type checks. Every engine answers the same calls in the same style
(async where it may wait), with typed results (the structs below) and the same errors (declared here):

* :class:`Engine`: start/stop, health, submitting requests and reading their replies, state and timer reads,
  dead letters, the code version a reply ran with, the recent epochs' figures.
* :class:`Controls` (``Engine.controls``; ``None`` for an engine without them, e.g. a gateway that only forwards
  to a remote engine's log): pause/resume/status, inspect, SQL, run-alone admin updates, code updates, rescale.

Engines are built by :func:`charon.runtime.factory.make_engine`; a runtime object that is not itself an
:class:`Engine` gives its engine by :meth:`EngineSource.engine` (``as_engine`` takes either).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import msgspec

from charon import serde
from charon.core.routing import split_store_key
from charon.core.workflows import workflow_operator
from charon.errors import (
    CharonError,
    EngineUnavailable,
    EpochNotRetained,
    GatePaused,
    NotSupported,
    RescaleBusy,
    SQLRejected,
    SQLResultTooLarge,
    SQLSyntaxError,
    SQLTimeout,
    SQLTooExpensive,
    StateTooLarge,
)
from charon.messages import Reply, Request

if TYPE_CHECKING:
    from charon.core.timers import Timer
    from charon.log.streams import StreamLog
    from charon.operator import Application

__all__ = [
    "IN_FLIGHT", "MAX_WORKFLOW_SCAN", "WorkflowsInFlight",
    "CodeUpdate", "ControlStatus", "Controls", "Engine", "EngineSource", "Enqueue", "EngineStopped", "EpochNotRetained",
    "GateClosed", "GatePaused", "Inspection", "NotSupported", "REQUEST_STATUSES", "RequestLog", "RequestQuery",
    "RescaleBusy", "RescaleOutcome", "Result", "SQLRejected",
    "SQLResultTooLarge", "SQLSyntaxError", "SQLTimeout", "SQLTooExpensive", "SqlResult", "StateTooLarge",
    "UpdateOutcome", "as_engine", "SQL_ERRORS",
]


class Enqueue(Protocol):
    """An engine's direct entry (:meth:`Engine.enqueuer`): the request's reply to come. ``fresh``: the caller
    found the request id absent from the engine's own input log just now, on the engine's event loop, with
    nothing awaited since (the engine may skip the same lookup)."""

    def __call__(self, request: Request, fresh: bool = False) -> asyncio.Future[Reply]: ...


# -- the errors every engine raises alike ---------------------------------------------------------------------
class EngineStopped(EngineUnavailable, RuntimeError):
    """The engine is not running (not started yet, stopped, or failed for good): nothing was accepted."""


class GateClosed(CharonError):
    """The engine stopped while an epoch waited at a closed gate (the epoch did not run)."""


# the admin errors are defined in charon.errors (one table, :data:`charon.errors.ERRORS`, maps the gateway's
# answers back to them in the HTTP clients) and named here as well


#: the SQL errors (typed 4xx answers of ``/admin/sql``)
SQL_ERRORS: tuple[type[CharonError], ...] = (SQLRejected, SQLSyntaxError, SQLTimeout, StateTooLarge, EpochNotRetained,
                                             SQLTooExpensive, SQLResultTooLarge)


# -- typed results --------------------------------------------------------------------------------------------
class Result(msgspec.Struct, kw_only=True):
    """A typed result; :meth:`doc` is its JSON document (unset fields left out)."""

    def doc(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


class ControlStatus(Result, kw_only=True):
    """The engine's control state: pause state, the last committed epoch, backlog, code version, retention.

    Fields an engine does not have are left unset (and absent from the JSON document)."""

    state: str  # running, pausing (closed with an epoch still running), paused
    paused: bool
    pause_requested: bool
    pause_after: int | None
    active_epoch: int | None
    epoch: int  # the last committed (recorded) epoch
    engine: str
    durable: bool
    backlog: int | None  # requests accepted but not in a committed epoch (None: the log does not answer)
    retained_from: int
    code_version: str
    dead_letters: dict[str, int]
    logged_waiting: int | msgspec.UnsetType = msgspec.UNSET  # epochs logged while paused (in-process)
    retained_epochs: list[int] | msgspec.UnsetType = msgspec.UNSET  # the epochs inspect can show (in-process)
    stuck: Any = msgspec.UNSET  # a function that holds the engine where it cannot be interrupted (in-process)
    log_error: str | None | msgspec.UnsetType = msgspec.UNSET  # why the log does not answer (Spark)
    log_partitions: dict[str, int] | None | msgspec.UnsetType = msgspec.UNSET  # route and physical (Spark)


class Inspection(msgspec.Struct, frozen=True):
    """An operator's store rows as of one committed epoch (one consistent cut); ``more``: a page stopped at its
    ``max_bytes`` before the entities that follow."""

    epoch: int
    rows: dict[bytes, bytes]
    more: bool = False


IN_FLIGHT = ("running", "waiting")  # the statuses of a workflow in flight (a step due or retrying; awaiting)
MAX_WORKFLOW_SCAN = 100_000  # records :meth:`Controls.workflows_in_flight` reads per workflow (then: truncated)
_SCAN_PAGE = 1000


class WorkflowsInFlight(Result, kw_only=True):
    """The workflows in flight per code version (the drain): in all (``{version: {"running": n, "waiting": m}}``),
    per workflow, and whether a workflow had more than :data:`MAX_WORKFLOW_SCAN` records (the counts stop there)."""

    total: dict[str, dict[str, int]]
    per: dict[str, dict[str, dict[str, int]]]
    truncated: bool

    def count(self, version: str) -> int:
        """How many workflows are in flight on ``version`` (as far as read)."""
        c = self.total.get(version)
        return 0 if c is None else c["running"] + c["waiting"]


class SqlResult(Result, kw_only=True):
    """One SQL query's answer over one cut of the state."""

    epoch: int
    columns: list[str]
    rows: list[list[Any]]
    truncated: bool
    engine: str


class UpdateOutcome(Result, kw_only=True):
    """A run-alone admin update's outcome (a repeat of an update id returns the first one's, ``repeated``)."""

    id: str
    transactions: int
    committed: int
    aborted: dict[str, str]
    epochs: list[int]
    repeated: bool


class CodeUpdate(Result, kw_only=True):
    """A code update's outcome: the version, from which epoch, its migration's outcome, its mode."""

    version: str
    ref: str
    from_epoch: int
    migration: UpdateOutcome | None
    mode: str
    kept_deferred: int | msgspec.UnsetType = msgspec.UNSET  # compatible: transactions finishing on the old code
    first_tid: int | msgspec.UnsetType = msgspec.UNSET  # compatible (Spark): the first TID on the new code


class RescaleOutcome(Result, kw_only=True):
    """A rescale's outcome, the same on every engine: the engine's move (``None`` fields when only the input
    log was resized) and the input log's resize (``log``) if one was asked."""

    from_: int | None = msgspec.field(default=None, name="from")
    to: int | None = None
    epoch: int | None = None
    keys: int | None = None
    wait_s: float | None = None
    pause_s: float | None = None
    cpu_s: float | None = None
    log: dict[str, Any] | None = None
    engine_moved: bool = True  # False: only the input log was resized (the document then holds ``log`` only)

    def doc(self) -> dict[str, Any]:
        if not self.engine_moved:
            return {"log": self.log}
        out: dict[str, Any] = msgspec.to_builtins(self)
        out.pop("engine_moved", None)
        return out


# -- the invocation inspector (GET /admin/requests, charon requests) -----------------------------------------------
#: what a request may be in the inspector: waiting or running, run to a commit or an abort, moved to a later epoch,
#: refused by a quarantine verdict
REQUEST_STATUSES = ("pending", "committed", "aborted", "deferred", "quarantined")


class RequestQuery(msgspec.Struct, frozen=True, kw_only=True):
    """A search of the inspector's requests (every field a filter; None: any). ``since``/``until``: Unix seconds,
    compared with the time the request was accepted (else replied); ``cursor``: a page's ``next``."""

    status: str | None = None
    operator: str | None = None
    key: str | None = None
    function: str | None = None
    error_type: str | None = None
    epoch_min: int | None = None
    epoch_max: int | None = None
    since: float | None = None
    until: float | None = None
    limit: int = 50
    cursor: str | None = None


class RequestLog(abc.ABC):
    """The invocation inspector's store (:mod:`charon.runtime.control.inspector`): requests, newest first, each with its
    timings, reply, call graph and, for an abort, its error and traceback. Bounded; kept in memory (a restart
    loses it). Callable from any thread."""

    @abc.abstractmethod
    def search(self, query: RequestQuery) -> dict[str, object]:
        """``{"items": [summary...], "next": cursor | None, "retention": {...}}``; ``BadRequest`` (a ``ValueError``)
        for a bad status or cursor."""

    @abc.abstractmethod
    def detail(self, request_id: str) -> dict[str, object] | None:
        """The summary plus ``reply``, ``error``, ``call_graph`` and ``truncated``; None when unknown or dropped."""

    def by_tid(self, tid: int) -> dict[str, object] | None:
        """:meth:`detail` of the answered request whose transaction is ``tid`` (a workflow's history names its
        steps' TIDs); None when not kept."""
        return None

    def call_graph(self, request_id: str) -> list[dict[str, object]] | None:
        """An answered request's call graph alone (``detail(...)["call_graph"]``: the Node dicts ``index``,
        ``parent``, ``kind``, ``operator``, ``key``, ``function``, ``outcome``, root first); None when not kept
        (unknown, dropped, still unanswered, or the inspector is off). Tracing reads it per traced reply."""
        d = self.detail(request_id)
        if d is None or d.get("replied_at") is None:
            return None
        graph = d.get("call_graph")
        return graph if isinstance(graph, list) else None


# -- the contract ---------------------------------------------------------------------------------------------
class Engine(abc.ABC):
    """What every engine offers the gateway, admin routes, metrics and CLI."""

    #: the engine's kind, for people (status documents, the CLI's banner): never branched on
    kind: ClassVar[str]
    #: whether :meth:`start` takes long (a JVM): the gateway then opens its port first and starts it meanwhile
    slow_start: ClassVar[bool] = False

    @property
    @abc.abstractmethod
    def app(self) -> Application:
        """The application the engine runs now (a code update switches it)."""

    @property
    @abc.abstractmethod
    def partitions(self) -> int:
        """The engine's partition count now (a rescale changes it)."""

    @property
    def durable(self) -> bool:
        """Whether an acknowledged request survives the process (a log and checkpoints)."""
        return False

    @property
    def input_log(self) -> Any:
        """The durable input log (:class:`charon.log.contract.InputLog`) the gateway asks for a request id's
        operation and status after a restart; ``None`` when replies are only kept in memory."""
        return None

    @property
    def submit_checks_ids(self) -> bool:
        """Whether :meth:`submit` itself refuses a client's request id that the input log holds for another
        operation (:class:`~charon.errors.IdempotencyConflict`) and answers a known one with its stored reply,
        in its batched append: a synchronous invoke then needs no lookup of its own first."""
        return False

    @property
    def streams(self) -> StreamLog | None:
        """The engine's output streams (``GET /streams``); ``None`` when it keeps none."""
        return None

    @property
    def controls(self) -> Controls | None:
        """The control surface, or ``None`` (checked once, where a route or command needs it)."""
        return None

    @property
    def replayed_epochs(self) -> int:
        """Epochs replayed from the log at the last start (a durable engine's recovery)."""
        return 0

    # -- lifecycle
    @abc.abstractmethod
    async def start(self) -> None:
        """Start serving (recover first, if durable)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop serving: accepted requests are answered or stay in the log; resources released."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the engine holds (files, logs, a Spark session) after :meth:`stop`."""

    @abc.abstractmethod
    def health(self) -> dict[str, Any]:
        """``{"status": "ok" | ..., ...}``: cheap, never blocks, callable from any thread."""

    def describe(self) -> str:
        """One line for people: where the engine keeps what (``durable in DIR``, ``EPHEMERAL: ...``)."""
        return "durable" if self.durable else "in memory"

    @property
    def log_file(self) -> str | None:
        """Where the engine's own (not Charon's) output goes, if elsewhere than stderr (Spark's JVM log)."""
        return None

    def load(self, operator: str, values: dict[str, Any]) -> None:
        """Bulk-load entity values before the first epoch (a fresh deployment)."""
        raise NotSupported(f"this engine ({self.kind}) has no bulk load")

    def on_fatal(self, callback: Callable[[str], None]) -> None:  # noqa: B027 - optional hook
        """Call ``callback(reason)`` when the engine fails for good (``charon run`` then exits for a supervisor)."""

    # -- requests
    @abc.abstractmethod
    async def submit(self, operator: str, key: str, function: str, args: list[Any], *,
                     request_id: str | None = None) -> Reply:
        """Run one invocation as a transaction; its reply (at most once per request id)."""

    def enqueuer(self) -> Enqueue | None:
        """The engine's direct entry for an already checked request (no coroutine per request), if it has one;
        the gateway asks once."""
        return None

    @abc.abstractmethod
    def get_reply(self, request_id: str) -> Reply | None:
        """The reply of a finished request, if it is still kept."""

    # -- reads
    @abc.abstractmethod
    def read_state(self, operator: str, key: str, default: Any = None) -> Any:
        """An entity's committed value."""

    def timers(self, operator: str, key: str) -> list[Timer]:
        """An entity's pending timers."""
        return []

    def dead_letters(self, limit: int = 1000) -> list[dict[str, Any]]:
        """The newest transactions the engine refused for good (verdicts: timeouts, quarantines)."""
        return []

    def version_at(self, epoch: int, tid: int | None = None) -> str:
        """The code version epoch ``epoch`` (transaction ``tid``) ran with."""
        return str(getattr(self.app, "version", "1"))

    def epoch_stats(self) -> list[dict[str, float]]:
        """The recent epochs' figures (size, duration, conflicts...), oldest first (the metrics read them)."""
        return []

    def code_versions(self) -> list[dict[str, str | int | None]]:
        """The deployed code versions, oldest first: ``{"from_epoch", "version", "ref", "migration", "unloaded_at"}``
        each (``ref`` None: the application the engine was built with; ``migration`` "operator.function" or None;
        ``unloaded_at``: the epoch of the update that unloaded its drained application, or None)."""
        return [{"from_epoch": 0, "version": self.version_at(0), "ref": None, "migration": None, "unloaded_at": None}]

    @property
    def requests(self) -> RequestLog | None:
        """The invocation inspector (``GET /admin/requests``), or None where functions do not run here."""
        return None


class Controls(abc.ABC):
    """What a controllable engine adds: one style (async), typed results, the contract's errors."""

    #: the code-update modes this engine supports
    code_update_modes: ClassVar[tuple[str, ...]] = ("strict",)
    #: whether the input log's partitions can be rescaled (``log_partitions``)
    log_rescalable: ClassVar[bool] = False

    @abc.abstractmethod
    async def pause(self, after_epoch: int | None = None) -> ControlStatus:
        """Start no epoch (after ``after_epoch``) until :meth:`resume`; requests keep arriving and wait."""

    @abc.abstractmethod
    async def resume(self) -> ControlStatus:
        """Let epochs start again; the waiting requests run in arrival order."""

    @abc.abstractmethod
    async def status(self) -> ControlStatus:
        """The control state now."""

    @abc.abstractmethod
    def status_now(self) -> ControlStatus:
        """The control state now, from any thread (blocking where the engine asks its log: call it off the loop)."""

    @abc.abstractmethod
    async def inspect(self, operator: str, keys: list[str] | None = None, epoch: int | None = None,
                      limit: int = 10_000, *, after: str | None = None, prefix: str = "",
                      max_bytes: int | None = None) -> Inspection:
        """``operator``'s rows as of one committed epoch (default: the last); :class:`EpochNotRetained`. The
        entities ``keys``, or a page: the first ``limit`` entities in key order (UTF-8 bytes) that sort after
        ``after`` and start with ``prefix``, at most ``max_bytes`` of rows (the first entity always comes),
        read at the cost of the page (pass the first page's epoch to read the next ones from the same cut)."""

    async def workflows_in_flight(self, workflows: Iterable[str], epoch: int | None = None,
                                  max_scan: int = MAX_WORKFLOW_SCAN) -> WorkflowsInFlight:
        """The workflows in flight per code version, from the records of ``workflows`` (names) as of ``epoch``
        (default: the last committed), read a page at a time with :meth:`inspect`."""
        per: dict[str, dict[str, dict[str, int]]] = {}
        total: dict[str, dict[str, int]] = {}
        truncated = False
        for name in sorted(set(workflows)):
            counts: dict[str, dict[str, int]] = {}
            after: str | None = None
            seen = 0
            while True:
                page = await self.inspect(workflow_operator(name), None, epoch, _SCAN_PAGE, after=after)
                keys: set[str] = set()
                for k, v in page.rows.items():
                    _, key, item = split_store_key(k)
                    keys.add(key)
                    rec = serde.decode(v) if item == "" else None
                    status = rec.get("status") if isinstance(rec, dict) else None
                    if isinstance(rec, dict) and status in IN_FLIGHT:
                        for c in (counts, total):
                            slot = c.setdefault(str(rec.get("version")), {"running": 0, "waiting": 0})
                            slot[str(status)] += 1
                seen += len(keys)
                if not keys or (len(keys) < _SCAN_PAGE and not page.more):
                    break
                if seen >= max_scan:
                    truncated = True
                    break
                after = max(keys, key=str.encode)  # entities come in key order (UTF-8 bytes)
            per[name] = counts
        return WorkflowsInFlight(total=total, per=per, truncated=truncated)

    @abc.abstractmethod
    async def sql(self, query: str, epoch: int | None = None, *, max_rows: int = 1000, timeout_s: float = 30.0,
                  max_entities: int = 100_000, max_bytes: int = 4 << 20,
                  max_memory: int = 512 << 20) -> SqlResult:
        """One safe SELECT over the state at one committed epoch, in the SQL sandbox."""

    @abc.abstractmethod
    async def run_alone(self, update_id: str, operator: str, function: str, args: bytes,
                        keys: list[str] | None = None) -> UpdateOutcome:
        """A serializable admin update (``args`` encoded), alone at an epoch boundary, once per id."""

    @abc.abstractmethod
    async def update_code(self, ref: str, version: str, migration: tuple[str, str, bytes] | None = None,
                          mode: str = "strict") -> CodeUpdate:
        """Switch to the installed application ``ref`` at one epoch boundary (``migration`` args encoded).

        Decided at that boundary before anything is recorded (:func:`charon.runtime.control.drain.plan_update`):
        :class:`~charon.errors.VersionInUse` if it would drop the code (its recorded ref no longer installed) of a
        version with workflows in flight; the drained versions (no longer current, none in flight) are unloaded,
        recorded with the update."""

    @abc.abstractmethod
    async def rescale(self, partitions: int | None = None, *,
                      log_partitions: int | None = None) -> RescaleOutcome:
        """Change the engine's partitions (and/or the input log's, where :attr:`log_rescalable`)."""

    @abc.abstractmethod
    def last_rescale(self) -> RescaleOutcome | None:
        """The newest rescale's outcome (by any caller), if any."""


@runtime_checkable
class EngineSource(Protocol):
    """A runtime object that gives its engine (the in-process and Spark runtimes)."""

    def engine(self) -> Engine: ...


def as_engine(obj: Engine | EngineSource) -> Engine:
    """``obj`` itself if it is an :class:`Engine`, else its :meth:`EngineSource.engine`."""
    return obj if isinstance(obj, Engine) else obj.engine()
