"""SparkRuntime.read_keys runs read_entities(epoch=last recorded epoch N) on the executors, which calls
store.ensure_epoch(N). If the streaming query's epoch N+1 has already run its finalize round on that
partition (local copy and durable delta at N+1) but not yet written epoch record N+1, ensure_epoch takes
the "ahead = replayed after a crash" branch: it *truncates the durable delta N+1* and reloads N. The driver
then records epoch N+1 as done; the next epoch's ensure_epoch(N+1) finds the durable copy at N and fails.
This replays that interleaving with the real executor-side functions (no Spark needed)."""
import os, shutil, tempfile
from charon.state.durable import DurableState
from charon.state.lmdbstore import open_store, StoreError
from charon.runtime.spark.tasks import read_entities
from charon.runtime.spark.layout import executor_local_dir

tmp = tempfile.mkdtemp(prefix="charon-r7-")
ckpt = os.path.join(tmp, "ckpt"); durable_root = os.path.join(ckpt, "state")
root = executor_local_dir(None, ckpt)
pid = 0
store = open_store(root, pid, durable_root)
store.ensure_epoch(-1)
store.commit(0, {b"a\0k\0": b"v0"})           # epoch 0, recorded
store.commit(1, {b"a\0k\0": b"v1"})           # epoch 1: finalize round done, record 1 not yet written
print("before read: local epoch", store.epoch, "durable manifest", DurableState(durable_root).manifest(pid))
# concurrently, read_state() settled on epoch 0 (the last recorded one) and its Spark task runs now:
got = dict(read_entities("unused:app", None, durable_root, ckpt, 0, [(pid, [b"a\0k\0"])]))
print("read_state saw", got)
print("after read:  local epoch", store.epoch, "durable manifest", DurableState(durable_root).manifest(pid))
# the driver writes record 1 (it does not look at the store); epoch 2's first round:
try:
    store.ensure_epoch(1)
    print("epoch 2 round: ensure_epoch(1) ok, value", store.get(b"a\0k\0"))
except StoreError as e:
    print("epoch 2 round: StoreError:", e)
shutil.rmtree(tmp, ignore_errors=True)
