"""Per-request results and their summaries, with vLLM ``bench serve``'s metric definitions.

- TTFT = first streamed chunk carrying output − send time.
- ITL  = gap between consecutive output chunks (all gaps of all requests pooled).
- TPOT = (E2E − TTFT) / (output tokens − 1), per request with more than one output token.
- E2E  = last chunk − send time.
- Throughput = completed requests (or their output tokens) / (last completion − first send).
- Hit rate = engine-reported ``usage.prompt_tokens_details.cached_tokens`` / prompt tokens.
  ``reusable_hit_rate`` divides the same cached tokens by the workload's reusable tokens instead: the
  share of what an ideal fleet-wide cache could have served that the fleet did serve.
- Queue = ``vllm:num_requests_waiting`` sampled from every engine's ``/metrics``; ``queue_mean`` is the
  mean per engine, ``queue_max`` the largest single sample.
- Shed = requests the router's flow control refused (HTTP 429, or ``shed_429`` in the simulator):
  counted apart from ``num_failed``; timeouts (the client gave up) are failures, also counted alone.
  Latencies are over completed requests only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

SHED_ERROR = "shed_429"
"""``RequestResult.error`` of a request the router's flow control refused (the simulator's; a live
run records the router's ``HTTP 429: ...`` answer)."""
TIMEOUT_ERROR = "timeout"
"""``RequestResult.error`` of a request the simulated client gave up on (a live run records
``TimeoutError: ...``)."""


@dataclass(slots=True)
class RequestResult:
    """What one request measured. Times are seconds; ``send_s`` is relative to the run's start."""

    request_id: str
    stage: int
    send_s: float
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    reusable_prefix_len: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    group: str | None = None
    endpoint: str | None = None
    cache_note: str | None = None
    """The router's ``x-kvmesh-cache`` header (its prediction on a stream), when it sent one."""

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def end_s(self) -> float:
        return self.send_s + (self.e2e_s or 0.0)

    @property
    def shed(self) -> bool:
        """Refused by the router's flow control (429): the fleet was saturated."""
        error = self.error
        return not self.ok and error is not None and (error == SHED_ERROR or error.startswith("HTTP 429"))

    @property
    def timed_out(self) -> bool:
        """The client gave up waiting."""
        error = self.error
        return (
            not self.ok and error is not None and (error == TIMEOUT_ERROR or error.startswith("TimeoutError"))
        )


@dataclass(slots=True)
class QueueSample:
    """One scrape of every engine's queue gauges, ``t_s`` relative to the run's start."""

    t_s: float
    waiting: dict[str, float]
    running: dict[str, float]


@dataclass(frozen=True, slots=True)
class Dist:
    """Mean, median and tail of one metric (seconds or counts); all zero when there is no sample."""

    mean: float = 0.0
    median: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0
    count: int = 0

    @classmethod
    def of(cls, values: Iterable[float]) -> Dist:
        arr = np.asarray(list(values), dtype=np.float64)
        if arr.size == 0:
            return cls()
        return cls(
            mean=float(arr.mean()),
            median=float(np.percentile(arr, 50)),
            p90=float(np.percentile(arr, 90)),
            p99=float(np.percentile(arr, 99)),
            max=float(arr.max()),
            count=int(arr.size),
        )


@dataclass(frozen=True, slots=True)
class Summary:
    """Aggregate figures of a set of requests (a whole run or one stage)."""

    num_requests: int
    num_ok: int
    num_failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    reusable_tokens: int
    hit_rate: float
    reusable_hit_rate: float
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2e: Dist
    queue_mean: float = 0.0
    queue_max: float = 0.0
    stage: int | None = None
    offered_rate: float | None = None
    num_shed: int = 0
    """Refused by the router's flow control (429); not in ``num_failed``."""
    num_timeouts: int = 0
    """Failed requests the client gave up on (part of ``num_failed``)."""


def _queue_stats(samples: Sequence[QueueSample], start: float, end: float) -> tuple[float, float]:
    window = [s for s in samples if start <= s.t_s <= end and s.waiting]
    if not window:
        return 0.0, 0.0
    per_engine = [float(np.mean(list(s.waiting.values()))) for s in window]
    peak = max(max(s.waiting.values()) for s in window)
    return float(np.mean(per_engine)), float(peak)


def summarize(
    results: Sequence[RequestResult],
    queue: Sequence[QueueSample] = (),
    *,
    stage: int | None = None,
    offered_rate: float | None = None,
) -> Summary:
    """Summarize ``results`` (all of them, whatever their stage)."""
    ok = [r for r in results if r.ok]
    if results:
        start = min(r.send_s for r in results)
        end = max((r.end_s for r in ok), default=start)
    else:
        start = end = 0.0
    duration = max(end - start, 1e-9) if ok else 0.0
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    reusable = sum(r.reusable_prefix_len for r in ok)
    output = sum(r.output_tokens for r in ok)
    queue_mean, queue_max = _queue_stats(queue, start, end)
    num_shed = sum(1 for r in results if r.shed)
    return Summary(
        num_requests=len(results),
        num_ok=len(ok),
        num_failed=len(results) - len(ok) - num_shed,
        duration_s=duration,
        request_throughput=len(ok) / duration if duration else 0.0,
        output_throughput=output / duration if duration else 0.0,
        prompt_tokens=prompt,
        output_tokens=output,
        cached_tokens=cached,
        reusable_tokens=reusable,
        hit_rate=cached / prompt if prompt else 0.0,
        reusable_hit_rate=cached / reusable if reusable else 0.0,
        ttft=Dist.of(r.ttft_s for r in ok if r.ttft_s is not None),
        tpot=Dist.of(t for r in ok if (t := r.tpot_s) is not None),
        itl=Dist.of(g for r in ok for g in r.itl_s),
        e2e=Dist.of(r.e2e_s for r in ok if r.e2e_s is not None),
        queue_mean=queue_mean,
        queue_max=queue_max,
        stage=stage,
        offered_rate=offered_rate,
        num_shed=num_shed,
        num_timeouts=sum(1 for r in results if r.timed_out),
    )


def summarize_stages(
    results: Sequence[RequestResult],
    queue: Sequence[QueueSample] = (),
    rates: Sequence[float] | None = None,
) -> list[Summary]:
    """One summary per stage index present in ``results``, in stage order."""
    stages = sorted({r.stage for r in results})
    out = []
    for k in stages:
        rate = rates[k] if rates is not None and k < len(rates) else None
        out.append(summarize([r for r in results if r.stage == k], queue, stage=k, offered_rate=rate))
    return out


@dataclass(slots=True)
class RunResult:
    """Every request's result, the queue samples, and the summaries derived from them.

    ``summary`` covers the measured stages: every stage but the workload's warm-up ones (listed in
    ``warmup_stages``), or every request when the run has nothing else.
    """

    label: str
    workload: str
    results: list[RequestResult]
    queue: list[QueueSample]
    stage_rates: list[float]
    summary: Summary
    stages: list[Summary]
    warmup_stages: list[int] = field(default_factory=list)

    def to_dict(self, *, include_requests: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "label": self.label,
            "workload": self.workload,
            "summary": msgspec.to_builtins(self.summary),
            "stages": [msgspec.to_builtins(s) for s in self.stages],
            "warmup_stages": list(self.warmup_stages),
        }
        if include_requests:
            out["requests"] = [msgspec.to_builtins(r) for r in self.results]
        return out
