"""Bug r2 through the Spark exchange's real task function (run_partitions, LMDB, durable copy), as in
tests/core/test_live_coroutines.py: the same epoch gives a different committed state depending on whether the
round that resumes the suspended function lands in the worker that holds its live coroutine."""
import os, sys, tempfile, shutil
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from charon import Request, serde
from charon.core import partition
from charon.config import SparkConfig
from charon.state.durable import DurableState
from charon.core.epoch import EpochCoordinator
from charon.runtime.spark.exchange import SparkExchange
import early_app

class Hop(SparkExchange):
    def __init__(self, *a, pattern, **kw):
        super().__init__(*a, **kw); self.tables = [{}, {}]; self.pattern = pattern; self.n = 0
    def run_job(self, payloads):
        table = self.tables[self.pattern(self.n)]; self.n += 1
        saved = partition._LIVE; partition._LIVE = table
        try:
            return list(self.fn(payloads))
        finally:
            partition._LIVE = saved

for name, pattern in [("same worker every round", lambda n: 0), ("first round in worker 0, later rounds in worker 1", lambda n: 0 if n == 0 else 1)]:
    tmp = tempfile.mkdtemp()
    cfg = SparkConfig(data_dir=tmp, partitions=2, local_dir=os.path.join(tmp, "local"))
    durable = DurableState(os.path.join(cfg.checkpoint_dir, "state"))
    for pid in range(2):
        durable.write_base(pid, -1, [])
    ex = Hop(None, "early_app:app", cfg, pattern=pattern)
    coord = EpochCoordinator(early_app.app, ex, sequencers=1)
    res = coord.run_epoch(0, [(0, Request("s", "acct", "A", "early_send", serde.encode([]), ts=1.0))])
    state = {}
    for pid in range(2):
        state.update(durable.load(pid, 0)[0])
    c = state.get(b"acct\0C\0")
    print(f"{name}: reply ok={res.replies[1].ok}, C = {serde.decode(c) if c else None}")
    shutil.rmtree(tmp, ignore_errors=True)
