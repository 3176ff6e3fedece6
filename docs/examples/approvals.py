# approvals.py: an order waits for a human's approval (a durable promise), at most an hour
import asyncio

from charon import Application, Context, InProcessRuntime, Operator, PromiseTimedOut, promise_value

orders = Operator("orders")


@orders.function(public=True)
async def place(ctx: Context, amount: int) -> str:
    pid = ctx.promise(then=decided, carry=[amount], timeout=3600.0)  # exists iff this transaction commits
    ctx.put({"state": "awaiting approval", "promise": pid})
    return pid  # give it to the approver (a webhook, an email link, an agent)


@orders.function  # internal: only the promise's outcome runs it, exactly once
async def decided(ctx: Context, outcome: dict, amount: int) -> None:
    try:
        note = promise_value(outcome)  # the resolved value, or PromiseRejected / PromiseTimedOut / ...Cancelled
        ctx.put({"state": "approved", "amount": amount, "note": note})
    except PromiseTimedOut:
        ctx.put({"state": "expired"})


app = Application("shop", [orders])


async def main() -> None:
    async with InProcessRuntime(app) as rt:
        pid = await rt.invoke("orders", "o1", "place", 30)
        # from outside: POST /promises/{pid}/resolve {"value": ...}, Client.resolve(pid, ...) or
        # `charon promises resolve PID '"ok"'`; here the runtime's own entry to the same transaction
        await rt.invoke("charon.promise", pid, "resolve", "looks fine")
        while rt.read_state("orders", "o1")["state"] == "awaiting approval":
            await asyncio.sleep(0.01)
        assert rt.read_state("orders", "o1") == {"state": "approved", "amount": 30, "note": "looks fine"}
        print(rt.read_state("orders", "o1"))


if __name__ == "__main__":
    asyncio.run(main())
