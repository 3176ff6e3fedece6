# bulk.py: cancel what waits, by filter, a page at a time: a dry run first, then the operation (audited)
import time

from charon import Application, Context, InProcessRuntime, Limit, Operator
from charon.client import Client
from charon.server.serve import BackgroundServer

orders = Operator("orders")
mail = Operator("mail")


@orders.function(public=True)
async def place(ctx: Context) -> str:
    pid = ctx.promise(then=decided, timeout=3600.0)  # waits for an approval
    ctx.put({"state": "awaiting approval"})
    return pid


@orders.function
async def decided(ctx: Context, outcome: dict) -> None:
    ctx.put({"state": "approved" if outcome["ok"] else outcome["error_type"]})


@mail.function(public=True, limit=Limit(rate=0.01, burst=1, per="key"))  # one mail per key every 100 s
async def send(ctx: Context, text: str) -> None:
    ctx.put(text)


app = Application("shop", [orders, mail])

with BackgroundServer(InProcessRuntime(app), token="s3cret-admin") as srv, \
        Client(srv.url, token="s3cret-admin") as c:
    for region in ("eu", "us"):
        for i in range(3):
            c.invoke("orders", f"{region}-{i}", "place")
    # 1. how many would it touch? (nothing changes)
    dry = c.bulk("promises", "cancel", {"key_prefix": "eu-"}, dry_run=True)
    assert (dry["matched"], dry["done"]) == (3, 0)
    # 2. cancel them, 2 looked at per call (bulk_all follows `next`, one operation id for every page)
    done = c.bulk_all("promises", "cancel", {"key_prefix": "eu-"}, limit=2, reason="region closed")
    assert done["done"] == 3
    while c.read_state("orders", ["eu-0"])["entities"]["eu-0"]["state"] == "awaiting approval":
        time.sleep(0.01)  # each continuation runs once, with PromiseCancelled
    states = c.read_state("orders", [f"{r}-{i}" for r in ("eu", "us") for i in range(3)])["entities"]
    assert [s["state"] for s in states.values()] == ["PromiseCancelled"] * 3 + ["awaiting approval"] * 3

    # invocations that wait for admission: cancelled by the epoch that takes the cancel
    rids = [c.submit("mail", "bob", "send", f"newsletter {i}") for i in range(4)]
    while c.limits()["held"] < 3:
        time.sleep(0.01)
    gone = c.bulk("invocations", "cancel", {"operator": "mail", "function": "send"})
    assert gone["done"] == 3 and sorted(gone["items"]) == sorted(rids[1:])
    print(done["done"], gone["done"], c.limits()["held"])  # 3 3 0
