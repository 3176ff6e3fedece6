# check_epoch.py: one epoch, checked against the serial-execution oracle
from bank import app

from charon import InProcessRuntime, Request, serde
from charon.testing import check_epoch

rt = InProcessRuntime(app, partitions=4)
rt.load("account", {"alice": 100, "bob": 0})
batch = [
    Request(f"r{i}", "account", who, "transfer", serde.encode([to, 40]))
    for i, (who, to) in enumerate([("alice", "bob"), ("bob", "alice"), ("alice", "bob")])
]
before = rt.snapshot()
result = rt.run_epoch(batch)  # exactly one epoch, deterministically
check_epoch(app, before, rt.snapshot(), result)  # raises AssertionError on any difference
# the replies in their serial order (epoch, position): all three transfers commit
in_order = sorted(result.replies.values(), key=lambda r: r.position)
print([(r.request_id, r.ok or r.error_type) for r in in_order])
