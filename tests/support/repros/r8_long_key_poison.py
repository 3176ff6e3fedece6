"""An entity key (or item name) over LMDB's 511-byte key limit is accepted everywhere up to the finalize
round, where LmdbStore.commit raises ValueError: after the early reply went out, the epoch cannot be
finalized, and a replay fails identically (a poison pill for the Spark query). Same core, LMDB stores."""
import os, tempfile, shutil
from charon import Application, Context, Operator, Request, serde
from charon.state.durable import DurableState
from charon.core.epoch import EpochCoordinator
from charon.runtime.node.inprocess import LocalExchange
from charon.state.lmdbstore import LmdbStore
from charon.core.partition import PartitionUnit

op = Operator("u")

@op.function(public=True)
async def put(ctx: Context, v: int) -> int:
    ctx.put(v)
    return v

app = Application("long", [op])
tmp = tempfile.mkdtemp()
durable = DurableState(os.path.join(tmp, "state"))
stores = [LmdbStore(os.path.join(tmp, "local"), p, durable) for p in range(2)]
for s in stores:
    s.bulk_load(-1, [])
sent = []
for attempt in (1, 2):  # the original run, then a replay of the same epoch
    units = [PartitionUnit(p, 2, app, s) for p, s in enumerate(stores)]
    coord = EpochCoordinator(app, LocalExchange(units), on_replies=sent.extend)
    try:
        coord.run_epoch(0, [(0, Request("q", "u", "k" * 600, "put", serde.encode([1]), ts=1.0))])
        print(f"attempt {attempt}: epoch finalized")
    except Exception as e:
        print(f"attempt {attempt}: {type(e).__name__}: {str(e)[:90]}")
print("replies already delivered:", [(r.request_id, r.ok) for r in sent])
shutil.rmtree(tmp, ignore_errors=True)
