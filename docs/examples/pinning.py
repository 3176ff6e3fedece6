# pinning.py: a workflow in flight keeps the code version it started with; an operator migrates it
import asyncio

from charon import Application, Context, InProcessRuntime, Workflow


def version(label: str) -> Application:
    """The same workflow in two versions of the code: each step says which version ran it."""
    onboard = Workflow("onboard")

    @onboard.step(first=True)
    async def welcome(ctx: Context, w, outcome: dict):
        w.state["ran"] = [f"{label}:welcome"]
        return w.promise(then=verify)  # waits for the outside world (a human, a webhook)

    @onboard.step
    async def verify(ctx: Context, w, outcome: dict):
        w.state["ran"].append(f"{label}:verify")
        return w.done(w.state["ran"])

    return Application("onboarding", [], workflows=[onboard])


v1, v2 = version("v1"), version("v2")
OP = "charon.workflow.onboard"


async def step(rt: InProcessRuntime, wid: str, status: str) -> dict:
    while (rec := rt.read_state(OP, wid)) is None or rec["status"] != status:
        await asyncio.sleep(0.01)
    return rec


async def main() -> None:
    async with InProcessRuntime(v1) as rt:  # deployed as code version "1"
        for wid in ("ann", "bob"):
            await rt.invoke(OP, wid, "start", None)  # POST /workflows/onboard {"id": ...}
        ann, bob = await step(rt, "ann", "waiting"), await step(rt, "bob", "waiting")
        await rt.engine().update_code("pinning:v2", "2")  # charon deploy pinning:v2 2
        await rt.invoke(OP, "cid", "start", None)  # a new workflow starts on version 2
        await rt.invoke("charon.promise", ann["awaiting"][0]["id"], "resolve", True)
        print((await step(rt, "ann", "done"))["result"])  # ann finishes on the code it started with
        # charon workflows migrate --from 1 (POST /admin/workflows/migrate): bob's own transaction moves it
        await rt.invoke(OP, "bob", "migrate", "1")
        await rt.invoke("charon.promise", bob["awaiting"][0]["id"], "resolve", True)
        print((await step(rt, "bob", "done"))["result"])  # its next step runs version 2
        cid = await step(rt, "cid", "waiting")
        print(cid["version"], cid["state"]["ran"])


if __name__ == "__main__":
    asyncio.run(main())
