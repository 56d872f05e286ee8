"""Metric definitions (vLLM bench serve), summaries, per-stage breakdown, reports and plots."""

from __future__ import annotations

import json

import pytest

from kvmesh.bench.metrics import Dist, QueueSample, RequestResult, RunResult, summarize, summarize_stages
from kvmesh.bench.report import (
    compare_table,
    plot_stage_curves,
    plot_ttft_cdf,
    ratio_lines,
    summary_table,
    write_json,
)
from kvmesh.bench.runner import parse_queue_metrics


def _r(i: int, stage: int, send: float, ttft: float, gaps: list[float], **kw) -> RequestResult:
    out = len(gaps) + 1
    return RequestResult(
        request_id=f"r{i}",
        stage=stage,
        send_s=send,
        ok=True,
        prompt_tokens=kw.pop("prompt", 100),
        output_tokens=out,
        cached_tokens=kw.pop("cached", 0),
        reusable_prefix_len=kw.pop("reusable", 0),
        ttft_s=ttft,
        e2e_s=ttft + sum(gaps),
        itl_s=list(gaps),
        **kw,
    )


def test_tpot_follows_vllm_definition():
    r = _r(0, 0, 0.0, 0.5, [0.1, 0.2, 0.3])
    assert r.e2e_s == pytest.approx(1.1)
    assert r.tpot_s == pytest.approx((1.1 - 0.5) / 3)
    single = _r(1, 0, 0.0, 0.5, [])
    assert single.tpot_s is None


def test_summary_counts_throughput_hits_and_failures():
    results = [
        _r(0, 0, 0.0, 1.0, [0.5, 0.5], prompt=100, cached=0, reusable=0),
        _r(1, 0, 1.0, 0.2, [0.5, 0.5], prompt=100, cached=80, reusable=90),
        _r(2, 1, 2.0, 0.1, [0.5, 0.5], prompt=200, cached=160, reusable=190),
        RequestResult("r3", 1, 2.5, False, 50, error="HTTP 500"),
    ]
    s = summarize(results)
    assert (s.num_requests, s.num_ok, s.num_failed) == (4, 3, 1)
    # first send 0.0, last completion 2.0 + 0.1 + 1.0
    assert s.duration_s == pytest.approx(3.1)
    assert s.request_throughput == pytest.approx(3 / 3.1)
    assert s.output_tokens == 9
    assert s.output_throughput == pytest.approx(9 / 3.1)
    assert s.hit_rate == pytest.approx(240 / 400)
    assert s.reusable_hit_rate == pytest.approx(240 / 280)
    assert s.ttft.count == 3
    assert s.ttft.mean == pytest.approx((1.0 + 0.2 + 0.1) / 3)
    assert s.itl.count == 6 and s.itl.mean == pytest.approx(0.5)
    stages = summarize_stages(results, rates=[2.0, 5.0])
    assert [(x.stage, x.num_requests, x.offered_rate) for x in stages] == [(0, 2, 2.0), (1, 2, 5.0)]
    assert stages[1].num_failed == 1


def test_queue_mean_is_per_engine_inside_the_run_window():
    results = [_r(0, 0, 1.0, 0.5, [0.5])]  # window [1.0, 2.0]
    samples = [
        QueueSample(0.5, {"a": 100.0, "b": 100.0}, {}),
        QueueSample(1.2, {"a": 2.0, "b": 4.0}, {}),
        QueueSample(1.8, {"a": 6.0, "b": 0.0}, {}),
        QueueSample(2.5, {"a": 50.0, "b": 50.0}, {}),
    ]
    s = summarize(results, samples)
    assert s.queue_mean == pytest.approx((3.0 + 3.0) / 2)
    assert s.queue_max == 6.0


def test_empty_inputs_give_zero_summaries():
    s = summarize([])
    assert s.num_requests == 0 and s.request_throughput == 0.0 and s.ttft == Dist()
    failed = summarize([RequestResult("x", 0, 0.0, False, 10)])
    assert failed.num_failed == 1 and failed.hit_rate == 0.0


def test_parse_queue_metrics_sums_label_sets():
    text = (
        "# HELP vllm:num_requests_waiting waiting\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m",engine="0"} 3.0\n'
        'vllm:num_requests_waiting{model_name="m",engine="1"} 2.0\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 7.0\n'
        "# TYPE other gauge\nother 99\n"
    )
    assert parse_queue_metrics(text) == (5.0, 7.0)


def _run(label: str, ttft_scale: float) -> RunResult:
    results = [_r(i, i % 2, i * 0.1, ttft_scale * (1 + i % 5), [0.01, 0.01], cached=i) for i in range(40)]
    return RunResult(
        label=label,
        workload="w",
        results=results,
        queue=[],
        stage_rates=[5.0, 10.0],
        summary=summarize(results),
        stages=summarize_stages(results, rates=[5.0, 10.0]),
    )


def test_reports_tables_json_and_plots(tmp_path):
    from rich.console import Console

    runs = {"random": _run("random", 2.0), "precise": _run("precise", 0.01)}
    console = Console(record=True, width=200)
    console.print(summary_table(runs["random"]))
    console.print(compare_table(runs))
    text = console.export_text()
    for col in ("output tok/s", "req/s", "TTFT p90 s", "TTFT mean s", "ITL mean s", "queue mean", "hit rate"):
        assert col in text
    assert "precise" in text and "random" in text
    path = write_json(tmp_path / "out" / "runs.json", runs, include_requests=True)
    data = json.loads(path.read_text())
    assert set(data) == {"random", "precise"}
    assert data["precise"]["summary"]["num_ok"] == 40
    assert len(data["precise"]["requests"]) == 40
    assert len(data["precise"]["stages"]) == 2
    cdf = plot_ttft_cdf(runs, tmp_path / "cdf.png")
    curves = plot_stage_curves(runs, tmp_path / "curves.png")
    for p in (cdf, curves):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (line,) = ratio_lines(runs, "precise", ["random"])
    assert line.startswith("precise vs random: p90 TTFT 200.0x lower")
