"""benchmarks/spark/resident_cost_model.py's model: the fit recovers the fixed, serial (per request), per-frame and
parallel costs from exact epochs, never goes negative, and its prediction shows the driver's serial share
stopping the curve."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "spark" / "resident_cost_model.py"


def _module():
    spec = importlib.util.spec_from_file_location("_resident_cost_model", _PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _points(f_ms: float, s_us: float, r_us: float, p_us: float, rounds: int = 3) -> list[dict]:
    out = []
    for t in (1, 2, 3):
        for n in (100, 1000, 4000):
            frames = rounds * t
            serial = (s_us * n + r_us * frames) / 1000
            out.append({"mode": "local", "n": n, "t": t, "f": frames, "rounds": rounds,
                        "driver_ms": 0.5 + serial, "wall_ms": f_ms + serial + p_us * n / t / 1000})
    return out


def test_fit_recovers_the_costs_and_the_curve_stops_at_the_drivers_serial_share() -> None:
    m = _module()
    model = m.fit(_points(f_ms=4.0, s_us=20.0, r_us=300.0, p_us=60.0))
    assert model["serial"]["s_us"] == pytest.approx(20.0)
    assert model["serial"]["r_us"] == pytest.approx(300.0)
    assert model["wall"]["F_ms"] == pytest.approx(4.0)
    assert model["wall"]["p_us"] == pytest.approx(60.0)
    assert model["rounds_per_epoch"] == 3
    p8, p32, p100 = (m.predict(model, k, 10_000) for k in (8, 32, 100))
    assert p8["epoch_ms"] == pytest.approx(4.0 + (20.0 * 10_000 + 300.0 * 3 * 8) / 1000 + 60.0 * 10_000 / 8 / 1000)
    assert p8["serial_share"] < p32["serial_share"] < p100["serial_share"]
    assert p100["tps"] < p32["tps"], "past the best count more executors slow an epoch down"
    assert p8["best_executors"] == pytest.approx((60.0 * 10_000 / (300.0 * 3)) ** 0.5)
    assert all(p["tps"] < p["ceiling_tps"] == pytest.approx(1e6 / 20.0) for p in (p8, p32, p100))


def test_fit_keeps_costs_non_negative_and_needs_two_task_counts() -> None:
    m = _module()
    pts = _points(f_ms=4.0, s_us=20.0, r_us=0.0, p_us=60.0)
    for p in pts:
        p["driver_ms"] -= 0.02 * p["f"]  # noise pushing the per-frame cost below zero
    model = m.fit(pts)
    assert min(model["serial"]["F_d_ms"], model["serial"]["s_us"], model["serial"]["r_us"]) >= 0
    assert min(v for k, v in model["wall"].items() if k.endswith(("_ms", "_us"))) >= 0
    with pytest.raises(ValueError):
        m.fit([p for p in pts if p["t"] == 1])
