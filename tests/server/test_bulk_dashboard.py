"""The dashboard's bulk panel in a real headless browser (Debian's chromium driven by Playwright) over a gateway
and a durable in-process engine: Run stays disabled until a count of the same filter, the count changes nothing,
Run cancels exactly what was counted (after a confirmation) and says how many."""

from __future__ import annotations

import sys
from pathlib import Path

from charon import InProcessRuntime
from charon.client import Client
from charon.server.serve import BackgroundServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from bulk_app import app  # noqa: E402

TOKEN = "bulk-dash"


def test_the_bulk_panel_counts_then_cancels_what_matches(browser, tmp_path) -> None:
    rt = InProcessRuntime(app, partitions=2, data_dir=str(tmp_path / "node"))
    try:
        with BackgroundServer(rt, token=TOKEN) as srv, Client(srv.url, token=TOKEN) as c:
            pids = {k: c.invoke("orders", k, "place") for k in ("eu-1", "eu-2", "eu-3", "us-1", "us-2")}
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("dialog", lambda d: d.accept())
            page.goto(f"{srv.url}/dashboard#token={TOKEN}")
            page.select_option("#bulk-target", "promises/cancel")
            page.fill("#bulk-key", "eu-")
            assert page.is_disabled("#bulk-run")
            page.click("#bulk-count")
            page.wait_for_function("document.getElementById('bulk-result').textContent.includes('match')",
                                   timeout=20_000)
            assert (page.text_content("#bulk-result") or "").startswith("3 match")
            assert {c.promise(p)["status"] for p in pids.values()} == {"pending"}
            page.fill("#bulk-key", "e")  # another filter: count again first
            assert page.is_disabled("#bulk-run")
            page.fill("#bulk-key", "eu-")
            assert page.is_enabled("#bulk-run")
            page.click("#bulk-run")
            page.wait_for_function("document.getElementById('bulk-result').textContent.includes('done')",
                                   timeout=20_000)
            assert (page.text_content("#bulk-result") or "").startswith("3 done of 3 matched")
            assert {k: c.promise(p)["status"] for k, p in pids.items()} == {
                "eu-1": "cancelled", "eu-2": "cancelled", "eu-3": "cancelled", "us-1": "pending", "us-2": "pending"}
            page.select_option("#bulk-target", "promises/cancel")
            page.fill("#bulk-key", "")
            page.fill("#bulk-error", "X")  # a bad filter: the typed 400, shown
            page.click("#bulk-count")
            page.wait_for_function("document.getElementById('bulk-result').textContent.includes('BadRequest')",
                                   timeout=20_000)
            assert page.is_disabled("#bulk-run")
    finally:
        rt.close()
