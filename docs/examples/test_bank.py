# test_bank.py: the bank in-process, with the same engine as production
import asyncio

from bank import app

from charon import InProcessRuntime, TransactionAborted


async def main() -> None:
    rt = InProcessRuntime(app, partitions=4)
    rt.load("account", {"alice": 100, "bob": 0})
    async with rt:
        assert await rt.invoke("account", "alice", "transfer", "bob", 30) == 70
        try:
            await rt.invoke("account", "bob", "transfer", "alice", 1000)
        except TransactionAborted as e:
            assert (e.error_type, e.message) == ("NotEnoughCredit", "bob has 30")
        else:
            raise AssertionError("the transfer should have aborted")
        assert rt.read_state("account", "alice") == 70  # the aborted transfer changed nothing
    print("ok")


asyncio.run(main())
