"""The dashboard in a real headless browser (Debian's chromium driven by Playwright): numbers change under
load, Pause stops epochs while the backlog grows, Resume drains it, the state browser shows a cut and its epoch,
the SQL box answers a SELECT over the state and shows the typed refusal of anything else.

Screenshots (dashboard.png running, dashboard-paused.png, dashboard-sql.png) go to the directory
``CHARON_DASHBOARD_SCREENSHOTS`` (default: the test's temporary directory); the docs' ones are made with
``CHARON_DASHBOARD_SCREENSHOTS=docs .venv/bin/pytest tests/server/test_dashboard.py``."""

from __future__ import annotations

import os
import random
import threading
import time

from charon import InProcessRuntime
from charon.apps import ycsb
from charon.client import Client
from charon.server.serve import BackgroundServer

TOKEN = "dash-t0ken"
N = 50


def _number(page, sel: str) -> float:
    text = page.text_content(sel) or ""
    try:
        return float(text)
    except ValueError:
        return float("nan")


def _shot(page, shots: str, name: str) -> None:
    path = os.path.join(shots, name)
    page.screenshot(path=path, full_page=True)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 10_000, path


def test_dashboard_live_pause_resume_and_state_browser(browser, shots) -> None:
    rt = InProcessRuntime(ycsb.app, partitions=4, epoch_max_ms=2.0)
    rt.load("account", ycsb.initial_state(N, 100))
    stop = threading.Event()
    with BackgroundServer(rt, token=TOKEN, wait_timeout=0.2) as srv, Client(srv.url, token=TOKEN) as c:
        def drive() -> None:
            rng = random.Random(5)
            while not stop.is_set():
                c.submit("account", ycsb.key(rng.randrange(N)), "transfer", ycsb.key(rng.randrange(N)), 1)
                time.sleep(0.004)

        loader = threading.Thread(target=drive, daemon=True)
        loader.start()
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(f"{srv.url}/dashboard#token={TOKEN}")
            page.wait_for_function("Number(document.getElementById('throughput').textContent) > 0",
                                   timeout=20_000)
            first = _number(page, "#epoch")
            page.wait_for_function(f"Number(document.getElementById('epoch').textContent) > {first}",
                                   timeout=20_000)
            assert page.text_content("#state") == "running"
            assert page.text_content("#p50") != "-"
            _shot(page, shots, "dashboard.png")
            # pause: the epoch stops, the backlog grows
            page.click("#pause")
            page.wait_for_function("document.getElementById('state').textContent === 'paused'",
                                   timeout=20_000)
            frozen = _number(page, "#epoch")
            page.wait_for_function("Number(document.getElementById('backlog').textContent) > 30",
                                   timeout=20_000)
            assert _number(page, "#epoch") == frozen
            _shot(page, shots, "dashboard-paused.png")
            # resume: epochs run again, the backlog drains
            page.click("#resume")
            page.wait_for_function("document.getElementById('state').textContent === 'running'",
                                   timeout=20_000)
            page.wait_for_function(f"Number(document.getElementById('epoch').textContent) > {frozen}",
                                   timeout=20_000)
            stop.set()
            page.wait_for_function("document.getElementById('backlog').textContent === '0'", timeout=20_000)
            # the state browser: one consistent cut, with its epoch
            page.fill("#browse-operator", "account")
            page.click("#browse-go")
            page.wait_for_function("document.getElementById('browse-count').textContent === '50'",
                                   timeout=20_000)
            rows = page.locator("#browse-result tr")
            assert rows.count() == N
            total = sum(int(rows.nth(i).locator("td").nth(1).text_content()) for i in range(N))
            assert total == N * 100
            assert _number(page, "#browse-at") >= frozen
            page.fill("#browse-keys", "a1, a2")
            page.click("#browse-go")
            page.wait_for_function("document.getElementById('browse-count').textContent === '2'",
                                   timeout=20_000)
            # the SQL box: refusals are typed and shown; a good query answers over one cut
            for bad, kind in [("DROP TABLE account", "SQLRejected"),
                              ("ATTACH DATABASE '/tmp/x.db' AS x", "SQLRejected"),
                              ("SELECT load_extension('/tmp/x')", "SQLRejected"),
                              ("SELECT * FROM sqlite_master", "SQLRejected"),
                              ("SELECT 1; DELETE FROM account", "SQLSyntaxError")]:
                page.fill("#sql", bad)
                page.click("#sql-go")
                page.wait_for_function(
                    f"document.getElementById('sql-error').textContent.startsWith('Error: {kind}')",
                    timeout=20_000)
                assert page.locator("#sql-result tr").count() == 0
            page.fill("#sql", "SELECT count(*) AS entities, sum(value) AS total, max(epoch) AS epoch "
                              "FROM account")
            page.click("#sql-go")
            page.wait_for_function("document.getElementById('sql-count').textContent === '1'",
                                   timeout=20_000)
            assert page.text_content("#sql-error") == ""
            cells = page.locator("#sql-result tr").nth(0).locator("td")
            assert [cells.nth(i).text_content() for i in range(2)] == [str(N), str(N * 100)]
            assert cells.nth(2).text_content() == page.text_content("#sql-at")
            assert page.text_content("#sql-engine") == "sqlite"
            assert [h.text_content() for h in page.locator("#sql-head th").all()] == \
                ["entities", "total", "epoch"]
            _shot(page, shots, "dashboard-sql.png")
            # a wrong token shows an error instead of numbers
            page.fill("#token", "wrong")
            page.dispatch_event("#token", "change")
            page.wait_for_function("document.getElementById('error').textContent.includes('Unauthorized')",
                                   timeout=20_000)
        finally:
            stop.set()
            loader.join()


