"""An application whose function catches every ``Exception`` in its endless loop (test_watchdog)."""

from charon import Application, Context, Operator

s = Operator("s")


@s.function(public=True)
async def swallow(ctx: Context) -> None:
    while True:
        try:
            while True:
                pass
        except Exception:  # noqa: BLE001, S110 - the mistake under test
            pass


swallow_app = Application("swallow", [s])
