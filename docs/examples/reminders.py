# reminders.py: a hold that expires unless it is captured first
from charon import Application, Context, Operator

acct = Operator("acct")


@acct.function(public=True)
async def hold(ctx: Context, amount: int, seconds: float) -> str:
    ctx.put(ctx.get(default=0) - amount)
    timer = ctx.send_after(seconds, acct, ctx.key, release, amount)  # or ctx.send_at(unix_time, ...)
    ctx.put_item("hold", [timer, amount])
    return timer  # the timer's id


@acct.function
async def release(ctx: Context, amount: int) -> None:  # runs when the timer fires
    ctx.delete_item("hold")
    ctx.put(ctx.get(default=0) + amount)


@acct.function(public=True)
async def capture(ctx: Context) -> bool:
    held = ctx.get_item("hold")
    if held is None:
        return False  # nothing held: the timer fired already (release ran)
    ctx.delete_item("hold")
    return ctx.cancel_timer(held[0])  # True: cancelled before it fired


app = Application("reminders", [acct])

if __name__ == "__main__":
    from charon import InProcessRuntime, Request, serde

    rt = InProcessRuntime(app, partitions=2)
    rt.load("acct", {"a": 100})

    def run(rid: str, fn: str, args: list[object], now: float) -> object:
        result = rt.run_epoch([Request(rid, "acct", "a", fn, serde.encode(args), ts=now)], now=now)
        (reply,) = result.replies.values()
        return serde.decode(reply.value)

    run("r1", "hold", [30, 5.0], now=1000.0)  # an epoch at time 1000
    print(rt.read_state("acct", "a"), [t.function for t in rt.timers("acct", "a")])  # 70 ['release']
    rt.run_epoch([], now=1004.0)  # not due yet
    fired = rt.run_epoch([], now=1005.0).timers  # due: fires here, once
    print(rt.read_state("acct", "a"), [t.function for t in fired])  # 100 ['release']
    print(run("r2", "capture", [], now=1006.0))  # False: it fired already
    run("r3", "hold", [50, 5.0], now=1007.0)
    print(run("r4", "capture", [], now=1008.0), rt.read_state("acct", "a"))  # True 50: captured, never fires
    rt.run_epoch([], now=1020.0)
    print(rt.read_state("acct", "a"), rt.timers("acct", "a"))  # 50 []
