# checkout.py: a workflow: take stock, charge the card (an effect), wait for an approval (a durable promise) and a
# timer, then ship; a declined card gives the stock back (the saga's compensation)
import asyncio

from charon import Application, Context, InProcessRuntime, Operator, Workflow

stock = Operator("stock")
checkout = Workflow("checkout")  # an operator of its own: one entity per running workflow


@stock.function
async def take(ctx: Context, n: int) -> None:
    if ctx.get(0) < n:
        raise ValueError("out of stock")  # aborts the step's transaction: the step is run again (attempts)
    ctx.put(ctx.get(0) - n)


@stock.function
async def give(ctx: Context, n: int) -> None:
    ctx.put(ctx.get(0) + n)


@checkout.step(first=True)
async def reserve(ctx: Context, w, outcome: dict):
    order = w.state["order"] = outcome["value"]  # the start's input
    await ctx.call(stock, order["sku"], take, order["qty"])  # any calls: the step is one transaction
    w.undo(stock, order["sku"], give, order["qty"])  # run by w.compensate(), newest first
    return w.effect("charge", order["card"], order["amount"], then=charged)  # requested iff this step commits


@checkout.step
async def charged(ctx: Context, w, result: dict):
    if not result["ok"] or not result["value"]:
        return w.compensate()  # the undos, then the workflow ends "compensated"
    return w.promise(then=approved, timeout=86_400)  # its id: in the record's "awaiting"


@checkout.step
async def approved(ctx: Context, w, outcome: dict):
    if not outcome["ok"]:  # rejected, cancelled or timed out
        return w.compensate()
    return w.sleep(0.1, then=ship)  # a timer


@checkout.step
async def ship(ctx: Context, w, _: dict):
    return w.done({"shipped": w.state["order"]["sku"]})


def charge(effect_id: str, card: str, amount: int) -> bool:  # I/O allowed; effect_id is the idempotency key
    return card != "declined"


app = Application("shop", [stock], workflows=[checkout], effects={"charge": charge})
OP = "charon.workflow.checkout"  # the workflow's operator (its functions are internal)


async def finished(rt: InProcessRuntime, wid: str) -> dict:
    while (rec := rt.read_state(OP, wid))["status"] not in ("done", "failed", "compensated"):
        await asyncio.sleep(0.01)
    return rec


async def main() -> None:
    async with InProcessRuntime(app) as rt:
        await rt.invoke("stock", "apple", "give", 5)
        # from outside: POST /workflows/checkout {"id": "o1", "input": {...}} or Client.start_workflow; from a
        # transaction: checkout.start(ctx, input, id=...); here the runtime's own entry to the same transaction
        await rt.invoke(OP, "o1", "start", {"sku": "apple", "qty": 2, "card": "visa", "amount": 10})
        await rt.invoke(OP, "o2", "start", {"sku": "apple", "qty": 1, "card": "declined", "amount": 5})
        while (rec := rt.read_state(OP, "o1"))["step"] != "approved" or rec["status"] != "waiting":
            await asyncio.sleep(0.01)
        pid = rec["awaiting"][0]["id"]  # POST /promises/{pid}/resolve, Client.resolve(pid, ...)
        await rt.invoke("charon.promise", pid, "resolve", "looks fine")
        o1, o2 = await finished(rt, "o1"), await finished(rt, "o2")
        print(o1["status"], o1["result"], [h["step"] for h in o1["history"]])
        print(o2["status"], [h["step"] for h in o2["history"]], rt.read_state("stock", "apple"))


if __name__ == "__main__":
    asyncio.run(main())
