"""The one place engines are built: :func:`make_engine` turns an :class:`EngineSpec` into an :class:`Engine`.

Everything above the runtime layer (``charon run``, the demo, tests) gets its engine here and then uses only the
contract (:mod:`charon.runtime.contract`); the engine kinds are named nowhere else.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Literal

from charon.errors import CharonError
from charon.log.location import is_networked
from charon.runtime.contract import Engine

if TYPE_CHECKING:
    from charon.runtime.control.inspector import InspectorSettings

__all__ = ["ENGINE_KINDS", "EngineOpenFailed", "EngineSpec", "EngineSpecError", "make_engine"]

EngineKind = Literal["inprocess", "spark", "remote"]
ENGINE_KINDS: tuple[str, ...] = ("inprocess", "spark", "remote")


class EngineSpecError(CharonError):
    """The settings do not describe an engine (a wrong combination of options): nothing was opened."""


class EngineOpenFailed(CharonError):
    """The engine could not be opened (its data directory belongs to another, its log is unreachable, ...)."""


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What to build: the engine ``kind``, the application ``target`` (``module:attribute``) and its settings.

    ``inprocess``: volatile without ``data_dir``, a durable node with one. ``spark``: configured from
    ``CHARON_*`` variables, then these settings (``log_partitions``: the input log's partition count). ``remote``:
    a gateway whose engine runs elsewhere, over the networked log at ``log_url`` or the SQLite logs in ``data_dir``,
    asking the driver at ``driver_url`` (if given) for its health and the routes it does not serve. ``log_url``
    (``nats://host:port/deployment``) puts the logs on NATS JetStream instead of SQLite files."""

    kind: str
    target: str
    partitions: int | None = None
    data_dir: str | None = None
    ephemeral: bool = False  # inprocess: nothing on disk (else durable in data_dir, default ./charon-data)
    fsync: bool = True
    reply_retention: int | None = None
    log_url: str | None = None
    storage_url: str | None = None  # inprocess: checkpoints also on object storage (file:///dir, s3://bucket/prefix)
    log_partitions: int | None = None
    function_timeout: float | None = None
    transaction_timeout: float | None = None  # inprocess: a transaction's steps in all per epoch (default 2x)
    exit_when_stuck: float | None = None
    determinism_check: bool = False
    inspector: bool = True  # the invocation inspector (charon.runtime.control.inspector); off: aborts are still logged
    inspector_records: int | None = None  # requests it keeps (default 10,000)
    inspector_bytes: int | None = None  # bytes of them it keeps (default 32 MiB)
    spark_exchange: str | None = None  # spark: "resident" (default) or "jobs" (else CHARON_EXCHANGE)
    driver_url: str | None = None  # remote: the driver's control channel (its health; the routes not served here)

    def check(self) -> None:
        """Raise :class:`EngineSpecError` for settings that do not fit together."""
        if self.kind not in ENGINE_KINDS:
            raise EngineSpecError(f"unknown engine {self.kind!r} ({', '.join(ENGINE_KINDS)})")
        if self.ephemeral and self.kind != "inprocess":
            raise EngineSpecError("--ephemeral applies to --engine inprocess only")
        if self.ephemeral and self.data_dir is not None:
            raise EngineSpecError("--ephemeral keeps nothing on disk: it takes no --data-dir")
        if self.log_url is not None and not is_networked(self.log_url):
            raise EngineSpecError(f"--log must be a nats://host:port/deployment URL, got {self.log_url!r}")
        if self.kind == "inprocess" and self.log_url is not None and self.ephemeral:
            raise EngineSpecError("--log needs a durable deployment (not --ephemeral)")
        if self.storage_url is not None:
            from charon.storage.location import StorageUrlError, check_storage_url

            if self.kind not in ("inprocess", "spark") or self.ephemeral:
                raise EngineSpecError("--storage applies to a durable --engine inprocess or spark (not --ephemeral)")
            try:
                check_storage_url(self.storage_url)
            except StorageUrlError as exc:
                raise EngineSpecError(f"--storage: {exc}") from None
        if self.log_partitions is not None and self.kind != "spark":
            raise EngineSpecError("--log-partitions applies to --engine spark only (the in-process engine logs its "
                                  "epochs in one partition)")
        if self.spark_exchange is not None:
            from charon.config import EXCHANGES

            if self.kind != "spark":
                raise EngineSpecError("--spark-exchange applies to --engine spark only")
            if self.spark_exchange not in EXCHANGES:
                raise EngineSpecError(f"--spark-exchange must be one of {', '.join(EXCHANGES)}, not "
                                      f"{self.spark_exchange!r}")
        if self.transaction_timeout is not None and self.kind != "inprocess":
            raise EngineSpecError("--transaction-timeout applies to --engine inprocess only (on spark a "
                                  "transaction's steps in a task are bounded by twice --function-timeout)")
        if self.kind == "remote" and self.log_url is None and self.data_dir is None:
            raise EngineSpecError("--engine remote needs --log nats://host:port/deployment or the driver's "
                                  "--data-dir (the engine's log)")
        if self.driver_url is not None and self.kind != "remote":
            raise EngineSpecError("--driver applies to --engine remote only (a gateway whose engine runs elsewhere)")
        if self.kind == "remote" and self.determinism_check:
            raise EngineSpecError("--check-determinism applies where functions run (the engine), not to "
                                  "--engine remote")


def make_engine(spec: EngineSpec) -> Engine:
    """Build (not start) the engine ``spec`` describes. :class:`EngineSpecError` for settings that do not fit,
    :class:`EngineOpenFailed` when it cannot be opened."""
    spec.check()
    if spec.kind == "inprocess":
        return _inprocess(spec)
    if spec.kind == "spark":
        return _spark(spec)
    return _remote(spec)


