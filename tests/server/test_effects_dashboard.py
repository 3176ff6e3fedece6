"""The dashboard's effects panel in a real headless browser (Debian's chromium driven by Playwright), over a
gateway with an effect executor beside its durable in-process engine and the real external HTTP test service:
parked failures are listed with attempts and last error; the Retry and Abandon buttons resume them."""

from __future__ import annotations

import sys
from pathlib import Path

from charon import InProcessRuntime
from charon.client import Client
from charon.runtime.effects import EffectExecutor, engine_resume
from charon.server.serve import BackgroundServer

TESTS = Path(__file__).resolve().parents[1] / "support"  # the test apps and the external service
sys.path.insert(0, str(TESTS))
from effects_app import app  # noqa: E402
from effects_service import Service  # noqa: E402

TOKEN = "fx-dash"


def test_dashboard_lists_parked_effects_and_retries_or_abandons_them(browser, tmp_path, monkeypatch) -> None:
    service = Service(str(tmp_path / "service.sqlite")).start()
    monkeypatch.setenv("CHARON_TEST_SERVICE_URL", service.url)
    service.control(fail_rate=1.0)
    rt = InProcessRuntime(app, partitions=2, data_dir=str(tmp_path / "node"))
    eng = rt.engine()
    ex = EffectExecutor(app, lambda: eng.streams, engine_resume(eng.submit), park_failed=True, backoff_s=0.01)
    try:
        with BackgroundServer(rt, token=TOKEN, effects=ex) as srv, Client(srv.url, token=TOKEN) as c:
            ids = {k: c.invoke("acct", k, "pay", 4, 1.0, 1) for k in ("x", "y")}
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{srv.url}/dashboard#token={TOKEN}")
            page.wait_for_function("document.querySelectorAll('#effects button.effect-retry').length === 2",
                                   timeout=20_000)
            row = page.locator(f"#effects tr[data-effect='{ids['x']}'] td")
            assert row.nth(2).text_content() == "failed" and row.nth(3).text_content() == "1/1"
            assert "503" in (row.nth(4).text_content() or "")
            assert "failed 2" in (page.text_content("#effect-counts") or "")
            service.control(fail_rate=0.0)
            page.click(f"#effects tr[data-effect='{ids['x']}'] button.effect-retry")
            page.click(f"#effects tr[data-effect='{ids['y']}'] button.effect-abandon")
            page.wait_for_function("document.getElementById('effect-counts').textContent.includes('done 2')",
                                   timeout=20_000)
            assert page.locator("#effects button").count() == 0
            x, y = c.state("acct", "x"), c.state("acct", "y")
        assert x["state"] == "paid" and x["runs"] == 1
        assert y["state"] == "failed" and y["result"]["error_type"] == "EffectAbandoned" and y["runs"] == 1
        assert list(service.stats()["applied"]) == [ids["x"]]
    finally:
        rt.close()
        service.kill()
