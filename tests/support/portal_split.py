"""The order flow with each side in its own process (so the portal test can SIGKILL one side alone):

    python tests/support/portal_split.py callee DIR     # payments + shipping: PortalServers, until DIR/stop exists
    python tests/support/portal_split.py caller DIR N   # orders: places o0..o{N-1}, ReplyPump, until all are final

Durable nodes under DIR/<app>; the callee reads the orders' request stream (DIR/orders/streams.sqlite) and
records replies in DIR/<app>/outbox.sqlite, which the caller's ReplyPump turns into continuations.
"""

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from portal_deployment import CUSTOMERS, ITEMS, MONEY_EACH, STOCK_EACH, order  # noqa: E402

from charon.apps.orderflow import FINAL, orders_app, payments_app, shipping_app  # noqa: E402
from charon.runtime.deployment import PortalOutbox, PortalServer, ReplyPump  # noqa: E402
from charon.runtime.node.inprocess import InProcessRuntime  # noqa: E402


def node(root: str, app):  # noqa: ANN001, ANN201
    os.makedirs(os.path.join(root, app.name), exist_ok=True)
    return InProcessRuntime(app, partitions=2, data_dir=os.path.join(root, app.name, "node"), fsync=False)


async def callee(root: str) -> None:
    p, s = node(root, payments_app), node(root, shipping_app)
    requests = {"orders": os.path.join(root, "orders", "node", "streams.sqlite")}
    async with p, s:
        await asyncio.gather(*(p.submit("wallets", f"c{c}", "deposit", [MONEY_EACH], request_id=f"seed-c{c}")
                               for c in range(CUSTOMERS)))
        await asyncio.gather(*(s.submit("stock", f"i{i}", "restock", [STOCK_EACH], request_id=f"seed-i{i}")
                               for i in range(ITEMS)))
        while not os.path.exists(requests["orders"]):  # the orders node creates it with its first request
            await asyncio.sleep(0.02)
        servers = [PortalServer(rt, requests, PortalOutbox(os.path.join(root, rt.app.name, "outbox.sqlite")),
                                checkpoint_dir=os.path.join(root, rt.app.name), max_events=7) for rt in (p, s)]
        print("started", servers[0].offsets["orders"], flush=True)
        while not os.path.exists(os.path.join(root, "stop")):
            if not sum([await sv.step() for sv in servers]):
                await asyncio.sleep(0.01)
    p.close()
    s.close()
    print("done", flush=True)


async def caller(root: str, n: int) -> None:
    o = node(root, orders_app)
    boxes = {a: PortalOutbox(os.path.join(root, a, "outbox.sqlite")) for a in ("payments", "shipping")}
    async with o:
        pump = ReplyPump(o, boxes, checkpoint_dir=os.path.join(root, "orders"), max_events=7)
        print("started", sum(pump.offsets.values()), flush=True)
        for start in range(0, n, 10):
            await asyncio.gather(*(o.submit("orders", f"o{k}", "place", order(k), request_id=f"place-{k}")
                                   for k in range(start, min(n, start + 10))))
            await pump.step()
            await asyncio.sleep(0.05)  # paced, so that the test's kills land while orders flow
        while True:
            if not await pump.step():
                orders = o.entities("orders")
                if len(orders) == n and all(v["status"] in FINAL for v in orders.values()):
                    break
                await asyncio.sleep(0.01)
    o.close()
    print("done", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "callee":
        asyncio.run(callee(sys.argv[2]))
    else:
        asyncio.run(caller(sys.argv[2], int(sys.argv[3])))