def _inprocess(spec: EngineSpec) -> Engine:
    from charon.log.nats import NatsLogError
    from charon.runtime.control.codeversions import load_app_ref
    from charon.runtime.control.owner import DataDirOwned, claim_data_dir
    from charon.runtime.guard.watchdog import DEFAULT_TIMEOUT
    from charon.runtime.node.inprocess import InProcessRuntime
    from charon.runtime.node.storage import NodeError
    from charon.storage.contract import StorageError

    application = load_app_ref(spec.target)
    data_dir = None if spec.ephemeral else os.path.abspath(spec.data_dir or "charon-data")
    try:
        if data_dir is not None:  # the directory belongs to one engine and application (refused otherwise)
            claim_data_dir(data_dir, "inprocess", application.name)
        retained = int(os.environ.get("CHARON_REPLY_RETENTION_BYTES", 128 << 20))
        rt = InProcessRuntime(application, partitions=spec.partitions, data_dir=data_dir, fsync=spec.fsync,
                              inspector=_inspector(spec),
                              reply_retention=spec.reply_retention, log_url=spec.log_url,
                              storage_url=spec.storage_url,
                              reply_retention_bytes=retained, exit_when_stuck=spec.exit_when_stuck,
                              determinism_check=spec.determinism_check,
                              effects=False,  # charon run --effects runs its executor itself (or workers do)
                              function_timeout=DEFAULT_TIMEOUT if spec.function_timeout is None else
                              spec.function_timeout, transaction_timeout=spec.transaction_timeout)
    except (NodeError, DataDirOwned) as exc:
        raise EngineOpenFailed(str(exc)) from None
    except StorageError as exc:  # object storage unreachable, refusing the credentials, or fencing this node
        raise EngineOpenFailed(f"object storage ({spec.storage_url}): {type(exc).__name__}: {exc}") from None
    except NatsLogError as exc:  # the NATS log did not answer within its open wait (CHARON_NATS_OPEN_WAIT_S)
        raise EngineOpenFailed(f"the log is not reachable: {exc}") from None
    return rt.engine()


def _inspector(spec: EngineSpec) -> InspectorSettings:
    from charon.runtime.control.inspector import InspectorSettings

    base = InspectorSettings()
    return InspectorSettings(spec.inspector, spec.inspector_records or base.max_records,
                             spec.inspector_bytes or base.max_bytes)


def _spark(spec: EngineSpec) -> Engine:
    from charon.config import SparkConfig
    from charon.runtime.control.codeversions import load_app_ref
    from charon.runtime.control.owner import DataDirOwned, claim_data_dir
    from charon.runtime.spark.layout import LayoutMismatch, read_layout
    from charon.runtime.spark.runtime import SparkRuntime
    from charon.storage.contract import StorageError

    target = spec.target if ":" in spec.target else f"{spec.target}:app"
    application = load_app_ref(target)  # fail early with a clear message
    extra: dict[str, object] = {} if spec.function_timeout is None else {"function_timeout": spec.function_timeout}
    if spec.determinism_check:  # else CHARON_DETERMINISM_CHECK decides
        extra["determinism_check"] = True
    if not spec.inspector:  # else CHARON_INSPECTOR decides
        extra["inspector"] = False
    extra.update(inspector_records=spec.inspector_records, inspector_bytes=spec.inspector_bytes,
                 exchange=spec.spark_exchange)  # None: CHARON_EXCHANGE, else the default ("resident")
    config = SparkConfig.from_env(partitions=spec.partitions, data_dir=spec.data_dir, log_url=spec.log_url,
                                  log_partitions=spec.log_partitions, storage_url=spec.storage_url, **extra)
    try:  # the directory belongs to one engine and application (refused otherwise)
        claim_data_dir(config.data_dir, "spark", application.name)
    except DataDirOwned as exc:
        raise EngineOpenFailed(str(exc)) from None
    if spec.partitions is None:  # not given (flag or CHARON_PARTITIONS): a checkpoint keeps its recorded layout
        layout = read_layout(config.checkpoint_dir)
        if layout is not None:
            config = dataclasses.replace(config, partitions=layout.partitions)
        elif "CHARON_PARTITIONS" not in os.environ and not config.storage_url:
            # a new deployment (not one whose layout may be on object storage, restored only later): as many as
            # the resident gang has tasks in local mode (SparkConfig.default_partitions)
            config = dataclasses.replace(config, partitions=config.default_partitions())
    try:
        rt = SparkRuntime(target, config)
        rt.exit_when_stuck = spec.exit_when_stuck is not None  # charon run: a step it cannot judge exits (75)
        return rt.engine()
    except LayoutMismatch as exc:  # the checkpoint was made with another partition count
        raise EngineOpenFailed(str(exc)) from None
    except StorageError as exc:  # object storage unreachable, refusing the credentials, or fencing this driver
        raise EngineOpenFailed(f"object storage ({config.storage_url}): {type(exc).__name__}: {exc}") from None
    except OSError as exc:  # e.g. the NATS log is not reachable
        raise EngineOpenFailed(f"the log is not reachable: {exc}") from None


def _remote(spec: EngineSpec) -> Engine:
    from charon.runtime.control.codeversions import load_app_ref
    from charon.runtime.remote import LogRuntime

    try:
        return LogRuntime(load_app_ref(spec.target), spec.log_url, data_dir=spec.data_dir, driver_url=spec.driver_url)
    except OSError as exc:
        raise EngineOpenFailed(f"the log at {spec.log_url or spec.data_dir} is not reachable: {exc}") from None
