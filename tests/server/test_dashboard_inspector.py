"""The dashboard's request inspector in real headless chromium (Debian's, driven by Playwright) against a real
gateway under load (a background thread sending transfers; those to a frozen account abort in the callee):
find the failing requests by their error type, page to older ones, open one and see its call graph (the root
transfer and the deposit call that raised) and its traceback; filter the committed ones by function.

Screenshots go to ``CHARON_DASHBOARD_SCREENSHOTS`` (default: the test's temporary directory); the docs' one is
made with ``CHARON_DASHBOARD_SCREENSHOTS=docs/img .venv/bin/pytest tests/server/test_dashboard_inspector.py``."""

from __future__ import annotations

import os
import random
import threading
import time

from charon import Application, Context, InProcessRuntime, Operator
from charon.client import Client
from charon.server.serve import BackgroundServer

TOKEN = "insp3ct"
N = 30
WAIT = 30_000

account = Operator("account")


class AccountFrozen(Exception):
    """The receiving account takes no deposits."""


@account.function(public=True)
async def deposit(ctx: Context, amount: int) -> int:
    if ctx.key.startswith("frozen"):
        raise AccountFrozen(f"account {ctx.key} is frozen")
    ctx.put(ctx.get(default=0) + amount)
    return int(ctx.get())


@account.function(public=True)
async def transfer(ctx: Context, to: str, amount: int) -> int:
    balance = ctx.get(default=0)
    ctx.put(balance - amount)
    await ctx.call(account, to, deposit, amount)
    return int(balance - amount)


app = Application("frozen-bank", [account])


def test_find_a_failing_request_by_error_type_and_open_its_call_graph_and_traceback(browser, shots) -> None:
    rt = InProcessRuntime(app, partitions=4, epoch_max_ms=2.0)
    rt.load("account", {f"a{i}": 1000 for i in range(N)})
    stop = threading.Event()
    with BackgroundServer(rt, token=TOKEN, wait_timeout=0.2) as srv, Client(srv.url, token=TOKEN) as c:
        def drive() -> None:
            rng = random.Random(3)
            i = 0
            while not stop.is_set():
                to = "frozen1" if i % 4 == 0 else f"a{rng.randrange(N)}"
                c.submit("account", f"a{rng.randrange(N)}", "transfer", to, 1)
                i += 1
                time.sleep(0.003)

        loader = threading.Thread(target=drive, daemon=True)
        loader.start()
        try:
            time.sleep(2.0)  # more than a page (50) of each kind
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{srv.url}/dashboard#token={TOKEN}")
            page.click("nav button[data-go='sec-inspector']")
            # find the failing requests by their error type
            page.fill("#req-error", "AccountFrozen")
            page.click("#req-go")
            page.wait_for_function("document.querySelectorAll('#req-list tr').length === 50",
                                   timeout=WAIT)
            rows = page.locator("#req-list tr")
            cells = [rows.nth(i).locator("td").all_text_contents() for i in range(rows.count())]
            assert all(r[1] == "aborted" and r[4] == "AccountFrozen" and r[2] == "account.transfer"
                       for r in cells), cells[:3]
            assert len({r[0] for r in cells}) == 50
            # older ones: the next page is appended, none repeated
            assert not page.is_disabled("#req-more")
            page.click("#req-more")
            page.wait_for_function("document.querySelectorAll('#req-list tr').length > 50", timeout=WAIT)
            ids = page.locator("#req-list tr td:first-child").all_text_contents()
            assert len(ids) == len(set(ids))
            # open one: its error, traceback and call graph
            first = cells[0][0]
            page.click(f"#req-list tr[data-request='{first}']")
            page.wait_for_function(f"document.getElementById('req-detail-id')?.textContent === '{first}'",
                                   timeout=WAIT)
            assert (page.text_content("#req-error-line") or "").startswith("AccountFrozen: account frozen1")
            tb = page.text_content("#req-traceback") or ""
            assert "Traceback" in tb and "in deposit" in tb and "AccountFrozen" in tb, tb
            root = page.locator("#req-graph > li")
            assert root.count() == 1
            assert (root.first.text_content() or "").startswith(f"root account/{cells[0][3]}.transfer")
            raised = page.locator("#req-graph li.raised")
            assert "call account/frozen1.deposit → raised" in raised.all_text_contents()
            page.screenshot(path=os.path.join(shots, "dashboard-inspector.png"))
            assert os.path.getsize(os.path.join(shots, "dashboard-inspector.png")) > 10_000
            # the committed transfers, by status and function
            page.fill("#req-error", "")
            page.select_option("#req-status", "committed")
            page.fill("#req-function", "transfer")
            page.click("#req-go")
            page.wait_for_function(
                "[...document.querySelectorAll('#req-list tr td:nth-child(2)')].length > 0 && "
                "[...document.querySelectorAll('#req-list tr td:nth-child(2)')]"
                ".every(td => td.textContent === 'committed')", timeout=WAIT)
            ok = page.locator("#req-list tr").first.get_attribute("data-request")
            page.click(f"#req-list tr[data-request='{ok}']")
            page.wait_for_selector("#req-reply", timeout=WAIT)
            assert (page.text_content("#req-reply") or "").startswith("reply: ")
            assert page.locator("#req-graph li").count() == 2  # the transfer and its deposit call
            assert page.locator("#req-graph li.raised").count() == 0
            # a bad filter: the typed refusal is listed until the next good search
            page.fill("#req-epoch-min", "soon")
            page.click("#req-go")
            page.wait_for_selector("#error [data-problem='action:inspector']", timeout=WAIT)
            assert "BadRequest" in (page.text_content("#error") or "")
            page.fill("#req-epoch-min", "")
            page.click("#req-go")
            page.wait_for_selector("#error [data-problem='action:inspector']", state="detached",
                                   timeout=WAIT)
        finally:
            stop.set()
            loader.join()
