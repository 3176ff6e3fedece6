# heartbeat.py: a function on a cron schedule, each slot once (run here with an explicit clock)
from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.core.schedules import SCHEDULE_OPERATOR, declarations

reports = Operator("reports")
app = Application("ops", [reports])


@app.schedule("*/5 * * * * *", key="main", name="rollup", catch_up=1)  # every 5 s (6 fields: seconds first)
@reports.function
async def rollup(ctx: Context, firing: dict) -> None:
    # firing = {"schedule": "rollup", "slot": s, "id": "rollup@<s>", "time": t}: id is the slot's idempotency key
    done = ctx.get(default=[])
    ctx.put([*done, firing["id"]])


if __name__ == "__main__":
    rt = InProcessRuntime(app, partitions=2)
    t0 = 1_700_000_000.0  # a multiple of 5 s
    # `charon run` and InProcessRuntime.start() upsert the declared schedules at every start; with an explicit
    # clock, the same upserts go into the first epoch
    rt.run_epoch([Request(rid, SCHEDULE_OPERATOR, spec["name"], "upsert", serde.encode([spec, True]), t0)
                  for rid, spec in declarations(app)], now=t0)
    for now in (t0 + 5, t0 + 6, t0 + 10, t0 + 11, t0 + 40, t0 + 41):  # down from 11 s to 40 s
        rt.run_epoch([], now=now)
    fired = rt.read_state("reports", "main")
    # 5 and 10 on time; after the downtime the slot due now (40) and catch_up=1 missed one (35); 15..30 skipped
    assert fired == [f"rollup@{t0 + s:.0f}" for s in (5, 10, 35, 40)], fired
    assert rt.read_state(SCHEDULE_OPERATOR, "rollup")["skipped"] == 4
    print(fired)
