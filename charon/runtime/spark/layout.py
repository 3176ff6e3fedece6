"""The partition layout of a Spark checkpoint and where its files live: ``layout.json`` (engine and log partition
counts, the durable state's directory: a rescale's commit point), the epoch records under ``epochs/``, and the
executor-local directories of the resident partition stores."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable

import msgspec

from charon.config import SparkConfig
from charon.core.epoch import EPOCH_CHUNK
from charon.errors import CharonError
from charon.storage.files import write_file_atomic


class LayoutMismatch(CharonError):
    """The configured partition layout differs from the one the checkpoint was created with."""


class Layout(msgspec.Struct):
    """The partition layout of a checkpoint (``<checkpoint>/layout.json``): engine partitions, the input log's
    routing count (``log_partitions``; the log's own metadata holds it too, and its physical count) and the
    directory of the durable state (a rescale writes a new one; switching this file is its commit point)."""

    partitions: int
    log_partitions: int
    state: str = "state"
    # transactions per chunk of the epochs run before any epoch is recorded (then each record names its next
    # epoch's, EpochRecord.next_chunk): chosen at the checkpoint's first start (-1: a checkpoint from before)
    first_chunk: int = -1


def layout_path(checkpoint: str) -> str:
    """The checkpoint's layout file (switching it is a rescale's commit point)."""
    return os.path.join(checkpoint, "layout.json")


def records_dir(checkpoint: str) -> str:
    """The directory of the checkpoint's epoch records (:class:`~charon.state.records.EpochRecord`, one a file)."""
    return os.path.join(checkpoint, "epochs")


def record_path(checkpoint: str, epoch: int) -> str:
    """The file of epoch ``epoch``'s record."""
    return os.path.join(records_dir(checkpoint), f"{epoch:012d}.msgpack")


def bounds_dir(checkpoint: str) -> str:
    """The directory of the direct sequencer's epoch bounds (:mod:`~charon.runtime.spark.sequencer`): the offsets
    each epoch covers, written before it runs and removed once its record is written."""
    return os.path.join(checkpoint, "bounds")


def bound_path(checkpoint: str, epoch: int) -> str:
    """The file of epoch ``epoch``'s bound."""
    return os.path.join(bounds_dir(checkpoint), f"{epoch:012d}.json")


def chunk_for(config: SparkConfig) -> int:
    """Transactions per chunk of an epoch (:data:`charon.core.epoch.EPOCH_CHUNK`) where the rest of an epoch
    runs in one job (``single_task_rest`` in local mode; a split rest, ``split_rest`` on a cluster), where a
    round costs little; 0 (whole epochs) where each round is a Spark job of its own, as chunks would multiply the
    rounds (``benchmarks/spark/chunk_rounds_cluster.py``)."""
    local = config.master.strip().startswith("local")
    one_job = config.single_task_rest if local else config.split_rest in ("on", "cluster")
    return EPOCH_CHUNK if one_job else 0


def read_layout(checkpoint: str) -> Layout | None:
    """The checkpoint's recorded layout, or None before its first start."""
    try:
        with open(layout_path(checkpoint), "rb") as f:
            return msgspec.json.decode(f.read(), type=Layout)
    except FileNotFoundError:
        return None


def state_root(checkpoint: str) -> str:
    """The durable state's directory of the layout in force."""
    layout = read_layout(checkpoint)
    return os.path.join(checkpoint, layout.state if layout is not None else "state")


def storage_location(url: str) -> str:
    """A storage URL as the executors are given it: ``s3://bucket/prefix`` or ``file:///abs/dir`` (a plain path
    made a ``file://`` URL), without a trailing ``/``."""
    from charon.storage.location import check_storage_url

    scheme, where, _ = check_storage_url(url)
    if scheme == "file":
        return "file://" + os.path.abspath(where).rstrip("/")
    return url.rstrip("/")


def durable_location(config: SparkConfig) -> str:
    """Where the executors find the durable state of the layout in force: its directory under the checkpoint, or,
    with object storage (``storage_url``), ``<storage URL>/<state dir>`` (:func:`charon.state.durable.durable_at`:
    each executor caches it in its local directory)."""
    root = state_root(config.checkpoint_dir)
    if not config.storage_url:
        return root
    return f"{storage_location(config.storage_url)}/{os.path.basename(root)}"


