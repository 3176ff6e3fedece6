"""The dashboard over time, in real headless chromium (Debian's, driven by Playwright) against a real gateway
under load (a background thread sending transfers, some of them aborting): the charts render and grow, a reload
redraws them from the server's history, the state browser reads 200 entities from the server a page at a time at
one epoch (refused, and said so, once the running engine dropped that epoch) and finds keys by prefix,
a wrong token greys the numbers out with "last updated" and says so, a stopped node is reported as down, an
error stays listed with its time until its condition clears, the code history shows "v2", not "vv2", and the
timers and output-stream panels read an entity's timers and page through a stream.

Screenshots go to ``CHARON_DASHBOARD_SCREENSHOTS`` (default: the test's temporary directory); the docs' ones are
made with ``CHARON_DASHBOARD_SCREENSHOTS=docs/img .venv/bin/pytest tests/server/test_dashboard_charts.py``."""

from __future__ import annotations

import os
import random
import re
import threading
import time

import code_versions
import streams_app

from charon import InProcessRuntime
from charon.apps import holds, ycsb
from charon.client import Client
from charon.config import GatewayConfig
from charon.server.serve import BackgroundServer

TOKEN = "ch4rts"
N = 200
WAIT = 30_000


def shot(page, shots: str, name: str, selector: str | None = None) -> None:
    path = os.path.join(shots, name)
    if selector is None:
        page.screenshot(path=path)
    else:
        page.locator(selector).screenshot(path=path)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 5_000, path


def points(page, chart: str) -> int:
    return int(page.get_attribute(f"#{chart} svg", "data-points") or 0)


