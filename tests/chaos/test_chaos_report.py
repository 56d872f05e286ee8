"""Per-second series, recovery time, and the report's JSON, table and PNG."""

from __future__ import annotations

import json
import math

import pytest
from rich.console import Console

from kvmesh.bench.metrics import RequestResult
from kvmesh.chaos.bounds import ScenarioResult
from kvmesh.chaos.load import hit_rate, seconds_to_recover, series, ttft_quantile
from kvmesh.chaos.report import ChaosReport, plot_timeline, render_table, write_json
from kvmesh.chaos.schedule import FaultSpan


def _r(
    send_s: float, ok: bool = True, ttft: float = 0.01, cached: int = 0, prompt: int = 100
) -> RequestResult:
    return RequestResult(
        request_id=f"r{send_s}",
        stage=0,
        send_s=send_s,
        ok=ok,
        prompt_tokens=prompt,
        cached_tokens=cached,
        ttft_s=ttft if ok else None,
        error=None if ok else "HTTP 502",
    )


def test_series_bins_by_send_time():
    results = [_r(0.1, cached=50), _r(0.5), _r(1.2, ok=False), _r(2.9, ttft=0.5), _r(3.5)]
    s = series(results, end_s=3.0)
    assert s.t_s == [0.0, 1.0, 2.0]
    assert s.requests_per_s == [2.0, 0.0, 1.0]
    assert s.errors == [0, 1, 0]
    assert s.hit_rate[0] == 0.25 and math.isnan(s.hit_rate[1])
    assert s.p90_ttft_s[2] == 0.5
    with pytest.raises(ValueError):
        series(results, 3.0, bin_s=0)


def test_figures_over_results():
    rs = [_r(0, cached=100), _r(1, cached=0), _r(2, ok=False)]
    assert hit_rate(rs) == 0.5
    assert math.isnan(hit_rate([_r(0, ok=False)]))
    assert ttft_quantile([_r(0, ttft=t) for t in (0.1, 0.2, 0.3)], 0.5) == pytest.approx(0.2)


def test_seconds_to_recover_is_the_start_of_the_last_good_stretch():
    slow = [_r(t / 10, ttft=1.0) for t in range(0, 20)]  # 0.0-1.9 s slow
    fast = [_r(2 + t / 10, ttft=0.01) for t in range(0, 30)]  # 2.0-4.9 s back to normal
    assert seconds_to_recover(slow + fast, since_s=0.0, until_s=5.0, ttft_limit_s=0.05) == pytest.approx(2.0)
    assert seconds_to_recover(fast, since_s=2.0, until_s=5.0, ttft_limit_s=0.05) == 0.0
    failing_at_end = [*fast, _r(4.8, ok=False)]
    assert math.isnan(seconds_to_recover(failing_at_end, since_s=2.0, until_s=5.0, ttft_limit_s=0.05))


def _report(passed: bool) -> ChaosReport:
    res = ScenarioResult("engine_dies", "2. an engine dies")
    res.check("seconds until the router stops sending to it", 0.4 if passed else 3.0, "<=", 2.0, "s")
    res.figures["hit_rate_during"] = math.nan
    results = [_r(t / 4, ttft=0.02) for t in range(40)]
    return ChaosReport(
        mode="quick",
        command="kvmesh chaos --quick",
        started_at="2026-01-01T00:00:00+00:00",
        fleet={"engines": 2},
        scenarios=[res],
        faults=[FaultSpan("engine-1 SIGKILL", 3.0, 5.5)],
        series=series(results, 10.0),
        duration_s=10.0,
    )


def test_report_json_has_verdicts_and_no_nan(tmp_path):
    path = write_json(_report(passed=False), tmp_path / "r" / "chaos-report.json")
    text = path.read_text()
    assert "NaN" not in text
    data = json.loads(text)
    assert data["passed"] is False
    assert data["scenarios"][0]["bounds"][0]["passed"] is False
    assert data["scenarios"][0]["figures"]["hit_rate_during"] is None
    assert data["faults"] == [{"name": "engine-1 SIGKILL", "start_s": 3.0, "end_s": 5.5}]
    assert len(data["series"]["t_s"]) == 10
    assert (
        write_json(_report(passed=True), tmp_path / "ok.json")
        and json.loads((tmp_path / "ok.json").read_text())["passed"]
    )


def test_table_lists_every_bound_with_its_verdict():
    console = Console(width=200, record=True)
    console.print(render_table(_report(passed=False)))
    text = console.export_text()
    assert "seconds until the router stops sending to it" in text and "3 s <= 2 s" in text and "FAIL" in text


def test_timeline_png_is_written(tmp_path):
    path = plot_timeline(_report(passed=True), tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = _report(passed=True)
    empty.series = None
    with pytest.raises(ValueError, match="no series"):
        plot_timeline(empty, tmp_path / "none.png")
