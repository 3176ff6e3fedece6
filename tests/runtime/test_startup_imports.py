"""What a process imports before any epoch runs, each in a fresh interpreter:

* ``import charon`` (every CLI call) does not load pyarrow; opening durable state does, so no epoch's checkpoint
  imports it first (an interrupt could land in the import);
* a durable node restarted with older recorded code versions has imported each of them still loaded (one with a
  workflow in flight: not drained) before its first epoch: a pinned workflow's step never imports its version's
  code inside an epoch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[1] / "support"


def _run(code: str, cwd: Path) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd,
                       env=env, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip()


def test_import_charon_skips_pyarrow_and_durable_state_loads_it(tmp_path: Path) -> None:
    out = _run("""
        import sys
        import charon
        print("pyarrow" in sys.modules)
        from charon.state.durable import DurableState
        DurableState("durable")
        print("pyarrow.ipc" in sys.modules)
    """, tmp_path)
    assert out.split() == ["False", "True"]


def test_a_restarted_node_imports_older_code_versions_before_its_first_epoch(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _run(f"""
        import asyncio
        from charon import InProcessRuntime
        import wf_pin_v1

        async def main():
            async with InProcessRuntime(wf_pin_v1.app, partitions=1, data_dir={str(data)!r}) as rt:
                await rt.invoke("probe", "k", "ping")
                await rt.engine().update_code("wf_pin_v2:app", "2")
                await rt.invoke("probe", "k", "ping")
                await rt.invoke("charon.workflow.pin", "w", "start", None)  # in flight on "2": kept loaded
                await rt.engine().update_code("wf_pin_v1:app", "3")
                await rt.invoke("probe", "k", "ping")

        asyncio.run(main())
    """, tmp_path)
    out = _run(f"""
        import asyncio, sys
        from charon import InProcessRuntime
        import wf_pin_v1

        async def main():
            rt = InProcessRuntime(wf_pin_v1.app, partitions=1, data_dir={str(data)!r})
            async with rt:
                print("wf_pin_v2" in sys.modules, rt.epoch)

        asyncio.run(main())
    """, tmp_path)
    loaded, _ = out.split()
    assert loaded == "True", out