def test_dashboard_shows_the_workflow_drain(browser, shots) -> None:
    """The workflows panel: a bar per code version with workflows in flight; after a deploy the old version's
    workflows stay on it (pinned) until ``migrate`` moves them, and its row goes."""
    import wf_pin_v1

    from charon.config import GatewayConfig

    def waiting(c: Client, wid: str) -> None:
        deadline = time.monotonic() + 20
        while (rec := c.workflow("pin", wid))["status"] != "waiting" or not rec["awaiting"]:
            assert time.monotonic() < deadline, rec
            time.sleep(0.05)

    rt = InProcessRuntime(wf_pin_v1.app, partitions=2, epoch_max_ms=2.0)
    with BackgroundServer(rt, token=TOKEN, config=GatewayConfig(code_refs="wf_pin_v2:app")) as srv, \
            Client(srv.url, token=TOKEN) as c:
        for wid in ("a", "b"):
            c.start_workflow("pin", None, id=wid)
            waiting(c, wid)
        c.update_code("wf_pin_v2:app", "v2")
        c.start_workflow("pin", None, id="n")
        waiting(c, "n")
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(f"{srv.url}/dashboard#token={TOKEN}")
        page.wait_for_selector('#wf-versions tr[data-version="1"]', timeout=20_000)
        page.wait_for_selector('#wf-versions tr[data-version="v2"]', timeout=20_000)
        rows = {tr.get_attribute("data-version"): [td.text_content() for td in tr.query_selector_all("td")][:3]
                for tr in page.query_selector_all("#wf-versions tr")}
        assert rows == {"1": ["v1", "0", "2"], "v2": ["v2 (current)", "0", "1"]}, rows
        page.locator("#sec-workflows").screenshot(path=os.path.join(shots, "dashboard-workflows.png"))
        assert c.migrate_workflows("pin", "1")["done"] == 2
        page.wait_for_function("!document.querySelector('#wf-versions tr[data-version=\"1\"]')", timeout=20_000)
        cells = [td.text_content() for td in page.query_selector_all('#wf-versions tr[data-version="v2"] td')][:3]
        assert cells == ["v2 (current)", "0", "3"]
        # one workflow as a tree: its first step with the call graph of its transaction, the promise it awaits
        assert page.eval_on_selector_all("#wf-names option", "os => os.map(o => o.value)") == ["pin"]
        page.fill("#wf-name", "pin")
        page.fill("#wf-id", "n")
        page.click("#wf-form button")
        page.wait_for_selector("#wf-tree li.wf-step", timeout=10_000)
        assert (page.text_content("#wf-root") or "").startswith("pin n: waiting at step middle (version v2")
        step = page.locator("#wf-tree li.wf-step").first
        assert (step.text_content() or "").startswith("step begin seq 1 attempt 1 tid ")
        graph = step.locator("li[data-node='0']").text_content() or ""
        assert graph.startswith("root charon.workflow.pin/n.run → ok") and "send charon.promise/pr." in graph, graph
        pending = page.locator("#wf-tree li.wf-await").text_content() or ""
        assert pending.startswith("awaiting promise pr.") and ": pending, deadline " in pending, pending
        c.resolve(c.workflow("pin", "n")["awaiting"][0]["id"], "yes")  # refreshed: the second step
        page.wait_for_function("document.querySelectorAll('#wf-tree li.wf-step').length === 2", timeout=10_000)
        page.fill("#wf-id", "nobody")
        page.click("#wf-form button")
        page.wait_for_function("document.getElementById('wf-tree').textContent.startsWith('UnknownWorkflow')",
                               timeout=10_000)
        page.close()
