"""The order -> payment -> shipping deployment as a subprocess (so the portal test can SIGKILL it):

    python tests/support/portal_deployment.py DIR N

Three durable nodes under DIR (orders, payments, shipping) joined by portals; seeds the wallets and the
stock, places orders o0..o{N-1} (request ids ``place-<k>``, so re-placing after a restart runs nothing
twice), waits until every portal request is answered, prints ``done``.
"""

import asyncio
import os
import random
import sys

from charon.apps.orderflow import orders_app, payments_app, shipping_app
from charon.runtime.deployment import Deployment
from charon.runtime.node.inprocess import InProcessRuntime

CUSTOMERS, ITEMS, MONEY_EACH, STOCK_EACH = 8, 4, 200, 40


def order(k: int) -> list:
    rng = random.Random(k)
    return [f"c{rng.randrange(CUSTOMERS)}", f"i{rng.randrange(ITEMS)}", rng.randint(1, 3), rng.randint(1, 9)]


async def main() -> None:
    root, n = sys.argv[1], int(sys.argv[2])
    o, p, s = (InProcessRuntime(a, partitions=2, data_dir=os.path.join(root, a.name), fsync=False)
               for a in (orders_app, payments_app, shipping_app))
    async with o, p, s:
        await asyncio.gather(*(p.submit("wallets", f"c{c}", "deposit", [MONEY_EACH], request_id=f"seed-c{c}")
                               for c in range(CUSTOMERS)))
        await asyncio.gather(*(s.submit("stock", f"i{i}", "restock", [STOCK_EACH], request_id=f"seed-i{i}")
                               for i in range(ITEMS)))
        dep = Deployment([o, p, s])
        print("started", dep.routers["orders"].offset, flush=True)
        async with dep:
            for start in range(0, n, 10):
                await asyncio.gather(*(o.submit("orders", f"o{k}", "place", order(k), request_id=f"place-{k}")
                                       for k in range(start, min(n, start + 10))))
                await asyncio.sleep(0.05)  # paced, so that the test's kills land while orders flow
            await dep.settle(timeout=120)
    for rt in (o, p, s):
        rt.close()
    print("done", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
