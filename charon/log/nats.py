"""The input and output logs on NATS JetStream, for gateways on other machines than the engine.

Same interface and guarantees as :mod:`charon.log.sqlite` (see there); :func:`charon.log.open_input_log`
picks this module for a location like ``nats://127.0.0.1:4222/mydeployment`` (the path names the deployment;
default ``charon``; several deployments can share one server).

Layout on the server (``<D>`` = the deployment name)
    * input partition ``p``: stream ``CHARON_<D>_IN_<p>`` (subject ``charon.<D>.in.<p>``). A request's offset
      is its stream sequence minus one, so offsets are dense per partition, assigned by the server, and never
      reused: :meth:`NatsInputLog.truncate` purges below a sequence and the stream keeps counting.
    * output log: stream ``CHARON_<D>_OUT``; a reply's ``seq`` is its stream sequence. Epoch marks go to
      ``CHARON_<D>_MARKS``.
    * key-value bucket ``CHARON_<D>_IDS``: the partition counts (``meta.partitions``, physical, only grows;
      ``meta.route``, the routing count, see :meth:`NatsInputLog.resize`) and the request-id index (below).

Exactly once, beyond JetStream's dedup window
    JetStream drops a message whose ``Nats-Msg-Id`` it saw within the stream's ``duplicate_window``
    (``dedup_window_s``, default 10 min) and answers with the original sequence; after the window it would store
    it again. So a request id is first *claimed* in the ``IDS`` bucket with an atomic create (kept until
    retention forgets the id, also after truncation), then published with ``Nats-Msg-Id`` = a hash of the id and
    the claim's time, then the claim is resolved to ``(partition, offset)``. A second append of the id finds the
    claim: a resolved one is answered at once; an unresolved one (its appender is still publishing, or crashed)
    is published again with the same ``Nats-Msg-Id`` while the claim is younger than the window (the server
    dedups it to the original offset, or stores it if the first publish never arrived); an older unresolved
    claim is resolved by scanning its partition from the claim's time for the message id. Gateways in several
    processes can therefore append concurrently. The one residual case is an appender that stalls for longer
    than the dedup window between claiming and publishing (document your window accordingly).

    The output log has one writer at a time (the engine's driver); a reply whose request id is not in the bucket is
    published (its ``Nats-Msg-Id`` carries the id's hash), then indexed in the bucket. The writer re-indexes the
    stream's tail past the index watermark when it starts, so a reply stored just before a crash is known
    after the window too and a replayed epoch never stores it twice.

    Retention: :meth:`NatsInputLog.forget` and :meth:`NatsOutputLog.prune` (driven by the runtimes'
    ``DedupRetention``, window ``dedup_window_s`` of the deployment, 7 days by default) remove forgotten ids'
    index entries (purged, no delete markers), their replies and old epoch marks, so the bucket and streams
    stay bounded in a long run; a forgotten id is appended again as new. The runtimes' own records (ids
    starting with ``__charon`` or ``\x00``) are indexed in a second bucket that ``forget`` lists.

Appends of one call are published in order (so a batch's entries get increasing offsets in a partition) but,
unlike SQLite, not atomically: a crash can leave a prefix of a batch in the log (each entry exactly once).

Durability: streams use file storage. nats-server acknowledges a message once it is written to its store
(it survives the server being killed, as the SIGKILL tests check) and fsyncs every ``sync_interval`` (2 min by
default; nats-server 2.10+ accepts ``jetstream { sync_interval: always }`` for power-loss safety, or run a
3-node cluster with replicas: ``nats://h1:p1,h2:p2,h3:p3/deployment?replicas=3`` lists the cluster's servers,
the client fails over between them, and every stream and bucket is replicated on 3 servers, so a message
acknowledged is on a quorum and survives losing any one server).
The ``durable`` argument is accepted for interface parity and changes nothing.

Failures: while the server is unreachable the client reconnects forever; an operation that does not complete
within ``timeout_s`` raises :class:`NatsLogError` (an ``OSError``: :class:`~charon.log.client.LogClient` retries
it like a locked SQLite file). Connections are per process (re-opened after ``fork``), one background event
loop thread each, shared by every thread of the process. Opening a log waits out an outage of up to
:data:`OPEN_WAIT_S` (``CHARON_NATS_OPEN_WAIT_S``): a cluster that just lost a server answers its first JetStream
requests only once it elected new leaders, and a node started on a new machine meets exactly that.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import re
import threading
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Self, TypeVar
from urllib.parse import urlsplit

import msgspec

from charon.errors import EngineUnavailable
from charon.log.offsets import pad_offsets
from charon.messages import Reply, Request
from charon.serde import decode_reply, decode_request, encode_reply, encode_request

__all__ = ["NatsInputLog", "NatsLogError", "NatsLogUnreachable", "NatsOutputLog", "is_nats_url", "nats_replicas",
           "parse_nats_url"]

T = TypeVar("T")
log = logging.getLogger(__name__)
DEFAULT_DEDUP_WINDOW_S = 600.0
DEFAULT_TIMEOUT_S = 10.0
#: how long opening a log retries while the servers do not answer (then :class:`NatsLogUnreachable`)
OPEN_WAIT_S = float(os.environ.get("CHARON_NATS_OPEN_WAIT_S", "60"))
OPEN_ATTEMPT_S = 2.0  # an opening's first attempt waits this long for the servers, each next one twice as long
FETCH_BATCH = 5000  # messages per pull request of a range read
DIRECT_READ_MAX = 8  # a read of at most this many messages by sequence gets them one by one (no consumer)
CONSUMER_CREATE_S = 2.0  # one attempt to create a range read's consumer (retried within the operation's timeout)
#: how old a handle's cached partition counts may get before an operation reads them again (see resize)
COUNTS_REFRESH_S = 1.0
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class NatsLogError(OSError, EngineUnavailable):
    """A NATS log operation failed or timed out (the server is unreachable or refused it); retry it.

    An ``OSError`` (the log client retries appends on it, as for a locked SQLite file) and an
    :class:`~charon.errors.EngineUnavailable` (the gateway answers 503 with ``Retry-After``)."""


class NatsLogUnreachable(NatsLogError):
    """The NATS server did not answer in time or the connection is down: an outage of the log, not a fault of
    what was asked (the Spark supervisor waits for the log instead of counting it as an epoch's failure)."""


_UNREACHABLE = ("ConnectionClosedError", "ConnectionReconnectingError", "NoServersError", "StaleConnectionError",
                "UnexpectedEOF", "OutboundBufferLimitError", "NoRespondersError", "FlushTimeoutError",
                "ServiceUnavailableError", "NoStreamResponseError")


def is_nats_url(location: str | os.PathLike[str]) -> bool:
    """Whether a log location names a NATS server (``nats://``, ``tls://``) rather than a file."""
    return isinstance(location, str) and location.split("://", 1)[0] in ("nats", "tls")


def parse_nats_url(url: str) -> tuple[str, str]:
    """``(server URLs, deployment name)`` of ``nats://host:port[,host:port...][/name][?replicas=N]`` (name default
    ``charon``); several servers (a cluster's) come back comma-separated, each with the scheme."""
    u = urlsplit(url)
    hosts = u.netloc.split(",")
    if u.scheme not in ("nats", "tls") or not all(h and not h.startswith(":") for h in hosts):
        raise ValueError(f"not a NATS log URL: {url!r} (expected nats://host:port/deployment)")
    nats_replicas(url)
    name = u.path.strip("/") or "charon"
    if not _NAME.match(name):
        raise ValueError(f"deployment name {name!r} in {url!r} must match [A-Za-z0-9_-]{{1,64}}")
    server = ",".join(f"{u.scheme}://{h}" for h in hosts)
    return server, name


def nats_replicas(url: str) -> int:
    """The stream replicas a NATS log URL asks for (``?replicas=3`` on a 3-server cluster; default 1)."""
    query = dict(p.split("=", 1) for p in urlsplit(url).query.split("&") if "=" in p)
    raw = query.get("replicas", "1")
    if not raw.isdigit() or not 1 <= int(raw) <= 5:
        raise ValueError(f"replicas in {url!r} must be 1 to 5 (JetStream's limit), not {raw!r}")
    return int(raw)


#: request ids of the runtimes' own records (Spark's ticks, the node's epoch markers): indexed in a separate
#: bucket so that :meth:`NatsInputLog.forget` can list them (they get no reply to be forgotten with)
RUNTIME_ID_PREFIXES = ("__charon", "\x00")


def _rid_hash(request_id: str) -> str:
    """A subject-safe fixed-length key for an arbitrary request id (the id itself is kept in the values)."""
    return hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()


class _Msg(msgspec.Struct, frozen=True):
    """One stored message of a range read: its stream sequence and payload."""

    seq: int
    data: bytes
    headers: dict[str, str] | None = None


class _Client:
    """One NATS connection per process on a private event loop thread; sync calls block on it."""

    _lock = threading.Lock()
    _clients: dict[tuple[int, str], _Client] = {}

    @classmethod
    def get(cls, server: str, timeout_s: float) -> _Client:
        k = (os.getpid(), server)
        with cls._lock:
            c = cls._clients.get(k)
            if c is None or c.closed:
                c = cls._clients[k] = _Client(server, timeout_s)
            c.users += 1
            return c

    def __init__(self, server: str, timeout_s: float) -> None:
        self.server = server
        self.timeout_s = timeout_s
        self.users = 0
        self.closed = False
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="charon-nats", daemon=True)
        self._thread.start()
        self.nc: Any = None
        self.js: Any = None
        try:
            self.run(self._connect)
        except BaseException:
            self.closed = True
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise

    async def _connect(self) -> None:
        import nats

        async def error_cb(e: Exception) -> None:  # the client reconnects by itself; operations time out
            log.info("NATS connection to %s: %s: %s", self.server, type(e).__name__, e)

        self.nc = await nats.connect(
            self.server.split(","), connect_timeout=self.timeout_s, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
            allow_reconnect=True, ping_interval=5, max_outstanding_pings=3, name=f"charon-{os.getpid()}",
            error_cb=error_cb,
        )
        self.js = self.nc.jetstream(timeout=self.timeout_s)

    def run(self, fn: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        """Run ``fn()`` on the connection's loop; NATS errors and timeouts become :class:`NatsLogError`."""
        import nats.errors

        if self.closed:
            raise ValueError("the NATS log is closed")
        nc = self.nc
        if nc is not None and nc.is_reconnecting:  # the connection is down: fail now, callers retry with back-off
            raise NatsLogUnreachable(f"NATS server {self.server} is unreachable (connection lost, reconnecting)")
        fut = asyncio.run_coroutine_threadsafe(_coro(fn), self.loop)
        t = (timeout or self.timeout_s) + 1.0
        started = time.monotonic()
        try:
            return fut.result(t)
        except TimeoutError:  # this wait's, or one inside the operation (a publish ack's): name the actual wait
            fut.cancel()
            raise NatsLogUnreachable(
                f"NATS server {self.server} did not answer: gave up after waiting {time.monotonic() - started:.1f} s"
            ) from None
        except nats.errors.Error as e:
            kind = NatsLogUnreachable if type(e).__name__ in _UNREACHABLE else NatsLogError
            raise kind(f"NATS log operation failed on {self.server}: {type(e).__name__}: {e}") from e

    def release(self) -> None:
        with self._lock:
            self.users -= 1
            if self.users > 0 or self.closed:
                return
            self.closed = True
            self._clients.pop((os.getpid(), self.server), None)
        if self.nc is not None:
            try:
                asyncio.run_coroutine_threadsafe(self.nc.close(), self.loop).result(5)
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


async def _coro(fn: Callable[[], Awaitable[T]]) -> T:
    return await fn()


class _Base:
    """Shared plumbing: the per-process client, stream creation, range reads."""

    def __init__(self, url: str, timeout_s: float, dedup_window_s: float) -> None:
        self.path = url  # the location string (what ``charon_log``'s ``path`` option carries)
        self.server, self.name = parse_nats_url(url)
        self.replicas = nats_replicas(url)
        self.timeout_s = timeout_s
        self.dedup_window_s = dedup_window_s
        self._pid = os.getpid()
        self._client = _Client.get(self.server, timeout_s)
        self._kv: Any = None
        self._kv_pid = -1
        self._rt: Any = None
        self._rt_pid = -1

    @property
    def c(self) -> _Client:
        if self._pid != os.getpid():  # forked: open this process's own connection
            self._pid = os.getpid()
            self._client = _Client.get(self.server, self.timeout_s)
        return self._client

    def _run(self, fn: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        return self.c.run(fn, timeout)

    def _open_waiting(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run the idempotent ``fn`` that opens the log, again while the servers do not answer, for at most
        :data:`OPEN_WAIT_S` (a cluster electing new leaders after losing a server times out its first requests)."""
        deadline = time.monotonic() + OPEN_WAIT_S
        attempt = OPEN_ATTEMPT_S  # short first (an election is over in seconds), doubling up to timeout_s
        while True:
            try:
                return self._run(fn, min(attempt, self.timeout_s))
            except NatsLogUnreachable as exc:
                if time.monotonic() >= deadline:
                    raise
                log.warning("opening the NATS log %s: %s; trying again", self.path, exc)
                attempt *= 2
                time.sleep(0.5)

    async def _ensure_stream(self, name: str, subject: str) -> None:
        from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
        from nats.js.errors import BadRequestError

        cfg = StreamConfig(
            name=name, subjects=[subject], storage=StorageType.FILE, retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD, duplicate_window=self.dedup_window_s, num_replicas=self.replicas,
        )
        try:
            await self.c.js.add_stream(cfg)
        except BadRequestError:  # exists with another config (e.g. another window): keep it, check it exists
            await self.c.js.stream_info(name)

    async def _bucket(self) -> Any:
        if self._kv is None or self._kv_pid != os.getpid():
            from nats.js.api import KeyValueConfig, StorageType
            from nats.js.errors import BucketNotFoundError

            bucket = f"CHARON_{self.name}_IDS"
            try:
                self._kv = await self.c.js.key_value(bucket)
            except BucketNotFoundError:
                self._kv = await self.c.js.create_key_value(
                    KeyValueConfig(bucket=bucket, history=1, storage=StorageType.FILE, replicas=self.replicas)
                )
            self._kv_pid = os.getpid()
        return self._kv

    async def _rt_bucket(self) -> Any:
        """The bucket indexing the runtimes' own records (see ``RUNTIME_ID_PREFIXES``)."""
        if self._rt is None or self._rt_pid != os.getpid():
            from nats.js.api import KeyValueConfig, StorageType
            from nats.js.errors import BucketNotFoundError

            bucket = f"CHARON_{self.name}_RTIDS"
            try:
                self._rt = await self.c.js.key_value(bucket)
            except BucketNotFoundError:
                self._rt = await self.c.js.create_key_value(
                    KeyValueConfig(bucket=bucket, history=1, storage=StorageType.FILE, replicas=self.replicas)
                )
            self._rt_pid = os.getpid()
        return self._rt

    async def _drop_entry(self, bucket: Any, entry: Any) -> None:
        """Remove a key-value entry without leaving a delete marker (purge its subject in the bucket's stream;
        a bucket's stream denies single-message deletes)."""
        name = bucket._name  # noqa: SLF001
        await self.c.js.purge_stream(f"KV_{name}", subject=f"$KV.{name}.{entry.key}")

    async def _bucket_for(self, request_id: str) -> Any:
        return await (self._rt_bucket() if request_id.startswith(RUNTIME_ID_PREFIXES) else self._bucket())

    async def _kv_get(self, key: str, kv: Any = None) -> bytes | None:
        from nats.js.errors import KeyNotFoundError

        kv = kv or await self._bucket()
        try:
            e = await kv.get(key)
        except KeyNotFoundError:
            return None
        value: bytes | None = e.value
        return value

    async def _kv_create(self, key: str, value: bytes, kv: Any = None) -> bytes | None:
        """Create ``key``; None if created, else the existing value (atomic)."""
        from nats.js.errors import KeyWrongLastSequenceError

        kv = kv or await self._bucket()
        for _ in range(50):
            try:
                await kv.create(key, value)
                return None
            except KeyWrongLastSequenceError:
                old = await self._kv_get(key, kv)
                if old is not None:
                    return old
                # deleted in between (never here) or not yet visible: try again
                await asyncio.sleep(0.01)
        raise NatsLogError(f"could not create or read key {key!r}")

    async def _fetch(
        self, stream: str, subject: str, first_seq: int, last_seq: int, limit: int | None = None,
        start_time: float | None = None,
    ) -> list[_Msg]:
        """Messages of ``stream`` with sequence in ``[first_seq, last_seq]`` (or from ``start_time`` up to
        ``last_seq``), at most ``limit``, in order (deleted ones left out).

        Up to :data:`DIRECT_READ_MAX` messages by sequence are read one by one (``STREAM.MSG.GET``, answered by the
        stream's leader: a request-id lookup reads one); more through an ephemeral pull consumer (no acks, removed
        after reading, else by the server after 30 s idle), whose creation is retried with a short timeout: on a
        cluster that lost a server, the server may place the consumer on the lost one, and that create never
        answers (nats-server 2.9).
        """
        from datetime import UTC, datetime

        import nats.errors
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
        from nats.js.errors import NotFoundError

        if last_seq < max(first_seq, 1) and start_time is None:
            return []
        if start_time is None and last_seq - max(first_seq, 1) < min(DIRECT_READ_MAX, limit or DIRECT_READ_MAX):
            out: list[_Msg] = []
            for seq in range(max(first_seq, 1), last_seq + 1):
                try:
                    raw = await self.c.js.get_msg(stream, seq)
                except NotFoundError:  # deleted (a duplicate another attempt stored)
                    continue
                out.append(_Msg(seq, raw.data or b"", raw.headers))
            return out
        if start_time is not None:
            cfg = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_TIME,
                # nats-py passes a string through as is (older releases took only one); its stub says datetime
                opt_start_time=datetime.fromtimestamp(start_time, UTC).isoformat(),  # type: ignore[arg-type]
                ack_policy=AckPolicy.NONE, inactive_threshold=30.0, mem_storage=True, filter_subject=subject,
            )
            bound = last_seq
        else:
            cfg = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(first_seq, 1),
                ack_policy=AckPolicy.NONE, inactive_threshold=30.0, mem_storage=True, filter_subject=subject,
            )
            bound = last_seq - max(first_seq, 1) + 1
        if limit is not None:
            bound = min(bound, limit)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                info = await self.c.js.add_consumer(stream, config=cfg, timeout=CONSUMER_CREATE_S)
                break
            except nats.errors.TimeoutError:
                if time.monotonic() >= deadline:
                    raise
        sub = await self.c.js.pull_subscribe_bind(consumer=info.name, stream=stream)
        got: list[_Msg] = []
        try:
            while len(got) < bound:
                try:
                    msgs = await sub.fetch(min(FETCH_BATCH, bound - len(got)), timeout=2.0)
                except nats.errors.TimeoutError:
                    break
                for m in msgs:
                    seq = m.metadata.sequence.stream
                    if seq > last_seq:
                        return got
                    got.append(_Msg(seq, m.data, m.headers))
                    if seq == last_seq or len(got) >= bound:
                        return got
                if not msgs:
                    break
        finally:
            try:
                await self.c.js.delete_consumer(stream, info.name)
            except Exception:  # noqa: BLE001 - it expires anyway
                pass
            await sub.unsubscribe()
        return got

    def close(self) -> None:
        """Release this object's use of the process's connection (closed with its last user)."""
        if self._pid == os.getpid():
            self._client.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NatsInputLog(_Base):
    """Partitioned input log of :class:`Request` s on JetStream, same contract as
    :class:`charon.log.sqlite.InputLog` (see the module docstring for the layout and dedup).

    Resizing (:meth:`resize`): the bucket keeps ``meta.partitions`` (physical: streams ``0..n-1`` exist and
    are consumed forever; only grows, by compare-and-set) and ``meta.route`` (appends without a partition go
    to ``crc32(key) % route``). Every handle caches the two and refreshes them at most every
    ``COUNTS_REFRESH_S`` seconds, and at once when it meets a partition it does not know (an offsets list or
    an explicit partition beyond its count). A stale appender appending to a partition the route no longer
    names is still correct: that partition is consumed, and dedup spans the whole log."""

    atomic_batches = False  # a crash can leave a prefix of an ``append_many`` batch (never a duplicate)

    def __init__(
        self, url: str, partitions: int | None = None, *, durable: bool = True,
        dedup_window_s: float = DEFAULT_DEDUP_WINDOW_S, timeout_s: float = DEFAULT_TIMEOUT_S,
        resize: bool = False,
    ) -> None:
        if partitions is not None and partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        super().__init__(url, timeout_s, dedup_window_s)
        self.durable = durable  # JetStream file storage; the server's sync interval governs power loss
        self._n = 0
        self._route = 0
        self._counts_at = -math.inf  # time.monotonic() of the last refresh
        try:
            self._open_waiting(lambda: self._open(partitions, resize))
        except BaseException:
            self.close()
            raise

    async def _open(self, partitions: int | None, resize: bool) -> None:
        want = 4 if partitions is None else partitions
        created = await self._kv_create("meta.partitions", str(want).encode()) is None
        if created:
            await self._kv_create("meta.route", str(want).encode())
        n, route = await self._refresh()
        if partitions is not None and partitions != route:
            if not resize:
                raise ValueError(
                    f"input log {self.path!r} has {route} partitions, opened with partitions={partitions}"
                )
            await self._resize_async(partitions)
            return
        for p in range(n):
            await self._ensure_stream(self._stream(p), self._subject(p))

    async def _refresh(self) -> tuple[int, int]:
        """Read the counts from the bucket (a log from before resizing has no ``meta.route``: = physical)."""
        n_b = await self._kv_get("meta.partitions")
        r_b = await self._kv_get("meta.route")
        n = int(n_b) if n_b else max(self._n, 1)
        route = min(n, int(r_b)) if r_b else n
        self._n, self._route, self._counts_at = max(n, self._n), route, time.monotonic()
        return self._n, self._route

    async def _known(self, need: int = 0) -> int:
        """The physical count, refreshed when older than ``COUNTS_REFRESH_S`` or smaller than ``need``."""
        if self._n < need or time.monotonic() - self._counts_at >= COUNTS_REFRESH_S:
            await self._refresh()
        return self._n

    @property
    def partitions(self) -> int:
        """The physical partition count (offsets lists have this many entries; it only grows)."""
        return self._run(self._known)

    @property
    def route(self) -> int:
        """The routing count: an append without an explicit partition goes to ``crc32(key) % route``."""
        self._run(self._known)
        return self._route

    def counts(self) -> tuple[int, int]:
        """``(physical partitions, routing count)``, read from the server now."""
        return self._run(self._refresh)

    def resize(self, route: int) -> tuple[int, int]:
        """Route new appends over ``route`` partitions (same contract as
        :meth:`charon.log.sqlite.InputLog.resize`): growing creates the missing streams first, then raises the
        physical count (compare-and-set, it never goes down), then sets the routing count. Appenders in other
        processes switch within ``COUNTS_REFRESH_S``. Returns ``(physical, route)``."""
        if route < 1:
            raise ValueError(f"partitions must be >= 1, got {route}")
        return self._run(lambda: self._resize_async(route))

    async def _resize_async(self, route: int) -> tuple[int, int]:
        from nats.js.errors import KeyWrongLastSequenceError

        kv = await self._bucket()
        for p in range(route):  # every stream up to the new count exists before any handle can name it
            await self._ensure_stream(self._stream(p), self._subject(p))
        for _ in range(50):
            e = await kv.get("meta.partitions")
            if int(e.value) >= route:
                break
            try:
                await kv.update("meta.partitions", str(route).encode(), last=e.revision)
                break
            except KeyWrongLastSequenceError:  # another resize raced us: read again
                await asyncio.sleep(0.01)
        else:
            raise NatsLogError(f"could not raise the partition count of {self.path!r}")
        await kv.put("meta.route", str(route).encode())
        return await self._refresh()

    def _stream(self, p: int) -> str:
        return f"CHARON_{self.name}_IN_{p}"

    def _subject(self, p: int) -> str:
        return f"charon.{self.name}.in.{p}"

    # -- writing -----------------------------------------------------------------------------------
    def append(self, req: Request, partition: int | None = None) -> tuple[int, int]:
        """Append one request; returns its ``(partition, offset)`` (the existing one for a known id)."""
        return self._append([(req, partition)])[0]

    def append_many(self, reqs: Iterable[Request | tuple[Request, int | None]]) -> list[tuple[int, int]]:
        """Append requests in order; one ``(partition, offset)`` per request (known ids keep theirs)."""
        items = [(r, None) if isinstance(r, Request) else (r[0], r[1]) for r in reqs]
        return self._append(items) if items else []

    def _append(self, items: Sequence[tuple[Request, int | None]]) -> list[tuple[int, int]]:
        need = max((p + 1 for _, p in items if p is not None), default=0)
        n = self._n
        if n < need or time.monotonic() - self._counts_at >= COUNTS_REFRESH_S:  # else no hop to the loop
            n = self._run(lambda: self._known(need))
        route = self._route
        for _, p in items:
            if p is not None and not 0 <= p < n:
                raise ValueError(f"partition {p} out of range [0, {n})")
        now = time.time()
        prepared: list[tuple[Request, int, str]] = []
        for req, p in items:
            if req.ts == 0:
                req = msgspec.structs.replace(req, ts=now)
            part = zlib.crc32(req.key.encode()) % route if p is None else p
            encode_request(req)  # refuse an unencodable request before claiming its id
            prepared.append((req, part, _rid_hash(req.request_id)))
        return self._run(lambda: self._append_async(prepared), timeout=self.timeout_s * 3)

    async def _append_async(self, items: list[tuple[Request, int, str]]) -> list[tuple[int, int]]:
        first: dict[str, int] = {}  # hash -> index of its first occurrence in this batch
        for i, (_, _, h) in enumerate(items):
            first.setdefault(h, i)
        uniq = sorted(first.values())
        stamp = f"{time.time():.6f}"
        kvs = {i: await self._bucket_for(items[i][0].request_id) for i in uniq}
        olds = await asyncio.gather(
            *(self._kv_create(f"in.{items[i][2]}", f"c|{items[i][1]}|{stamp}".encode(), kvs[i]) for i in uniq)
        )
        pos: dict[str, tuple[int, int]] = {}
        # (item index, partition, message id) to publish, in batch order; the message id names the claim
        # (id hash + claim time), so a republish of that claim is deduplicated, but an id appended again after
        # retention forgot it is not taken for its old, truncated message
        publish: list[tuple[int, int, str]] = []
        for i, old in zip(uniq, olds, strict=True):
            if old is None:
                publish.append((i, items[i][1], f"{items[i][2]}.{stamp}"))
            elif old.startswith(b"r|"):
                _, p_s, off_s = old.decode().split("|")[:3]
                pos[items[i][2]] = (int(p_s), int(off_s))
            else:  # another appender's claim: it is publishing, or it crashed before resolving it
                _, p_s, t_s = old.decode().split("|")
                found = None
                if time.time() - float(t_s) >= self.dedup_window_s * 0.8:  # the server cannot dedup it now
                    found = await self._scan_for(int(p_s), items[i][2], float(t_s))
                if found is None:  # publish it again under the same message id: the server dedups it
                    publish.append((i, int(p_s), f"{items[i][2]}.{t_s}"))
                else:
                    pos[items[i][2]] = (int(p_s), found)
        # publish in batch order (a partition's offsets follow it), then resolve the claims
        futs = []
        for i, p, msg_id in publish:
            futs.append(await self.c.js.publish_async(
                self._subject(p), encode_request(items[i][0]), stream=self._stream(p),
                headers={"Nats-Msg-Id": msg_id},
            ))
        for (i, p, _), fut in zip(publish, futs, strict=True):
            ack = await asyncio.wait_for(fut, self.timeout_s)
            pos[items[i][2]] = (p, ack.seq - 1)
        await asyncio.gather(
            *(kvs[i].put(f"in.{items[i][2]}",
                         f"r|{pos[items[i][2]][0]}|{pos[items[i][2]][1]}|{items[i][0].request_id}".encode())
              for i, _, _ in publish)
        )
        return [pos[h] for _, _, h in items]

    async def _scan_for(self, p: int, h: str, since: float) -> int | None:
        """The offset of the message with id hash ``h`` in partition ``p``, appended after ``since``."""
        info = await self.c.js.stream_info(self._stream(p))
        if info.state.messages == 0:
            return None
        last = info.state.last_seq
        for m in await self._fetch(self._stream(p), self._subject(p), 0, last, start_time=since - 5):
            if (m.headers or {}).get("Nats-Msg-Id", "").split(".")[0] == h:
                off: int = m.seq - 1
                return off
        return None

    def truncate(self, upto: Sequence[int]) -> None:
        """Delete the entries below ``upto[p]`` in every partition (retention); offsets keep counting. A
        shorter ``upto`` (from before the log grew) leaves the partitions it does not name as they are."""

        async def go() -> None:
            infos = await self._infos(len(upto))
            upto_ = pad_offsets(upto, len(infos))
            for p, (u, (_, nxt)) in enumerate(zip(upto_, infos, strict=True)):
                if u > nxt:
                    raise ValueError(f"cannot truncate partition {p} to {u}: it ends at {nxt}")
            for p, (u, (low, _)) in enumerate(zip(upto_, infos, strict=True)):
                if u > low:
                    await self.c.js.purge_stream(self._stream(p), seq=u + 1)

        self._run(go)

    def forget(self, request_ids: Iterable[str], truncated_prefix: str | None = None) -> list[str]:
        """Forget request ids whose entries were truncated (dedup retention; see
        :meth:`charon.log.sqlite.InputLog.forget`); ``truncated_prefix`` also forgets the runtimes' own
        truncated records with that prefix. Index entries are removed without delete markers, so the
        bucket shrinks. Returns the ids of ``request_ids`` that were forgotten."""
        ids = list(request_ids)

        async def go() -> list[str]:
            await self._refresh()  # an id may name a partition a stale count does not know
            lows = [s for s, _ in await self._infos()]
            out: list[str] = []

            async def one(rid: str, kv: Any, key: str) -> bool:
                from nats.js.errors import KeyNotFoundError

                try:
                    e = await kv.get(key)
                except KeyNotFoundError:
                    return False
                parts = (e.value or b"").decode().split("|", 3)
                if parts[0] != "r" or int(parts[2]) >= lows[int(parts[1])]:
                    return False  # still in the log (or not resolved): keeps its id
                await self._drop_entry(kv, e)
                return True

            for start in range(0, len(ids), 256):
                chunk = ids[start:start + 256]
                kvs = [await self._bucket_for(r) for r in chunk]
                got = await asyncio.gather(*(one(r, kv, f"in.{_rid_hash(r)}") for r, kv in zip(chunk, kvs,
                                                                                               strict=True)))
                out.extend(r for r, g in zip(chunk, got, strict=True) if g)
            if truncated_prefix:
                rt = await self._rt_bucket()
                try:
                    keys = await rt.keys()
                except Exception:  # noqa: BLE001 - nats-py raises NoKeysError on an empty bucket
                    keys = []
                for key in keys:
                    v = await self._kv_get(key, rt)
                    parts = (v or b"").decode().split("|", 3)
                    if len(parts) == 4 and parts[3].startswith(truncated_prefix):
                        await one(parts[3], rt, key)
            return out

        return self._run(go, timeout=self.timeout_s * 6)

    # -- reading -----------------------------------------------------------------------------------
    async def _infos(self, need: int = 0) -> list[tuple[int, int]]:
        """``(start, end)`` offsets of every physical partition (at least ``need``, else ``ValueError``)."""
        n = await self._known(need)
        if n < need:
            raise ValueError(f"expected at most {n} offsets, got {need}")
        infos = await asyncio.gather(*(self.c.js.stream_info(self._stream(p)) for p in range(n)))
        return [(max(i.state.first_seq - 1, 0), i.state.last_seq) for i in infos]

    def contains(self, request_id: str) -> bool:
        """Whether a request with this id was ever appended (also after truncation)."""
        return self.position(request_id) is not None

    def position(self, request_id: str) -> tuple[int, int] | None:
        """The ``(partition, offset)`` a request id was appended at, or None."""

        async def go() -> tuple[int, int] | None:
            h = _rid_hash(request_id)
            v = await self._kv_get(f"in.{h}", await self._bucket_for(request_id))
            if v is None:
                return None
            parts = v.decode().split("|")
            if parts[0] == "r":
                return int(parts[1]), int(parts[2])
            off = await self._scan_for(int(parts[1]), h, float(parts[2]))  # claimed, maybe not published
            return None if off is None else (int(parts[1]), off)

        return self._run(go)

    def end_offsets(self) -> list[int]:
        """The next offset of every partition (= number of entries ever appended to it)."""
        return [e for _, e in self._run(self._infos)]

    def start_offsets(self) -> list[int]:
        """The first retained offset of every partition (0 until :meth:`truncate`)."""
        return [s for s, _ in self._run(self._infos)]

    def count(self) -> int:
        """Number of retained entries."""
        return sum(e - s for s, e in self._run(self._infos))

    def read(self, partition: int, start: int, end: int) -> list[Request]:
        """The requests at offsets ``[start, end)`` of one partition; ``ValueError`` if not all retained."""
        return [decode_request(d) for _, d in self.read_raw(partition, start, end)]

    def read_range(self, starts: Sequence[int], ends: Sequence[int]) -> list[tuple[int, int, Request]]:
        """``(partition, offset, request)`` for offsets ``[starts[p], ends[p])`` of every partition (shorter
        lists are padded with 0s, :func:`~charon.log.offsets.pad_offsets`)."""

        async def go() -> list[list[tuple[int, bytes]]]:
            infos = await self._infos(max(len(starts), len(ends)))
            s, e = pad_offsets(starts, len(infos)), pad_offsets(ends, len(infos))
            return list(await asyncio.gather(
                *(self._read_async(p, s[p], e[p], infos[p]) for p in range(len(infos)))
            ))

        got = self._run(go, timeout=self.timeout_s * 6)
        return [(p, off, decode_request(d)) for p, rows in enumerate(got) for off, d in rows]

    def read_raw(self, partition: int, start: int, end: int) -> list[tuple[int, bytes]]:
        """Like :meth:`read` but ``(offset, msgpack bytes)`` pairs."""

        async def go() -> list[tuple[int, bytes]]:
            n = await self._known(partition + 1)
            if not 0 <= partition < n:
                raise ValueError(f"partition {partition} out of range [0, {n})")
            info = await self.c.js.stream_info(self._stream(partition))
            bounds = (max(info.state.first_seq - 1, 0), info.state.last_seq)
            return await self._read_async(partition, start, end, bounds)

        return self._run(go, timeout=self.timeout_s * 6)

    async def _read_async(self, p: int, start: int, end: int, bounds: tuple[int, int]) -> list[tuple[int, bytes]]:
        if start >= end:
            if start > end:
                raise ValueError(f"empty range: start {start} > end {end}")
            return []
        low, nxt = bounds
        if start < low:
            raise ValueError(f"partition {p}: offsets below {low} were truncated (asked from {start})")
        if end > nxt:
            raise ValueError(f"partition {p}: ends at {nxt}, asked up to {end}")
        msgs = await self._fetch(self._stream(p), self._subject(p), start + 1, end)
        rows = [(m.seq - 1, m.data) for m in msgs]
        if [o for o, _ in rows] != list(range(start, end)):
            raise ValueError(f"partition {p}: offsets [{start}, {end}) are not all retained")
        return rows

    def __repr__(self) -> str:
        return f"NatsInputLog({self.path!r}, partitions={self._n}, route={self._route})"


class NatsOutputLog(_Base):
    """Output log of :class:`Reply` s on JetStream, same contract as :class:`charon.log.sqlite.OutputLog`
    (one writer at a time; see the module docstring)."""

    def __init__(
        self, url: str, *, durable: bool = True, dedup_window_s: float = DEFAULT_DEDUP_WINDOW_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(url, timeout_s, dedup_window_s)
        self.durable = durable
        self.stream = f"CHARON_{self.name}_OUT"
        self.subject = f"charon.{self.name}.out"
        self.marks_stream = f"CHARON_{self.name}_MARKS"
        self.marks_subject = f"charon.{self.name}.marks"
        self._marks: list[tuple[int, int, int]] = []  # (epoch, last_seq, marks-stream seq) in order, cached
        self._marks_read = 0  # marks-stream sequence read up to
        self._indexed = False  # this process re-indexed the stream's tail (done by the writer, once)
        self._wlock = threading.Lock()
        try:
            self._open_waiting(self._open)
        except BaseException:
            self.close()
            raise

    async def _open(self) -> None:
        await self._ensure_stream(self.stream, self.subject)
        await self._ensure_stream(self.marks_stream, self.marks_subject)
        await self._bucket()

    async def _last(self) -> int:
        last: int = (await self.c.js.stream_info(self.stream)).state.last_seq
        return last

    async def _reindex(self) -> None:
        """Index the replies past the watermark (stored by a writer that crashed before indexing them)."""
        w = await self._kv_get("out.watermark")
        start = int(w) if w else 0
        last = await self._last()
        if last > start:
            for m in await self._fetch(self.stream, self.subject, start + 1, last):
                h = (m.headers or {}).get("Nats-Msg-Id", "").split(".")[0]
                seq = m.seq
                old = await self._kv_create(f"out.{h}", str(seq).encode())
                if old is not None and int(old) != seq:
                    await self.c.js.delete_msg(self.stream, seq)  # a second copy: never deliver it
            await (await self._bucket()).put("out.watermark", str(last).encode())

    def put_many(self, replies: Iterable[Reply]) -> int:
        """Store replies in order; ones whose request id is already stored are ignored. Returns how many
        were new."""
        rows = [(r.request_id, encode_reply(r)) for r in replies]
        if not rows:
            return 0
        with self._wlock:
            try:
                return self._run(lambda: self._put_async(rows), timeout=self.timeout_s * 3)
            except BaseException:
                # a failed attempt may have stored replies it never indexed (e.g. the server died between
                # the publish ack and the index entry): the retry indexes them first, so it stores no copy
                self._indexed = False
                raise

    async def _put_async(self, rows: list[tuple[str, bytes]]) -> int:
        if not self._indexed:
            await self._reindex()
            self._indexed = True
        seen: dict[str, bytes] = {}
        for rid, data in rows:
            seen.setdefault(_rid_hash(rid), data)
        hashes = list(seen)
        known = await asyncio.gather(*(self._kv_get(f"out.{h}") for h in hashes))
        new = [h for h, k in zip(hashes, known, strict=True) if k is None]
        futs = [
            await self.c.js.publish_async(self.subject, seen[h], stream=self.stream,
                                          headers={"Nats-Msg-Id": f"{h}.{time.time_ns()}"})
            for h in new
        ]
        acks = [await asyncio.wait_for(f, self.timeout_s) for f in futs]
        fresh = 0
        last = 0
        for h, ack in zip(new, acks, strict=True):
            last = max(last, ack.seq)
            old = await self._kv_create(f"out.{h}", str(ack.seq).encode())
            if old is None and not ack.duplicate:
                fresh += 1
            elif old is not None and int(old) != ack.seq:
                await self.c.js.delete_msg(self.stream, ack.seq)  # stored meanwhile by another attempt
        if last:
            kv = await self._bucket()
            await kv.put("out.watermark", str(last).encode())
        return fresh

    def put(self, reply: Reply) -> bool:
        """Store one reply; False if its request id was already stored."""
        return self.put_many([reply]) == 1

    def get(self, request_id: str) -> Reply | None:
        """The reply to a request, or None if there is none yet."""
        from nats.js.errors import NotFoundError

        async def go() -> Reply | None:
            v = await self._kv_get(f"out.{_rid_hash(request_id)}")
            if v is None:
                return None
            try:
                m = await self.c.js.get_msg(self.stream, int(v))
            except NotFoundError:
                return None
            rep = decode_reply(m.data)
            return rep if rep.request_id == request_id else None

        return self._run(go)

    def _range(self, start: int, end: int | None, limit: int | None) -> list[tuple[int, Reply]]:
        async def go() -> list[tuple[int, Reply]]:
            last = await self._last()
            hi = last if end is None else min(end, last)
            if hi <= start:
                return []
            msgs = await self._fetch(self.stream, self.subject, start + 1, hi, limit)
            return [(m.seq, decode_reply(m.data)) for m in msgs]

        return self._run(go, timeout=self.timeout_s * 6)

    def read_since(self, seq: int, limit: int = 10000) -> list[tuple[int, Reply]]:
        """Up to ``limit`` ``(seq, reply)`` pairs with seq > ``seq``, in seq order."""
        return self._range(seq, None, limit)

    def read_between(self, start: int, end: int) -> list[tuple[int, Reply]]:
        """``(seq, reply)`` pairs with ``start < seq <= end``, in seq order."""
        return self._range(start, end, None)

    def version(self) -> None:
        """None: JetStream has no cheap change counter (see :meth:`charon.log.sqlite.OutputLog.version`), so a
        reader reads on every pass."""
        return None

    def last_seq(self) -> int:
        """The highest seq stored (0 when empty)."""
        return self._run(self._last)

    def mark_epoch(self, epoch: int) -> None:
        """Record that every reply of ``epoch`` (and of the epochs before) is in the log (idempotent)."""

        async def go() -> None:
            await self._sync_marks()
            if any(m[0] == epoch for m in self._marks[-64:]) or (self._marks and self._marks[-1][0] > epoch):
                return
            last = await self._last()
            await self.c.js.publish(self.marks_subject, msgspec.msgpack.encode([epoch, last]),
                                    stream=self.marks_stream, headers={"Nats-Msg-Id": f"e{epoch}"})

        with self._wlock:
            self._run(go)

    async def _sync_marks(self) -> None:
        info = await self.c.js.stream_info(self.marks_stream)
        last = info.state.last_seq
        if last > self._marks_read:
            for m in await self._fetch(self.marks_stream, self.marks_subject, self._marks_read + 1, last):
                e, s = msgspec.msgpack.decode(m.data)
                self._marks.append((int(e), int(s), m.seq))
                self._marks_read = m.seq

    def epoch_boundaries(self, after: int, upto: int | None = None) -> list[int]:
        """Seqs that end a complete epoch, greater than ``after`` (and at most ``upto``), ascending."""
        self._run(self._sync_marks)
        return sorted({m[1] for m in self._marks if m[1] > after and (upto is None or m[1] <= upto)})

    def seq_after(self, seq: int, n: int) -> int:
        """The seq of the ``n``-th reply after ``seq`` (or :meth:`last_seq` if there are fewer)."""
        if n < 1:
            return seq

        async def go() -> int:
            info = await self.c.js.stream_info(self.stream)
            last: int = info.state.last_seq
            if not info.state.num_deleted:
                return max(seq, min(seq + n, last))
            msgs = await self._fetch(self.stream, self.subject, seq + 1, last, n)
            nth: int = msgs[-1].seq if len(msgs) >= n else max(seq, last)
            return nth

        return self._run(go)

    def request_ids_through(self, seq: int) -> list[str]:
        """The request ids of the replies with seq <= ``seq`` (what :meth:`prune` would be given)."""

        async def go() -> list[str]:
            info = await self.c.js.stream_info(self.stream)
            hi = min(seq, info.state.last_seq)
            msgs = await self._fetch(self.stream, self.subject, info.state.first_seq, hi)
            return [decode_reply(m.data).request_id for m in msgs]

        return self._run(go, timeout=self.timeout_s * 6)

    def prune(self, request_ids: Iterable[str]) -> int:
        """Delete these requests' replies, their index entries and the epoch marks below the oldest reply
        left (reply retention; seqs are never reused). Returns how many replies were deleted."""
        ids = list(request_ids)

        async def go() -> int:
            from nats.js.errors import KeyNotFoundError, NotFoundError

            kv = await self._bucket()

            async def one(rid: str) -> int:
                try:
                    e = await kv.get(f"out.{_rid_hash(rid)}")
                except KeyNotFoundError:
                    return 0
                try:
                    await self.c.js.delete_msg(self.stream, int(e.value))
                    n = 1
                except NotFoundError:
                    n = 0
                await self._drop_entry(kv, e)
                return n

            n = 0
            for start in range(0, len(ids), 256):
                n += sum(await asyncio.gather(*(one(r) for r in ids[start:start + 256])))
            info = await self.c.js.stream_info(self.stream)
            low = info.state.first_seq if info.state.messages else None
            await self._sync_marks()
            if low is not None:
                below = [m for m in self._marks if m[1] < low]
                if len(below) > 1:  # the newest boundary below the oldest reply stays: readers resume there
                    keep = below[-1]
                    await self.c.js.purge_stream(self.marks_stream, seq=keep[2])
                    self._marks = [m for m in self._marks if m[2] >= keep[2]]
            return n

        with self._wlock:
            return self._run(go, timeout=self.timeout_s * 6)

    def count(self) -> int:
        """Number of stored replies."""
        n: int = self._run(lambda: self.c.js.stream_info(self.stream)).state.messages
        return n

    def wait_for(self, request_id: str, timeout: float, poll: float = 0.005) -> Reply | None:
        """Poll until the reply to ``request_id`` is stored or ``timeout`` seconds pass (then None)."""
        deadline = time.monotonic() + timeout
        while True:
            rep = self.get(request_id)
            if rep is not None:
                return rep
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(poll, left))

    def __repr__(self) -> str:
        return f"NatsOutputLog({self.path!r})"
