"""Configuration of a deployment, with sane embedded defaults (Spark local mode, files under ./charon-data)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class SparkConfig:
    """How the Spark runtime runs.

    Every field can also be set from the environment as ``CHARON_<FIELD>`` (upper case), e.g.
    ``CHARON_MASTER=spark://host:7077``; see :meth:`from_env`.
    """

    master: str = "local[*]"  # local[N], spark://host:port, yarn, k8s://...
    data_dir: str = "charon-data"  # input log, output log and (by default) the checkpoint location
    checkpoint: str | None = None  # durable state, epoch records and Spark's query checkpoint
    partitions: int = 4  # engine partitions (each with its own resident store)
    log_partitions: int | None = None  # input-log partitions = sequencers (default: partitions)
    max_batch: int = 10_000  # most requests per epoch (micro-batch)
    trigger_ms: int = 0  # micro-batch trigger interval; 0 = as soon as the previous one ends
    idle_wait_ms: int = 1000  # an idle source waits this long for an append before reporting "no data"
    local_dir: str | None = None  # executor-local store directory (default: per-executor temp dir)
    compact_every: int = 20  # compact durable deltas every N epochs (in the background)
    truncate_log: bool = True  # drop input-log entries older than the last compacted snapshot
    max_rounds: int = 200  # rounds after which a call graph is aborted as never finishing
    task_max_failures: int = 4  # Spark attempts per task (local[N,F] in local mode, spark.task.maxFailures)
    epoch_max_failures: int = 3  # query restarts on the same epoch before the runtime gives up (deterministic)
    restart_backoff_s: float = 1.0  # first delay before restarting a failed query; doubles, at most 30 s
    keep_epoch_stats: int = 1000  # per-epoch statistics kept in memory (the newest N)
    app_name: str = "charon"
    spark_conf: dict[str, str] = field(default_factory=dict)

    @property
    def checkpoint_dir(self) -> str:
        return os.path.abspath(self.checkpoint or os.path.join(self.data_dir, "checkpoint"))

    @property
    def n_log_partitions(self) -> int:
        return self.log_partitions or self.partitions

    @classmethod
    def from_env(cls, **overrides: object) -> SparkConfig:
        """Defaults, then ``CHARON_*`` environment variables, then ``overrides``."""
        cfg = cls()
        for name, f in cls.__dataclass_fields__.items():
            raw = os.environ.get(f"CHARON_{name.upper()}")
            if raw is None or name == "spark_conf":
                continue
            cur = getattr(cfg, name)
            if isinstance(cur, bool):
                value: object = raw.lower() in ("1", "true", "yes", "on")
            elif isinstance(cur, float):
                value = float(raw)
            elif isinstance(cur, int) or f.type in ("int", "int | None"):
                value = int(raw)
            else:
                value = raw
            setattr(cfg, name, value)
        for k, v in overrides.items():
            if v is not None:
                if k not in cls.__dataclass_fields__:
                    raise TypeError(f"unknown setting {k!r}")
                setattr(cfg, k, v)
        if cfg.partitions < 1:
            raise ValueError("partitions must be at least 1")
        return cfg
