"""The bank side of the wiring test as a subprocess (so it can be SIGKILLed):

    python tests/support/wire_consumer.py BANK_DIR SHOP_STREAMS_DB N

A durable ``bank`` node fed by the shop's ``to_pay`` stream through a StreamWire (resuming from its
checkpoint file); exits once N events were delivered.
"""

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from wire_apps import bank  # noqa: E402

from charon.log.streams import StreamLog  # noqa: E402
from charon.runtime.node.inprocess import InProcessRuntime  # noqa: E402
from charon.runtime.wiring import StreamWire  # noqa: E402


async def main() -> None:
    data, streams_db, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rt = InProcessRuntime(bank, partitions=2, data_dir=data, fsync=False)
    async with rt:
        wire = StreamWire(StreamLog(streams_db), "to_pay", rt, "accounts", "charge",
                          checkpoint=os.path.join(data, "wire.offset"), max_events=5)
        print("started", wire.offset, flush=True)
        while wire.offset < n:
            await wire.step()
            await asyncio.sleep(0.05)  # slow enough for the test to kill it midway
    rt.close()
    print("done", flush=True)


asyncio.run(main())