class Load:
    """A background thread sending transfers of 1..5 between random accounts (a poor account's transfer aborts)."""

    def __init__(self, client: Client, n: int) -> None:
        self.client, self.n = client, n
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        rng = random.Random(7)
        while not self.stop.is_set():
            self.client.submit("account", ycsb.key(rng.randrange(self.n)), "transfer",
                               ycsb.key(rng.randrange(self.n)), rng.randint(1, 5))
            time.sleep(0.003)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def test_charts_grow_reload_keeps_them_state_pages_wrong_token_and_node_down(browser, shots) -> None:
    rt = InProcessRuntime(ycsb.app, partitions=4, epoch_max_ms=2.0)
    rt.load("account", ycsb.initial_state(N, 10))
    srv = BackgroundServer(rt, token=TOKEN, wait_timeout=0.2).start()
    try:
        with Client(srv.url, token=TOKEN) as c, Load(c, N):
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{srv.url}/dashboard#token={TOKEN}")
            # the charts render and grow, one sample a second
            page.wait_for_function("Number(document.querySelector('#chart-throughput svg')"
                                   "?.getAttribute('data-points')) >= 3", timeout=WAIT)
            first = points(page, "chart-throughput")
            page.wait_for_function(f"Number(document.querySelector('#chart-throughput svg')"
                                   f".getAttribute('data-points')) >= {first + 2}", timeout=WAIT)
            for chart in ("chart-throughput", "chart-latency", "chart-epochs", "chart-backlog"):
                assert points(page, chart) >= first + 2, chart
                assert page.locator(f"#{chart} svg path.line").count() >= 1, chart
            committed = page.get_attribute("#chart-throughput path[data-series='committed/s']", "d") or ""
            assert committed.count("L") >= first + 1, "one vertex per sample"
            # aborts by type: a line per error type seen
            page.wait_for_selector("#chart-aborts path[data-series='NotEnoughCredit']", timeout=WAIT)
            p99 = page.get_attribute("#chart-latency path[data-series='p99']", "d") or ""
            assert re.match(r"M[\d.]+,[\d.]+L", p99)
            assert page.text_content("#conn") == "" and page.text_content("#error") == ""
            page.click("nav button[data-go='sec-charts']")
            shot(page, shots, "dashboard-charts.png")
            # a reload redraws the history kept by the server, not an empty chart
            before = points(page, "chart-throughput")
            page.reload()
            page.wait_for_function(f"Number(document.querySelector('#chart-throughput svg')"
                                   f"?.getAttribute('data-points')) >= {before}", timeout=WAIT)

            # the state browser reads pages from the server, every page of one browse at its first page's epoch:
            # under load the volatile runtime moves on, and the next page of that cut is refused and said so
            page.fill("#browse-operator", "account")
            page.click("#browse-go")
            page.wait_for_function("document.getElementById('browse-count').textContent === '50+'", timeout=WAIT)
            at = int(page.text_content("#browse-at") or "")
            page.wait_for_function(f"Number(document.getElementById('epoch').textContent) > {at}", timeout=WAIT)
            page.click("#browse-next")
            page.wait_for_selector("#error [data-problem='action:state']", timeout=WAIT)
            moved = page.text_content("#error [data-problem='action:state']") or ""
            assert "EpochNotRetained" in moved and f"read at epoch {at}" in moved and "Read again" in moved, moved
            assert page.text_content("#browse-page") == "page 1 (1-50, more after)", "the shown page stays"
            # paused, the cut stays retained: Next pages through all 200 entities, each once and in key order
            page.click("#pause")
            page.wait_for_function("document.getElementById('state').textContent === 'paused'", timeout=WAIT)
            page.click("#browse-go")
            page.wait_for_selector("#error [data-problem='action:state']", state="detached", timeout=WAIT)
            # the new browse's first page shown (the error may be cleared before it arrives): a later cut
            page.wait_for_function(f"Number(document.getElementById('browse-at').textContent) > {at}", timeout=WAIT)
            at = int(page.text_content("#browse-at") or "")
            assert page.is_disabled("#browse-prev") and not page.is_disabled("#browse-next")
            pages = [page.locator("#browse-result tr td:first-child").all_text_contents()]
            for i in range(2, 5):
                page.click("#browse-next")
                page.wait_for_function(f"document.getElementById('browse-page').textContent.startsWith('page {i}')",
                                       timeout=WAIT)
                pages.append(page.locator("#browse-result tr td:first-child").all_text_contents())
            assert [k for p in pages for k in p] == sorted(ycsb.key(i) for i in range(N)), "each key once, in order"
            assert page.text_content("#browse-page") == f"page 4, the last (151-200 of {N})"
            assert page.text_content("#browse-count") == str(N) and page.is_disabled("#browse-next")
            assert page.text_content("#browse-at") == str(at), "every page from the same cut"
            for i in (3, 2, 1):  # Prev shows the same pages again
                page.click("#browse-prev")
                page.wait_for_function(f"document.getElementById('browse-page').textContent.startsWith('page {i}')",
                                       timeout=WAIT)
                assert page.locator("#browse-result tr td:first-child").all_text_contents() == pages[i - 1]
            assert page.text_content("#browse-page") == "page 1 (1-50, more after)" and page.is_disabled("#browse-prev")
            page.select_option("#browse-size", "100")
            page.wait_for_function("document.getElementById('browse-page').textContent === "
                                   "'page 1 (1-100, more after)'", timeout=WAIT)
            page.click("#browse-next")
            page.wait_for_function(f"document.getElementById('browse-page').textContent === "
                                   f"'page 2, the last (101-200 of {N})'", timeout=WAIT)
            assert page.is_disabled("#browse-next")
            # a key prefix: searched on the server, in the same cut
            page.fill("#browse-search", "a17")
            page.wait_for_function("document.getElementById('browse-matching').textContent.includes('a17')",
                                   timeout=WAIT)
            found = page.locator("#browse-result tr td:first-child").all_text_contents()
            assert found == sorted(k for k in (ycsb.key(i) for i in range(N)) if k.startswith("a17")) and "a17" in found
            height = page.evaluate("document.getElementById('sec-state').getBoundingClientRect().height")
            page.fill("#browse-search", "")
            page.select_option("#browse-size", "50")
            page.wait_for_function("document.querySelectorAll('#browse-result tr').length === 50", timeout=WAIT)
            height50 = page.evaluate("document.getElementById('sec-state').getBoundingClientRect().height")
            assert height < height50 < 1600, (height, height50)  # 200 entities made a 4,834-pixel page
            page.click("#resume")
            page.wait_for_function("document.getElementById('state').textContent === 'running'", timeout=WAIT)
            page.click("nav button[data-go='sec-state']")
            shot(page, shots, "dashboard-state.png")

            # an action's error stays listed, with its time, across refreshes, until dismissed
            page.fill("#browse-operator", "nosuch")
            page.click("#browse-go")
            page.wait_for_selector("#error [data-problem='action:state']", timeout=WAIT)
            line = page.text_content("#error [data-problem='action:state']") or ""
            assert re.match(r"\d\d:\d\d:\d\dstate browser: UnknownOperator", line), line
            time.sleep(1.5)  # three summary refreshes later it is still there, same time
            assert page.text_content("#error [data-problem='action:state']") == line
            page.fill("#browse-operator", "account")
            page.click("#browse-go")
            page.wait_for_selector("#error [data-problem='action:state']", state="detached", timeout=WAIT)

            # a wrong token: said so, the numbers greyed out with "last updated", not shown as live
            page.fill("#token", "wrong")
            page.dispatch_event("#token", "change")
            page.wait_for_function("document.getElementById('conn').className === 'unauthorized'", timeout=WAIT)
            live_epoch = page.text_content("#epoch")  # the last live value: answers to the old token are dropped
            assert "Wrong or missing token" in (page.text_content("#conn") or "")
            assert "Unauthorized" in (page.text_content("#error") or "")
            assert page.evaluate("document.body.classList.contains('stale')")
            assert re.fullmatch(r"last updated \d\d:\d\d:\d\d", page.text_content("#last-updated") or "")
            time.sleep(1.0)
            assert page.text_content("#epoch") == live_epoch, "no new numbers without the token"
            opacity = page.evaluate("getComputedStyle(document.querySelector('#sec-overview')).opacity")
            assert float(opacity) < 0.5
            page.click("nav button[data-go='sec-overview']")
            shot(page, shots, "dashboard-wrong-token.png")
            # the right token again: live, the error cleared
            page.fill("#token", TOKEN)
            page.dispatch_event("#token", "change")
            page.wait_for_function("document.getElementById('conn').className === ''", timeout=WAIT)
            assert page.text_content("#error") == "" and page.text_content("#last-updated") == ""
            assert not page.evaluate("document.body.classList.contains('stale')")
    finally:
        srv.stop()
    # the node is down: said so, numbers greyed
    page.wait_for_function("document.getElementById('conn').className === 'down'", timeout=WAIT)
    assert "The node is down" in (page.text_content("#conn") or "")
    assert page.evaluate("document.body.classList.contains('stale')")
    assert "last updated" in (page.text_content("#last-updated") or "")
    page.close()
    rt.close()


