# migrating.py: the new code maps an old workflow's step and state (@wf.migrates); an operator moves it
import asyncio

from charon import Application, Context, InProcessRuntime, NotMigratable, Workflow


def version1() -> Application:
    checkout = Workflow("checkout")

    @checkout.step(first=True)
    async def charged(ctx: Context, w, outcome: dict):
        w.state["amount"] = outcome["value"]
        return w.promise(then=approved if outcome["value"] < 100 else review)  # a human approves

    @checkout.step
    async def approved(ctx: Context, w, outcome: dict):
        return w.done(f"v1 paid {w.state['amount']}")

    @checkout.step
    async def review(ctx: Context, w, outcome: dict):
        return w.done(f"v1 reviewed {w.state['amount']}")

    return Application("shop", [], workflows=[checkout])


def version2() -> Application:
    checkout = Workflow("checkout")

    @checkout.step(first=True)
    async def charged(ctx: Context, w, outcome: dict):
        w.state.update(amount=outcome["value"], currency="EUR")
        return w.promise(then=approved_v2)

    @checkout.step
    async def approved_v2(ctx: Context, w, outcome: dict):
        return w.done(f"v2 paid {w.state['amount']} {w.state['currency']}")

    @checkout.migrates("1", steps={"charged": "charged", "approved": "approved_v2"})
    def from_v1(state: dict) -> dict:  # pure: the old state in, the new state out
        return {**state, "currency": "EUR"}

    return Application("shop", [], workflows=[checkout])


v1, v2 = version1(), version2()
OP = "charon.workflow.checkout"


async def until(rt: InProcessRuntime, wid: str, status: str) -> dict:
    while (rec := rt.read_state(OP, wid)) is None or rec["status"] != status:
        await asyncio.sleep(0.01)
    return rec


async def main() -> None:
    async with InProcessRuntime(v1) as rt:  # deployed as code version "1"
        for wid, amount in (("ann", 40), ("bob", 500)):
            await rt.invoke(OP, wid, "start", amount)  # POST /workflows/checkout {"id": ..., "input": ...}
        ann, bob = await until(rt, "ann", "waiting"), await until(rt, "bob", "waiting")
        await rt.engine().update_code("migrating:v2", "2")  # charon deploy migrating:v2 2
        # charon workflows migrate --from 1: each workflow's own transaction applies the declared migration
        await rt.invoke(OP, "ann", "migrate", "1")
        moved = rt.read_state(OP, "ann")
        print(moved["version"], moved["step"], moved["state"])
        try:
            await rt.invoke(OP, "bob", "migrate", "1")  # waiting at review, which the migration does not map
        except NotMigratable as exc:
            print("bob stays on 1:", exc)
        for rec in (ann, bob):  # their awaits are kept: each resolve runs the step the record names
            await rt.invoke("charon.promise", rec["awaiting"][0]["id"], "resolve", True)
        print((await until(rt, "ann", "done"))["result"], "|", (await until(rt, "bob", "done"))["result"])


if __name__ == "__main__":
    asyncio.run(main())
