"""benchmarks/spark/spark_scaling.py's model: the fit recovers F, s, p from exact rows, never goes negative, and
predicts a throughput from them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "spark" / "spark_scaling.py"


def _module():
    spec = importlib.util.spec_from_file_location("_spark_scaling", _PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fit_recovers_the_model_and_predicts() -> None:
    m = _module()
    rows = [{"cores": k, "size": n, "cycle_ms": 90 + n * (0.015 + 0.030 / k)} for k in (1, 2) for n in (2000, 10000)]
    model = m.fit(rows)
    assert model["F_ms"] == pytest.approx(90)
    assert model["s_us"] == pytest.approx(15)
    assert model["p_us"] == pytest.approx(30)
    p = m.predict(model, 100, 10_000)
    assert p["epoch_ms"] == pytest.approx(90 + 10_000 * (15 + 0.3) / 1000)
    assert p["ceiling_tps"] == pytest.approx(1e6 / 15.3)


def test_fit_keeps_costs_non_negative() -> None:
    m = _module()
    rows = [{"cores": k, "size": n, "cycle_ms": 100 + n * 0.04 * (1.2 if k == 2 else 1)} for k in (1, 2)
            for n in (2000, 10000)]  # more cores slower (a loaded machine): no negative per-core cost
    model = m.fit(rows)
    assert min(model["F_ms"], model["s_us"], model["p_us"]) >= 0
    with pytest.raises(ValueError):
        m.fit(rows[:2])