def test_code_history_after_an_update_shows_v2_not_vv2(browser, shots) -> None:
    rt = InProcessRuntime(code_versions.v1, partitions=2, epoch_max_ms=2.0)
    rt.load("account", {f"a{i}": 100 for i in range(4)})
    cfg = GatewayConfig(code_refs="code_versions:v2")
    try:
        with BackgroundServer(rt, token=TOKEN, config=cfg) as srv, Client(srv.url, token=TOKEN) as c:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(f"{srv.url}/dashboard#token={TOKEN}")
            page.wait_for_function("document.getElementById('code').textContent === 'bank v1'", timeout=WAIT)
            assert page.locator("#code-history tr").all_text_contents() == ["v1 (current)0(as started)-"]
            upd = c.update_code("code_versions:v2", "v2", ("account", "migrate", ["EUR"]))
            page.wait_for_function("document.getElementById('code').textContent === 'bank v2'", timeout=WAIT)
            page.wait_for_function("document.querySelectorAll('#code-history tr').length === 2", timeout=WAIT)
            rows = [[td.text_content() for td in tr.locator("td").all()]
                    for tr in page.locator("#code-history tr").all()]
            assert rows == [["v2 (current)", str(upd["from_epoch"]), "code_versions:v2", "account.migrate"],
                            ["v1", "0", "(as started)", "-"]]
            assert "vv2" not in (page.text_content("body") or "")
            page.close()
    finally:
        rt.close()


def test_timers_and_streams_panels(browser) -> None:
    rt = InProcessRuntime(holds.app, partitions=2, epoch_max_ms=2.0)
    rt.load("acct", {"a": 100, "b": 0})
    try:
        with BackgroundServer(rt, token=TOKEN) as srv, Client(srv.url, token=TOKEN) as c:
            t1 = c.invoke("acct", "a", "hold", "h1", 10, 600.0)
            t2 = c.invoke("acct", "a", "hold", "h2", 5, 900.0)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(f"{srv.url}/dashboard#token={TOKEN}")
            page.fill("#timer-operator", "acct")
            page.fill("#timer-key", "a")
            page.click("#timer-go")
            page.wait_for_function("document.querySelectorAll('#timer-list tr').length === 2", timeout=WAIT)
            got = {tr.locator("td").nth(0).text_content(): tr.locator("td").nth(2).text_content()
                   for tr in page.locator("#timer-list tr").all()}
            assert got == {t1: "release", t2: "release"}
            assert page.text_content("#timer-info") == "2 pending on acct/a"
            page.fill("#timer-key", "b")
            page.click("#timer-go")
            page.wait_for_function("document.getElementById('timer-info').textContent === '0 pending on acct/b'",
                                   timeout=WAIT)
            assert page.locator("#timer-list tr").count() == 0
            page.close()
    finally:
        rt.close()
    rt = InProcessRuntime(streams_app.app, partitions=2, epoch_max_ms=2.0)
    rt.load("acct", {f"s{i}": 100 for i in range(4)})
    try:
        with BackgroundServer(rt, token=TOKEN) as srv, Client(srv.url, token=TOKEN) as c:
            for i in range(60):
                c.invoke("acct", f"s{i % 4}", "transfer", f"s{(i + 1) % 4}", 1, f"t{i}")
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(f"{srv.url}/dashboard#token={TOKEN}")
            page.fill("#stream-name", "payments")
            page.click("#stream-go")
            page.wait_for_function("document.querySelectorAll('#stream-list tr').length === 50", timeout=WAIT)
            first = page.locator("#stream-list tr").first.locator("td").all_text_contents()
            assert first[0] == "0" and '"tag":"t0"' in first[2]
            assert page.text_content("#stream-info") == "offsets 0..60; next 50"
            page.click("#stream-next")
            page.wait_for_function("document.querySelectorAll('#stream-list tr').length === 10", timeout=WAIT)
            assert page.locator("#stream-list tr td:first-child").all_text_contents() == [str(i) for i in range(50, 60)]
            assert page.is_disabled("#stream-next")
            page.fill("#stream-name", "no such stream!")
            page.click("#stream-go")
            page.wait_for_selector("#error [data-problem='action:streams']", timeout=WAIT)
            assert "InvalidKey" in (page.text_content("#error") or "")
            page.close()
    finally:
        rt.close()