def remove_old_layouts(checkpoint: str, keep: str) -> None:
    """Delete the state directories of layouts other than ``keep`` (a rescale's old one, or the new one of a
    rescale that did not reach its commit point)."""
    for name in os.listdir(checkpoint):
        if name.startswith("state") and name != keep and os.path.isdir(os.path.join(checkpoint, name)):
            shutil.rmtree(os.path.join(checkpoint, name), ignore_errors=True)


def check_layout(checkpoint: str, partitions: int, log_partitions: int, first_chunk: int = -1,
                 write: Callable[[str, bytes], None] = write_file_atomic) -> Layout:
    """Record the layout at a checkpoint's first start; later, record the input log's routing count (the
    runtime resized the log to it) and return the recorded layout (whose engine partition count the runtime
    then rescales to the configured one, :meth:`SparkRuntime.rescale`). State directories of an interrupted
    rescale are removed."""
    path = layout_path(checkpoint)
    want = Layout(partitions, log_partitions, first_chunk=first_chunk)
    have = read_layout(checkpoint)
    if have is None:
        # a checkpoint from before layouts were recorded: its durable state names the partitions it has
        state = os.path.join(checkpoint, "state")
        pids = [int(n[1:]) for n in (os.listdir(state) if os.path.isdir(state) else [])
                if n.startswith("p") and n[1:].isdigit()]
        if pids and max(pids) + 1 > partitions:
            raise LayoutMismatch(
                f"the checkpoint {checkpoint} holds state of {max(pids) + 1} partitions, configured: {partitions} "
                "(rescaling is not supported: keep the original count or use a new data directory)"
            ) from None
        os.makedirs(checkpoint, exist_ok=True)
        write(path, msgspec.json.encode(want))
        return want
    if have.log_partitions != log_partitions:
        have = msgspec.structs.replace(have, log_partitions=log_partitions)
        write(path, msgspec.json.encode(have))
    remove_old_layouts(checkpoint, have.state)
    return have


def executor_local_dir(configured: str | None, checkpoint: str) -> str:
    """Where an executor keeps its resident stores: configured, else the executor's Spark dirs, else /tmp."""
    if configured:
        return configured
    base = (
        os.environ.get("CHARON_LOCAL_DIR")
        or (os.environ.get("SPARK_EXECUTOR_DIRS") or "").split(os.pathsep)[0].split(",")[0]
        or (os.environ.get("SPARK_LOCAL_DIRS") or "").split(",")[0]
        or tempfile.gettempdir()
    )
    import zlib

    return os.path.join(base, f"charon-{zlib.crc32(checkpoint.encode()):08x}")


_LOCAL_LAYOUT: dict[str, str] = {}  # executor-local base directory -> the newest layout this process used there


def _layout_rank(name: str | None) -> int:
    """Layouts in the order they were made: ``state`` first, then ``state-<time_ns in hex>``."""
    if name is None:
        return -1
    try:
        return int(name.split("-", 1)[1], 16) if name.startswith("state-") else 0
    except ValueError:
        return 0


def local_root(configured: str | None, checkpoint: str, durable_root: str) -> str:
    """The executor-local directory of the resident stores of the layout whose durable state is ``durable_root``:
    the base directory for the first layout, ``<base>/<state dir>`` for a rescaled one (its stores start empty
    and restore from the new bases). The first task of a newer layout in a process closes that process's
    stores of older layouts and deletes their directories (disk stays bounded; on a cluster each executor does
    so when it first runs the new layout). A late task of an older layout (a state read) deletes nothing."""
    base = executor_local_dir(configured, checkpoint)
    name = os.path.basename(durable_root.rstrip(os.sep))
    rank = _layout_rank(name)
    if rank > _layout_rank(_LOCAL_LAYOUT.get(base)):
        from charon.state.lmdbstore import close_stores

        close_stores(base, durable_root)
        if os.path.isdir(base):
            for entry in os.listdir(base):
                older = (entry.startswith("state") and _layout_rank(entry) < rank) or (
                    rank > 0 and ((entry.startswith("p") and entry[1:].isdigit()) or entry == "durable"))
                if older:
                    shutil.rmtree(os.path.join(base, entry), ignore_errors=True)
        _LOCAL_LAYOUT[base] = name
    return base if name == "state" else os.path.join(base, name)


def fsync_dir(path: str) -> None:
    """Make a new directory tree's entries durable (its subdirectories', then its own)."""
    for sub in [os.path.join(path, n) for n in os.listdir(path)] + [path]:
        if os.path.isdir(sub):
            fd = os.open(sub, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
