"""The load runner: sends a workload to an OpenAI-compatible endpoint and measures every request.

Open loop: each request is sent at its ``arrival_s`` (the workload's Poisson or constant stages),
however many are in flight. Closed loop (``concurrency`` set): that many workers send requests back to
back, ignoring arrival times. Either way, requests sharing a ``session_id`` go one after another, and
one with a ``gap_after_previous_s`` waits that long after the previous one finished.

Streaming completions are read as SSE; the final usage chunk (``stream_options.include_usage``) gives
prompt, completion and cached token counts. Token-id prompts go to ``/v1/completions``; with
``api="chat"`` requests that carry ``messages`` go to ``/v1/chat/completions``.

While the run lasts, a sampler scrapes ``vllm:num_requests_waiting``/``running`` from each engine's
``/metrics``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvmesh.bench.metrics import QueueSample, RequestResult, RunResult, summarize, summarize_stages
from kvmesh.core.cache_usage import CACHE_HEADER
from kvmesh.workload import RequestSpec, Workload

ENDPOINT_HEADER = "x-kvmesh-endpoint"
"""Response header in which the router names the engine it picked (recorded when present)."""

_json_decoder = msgspec.json.Decoder()


@dataclass(slots=True)
class RunOptions:
    """How to drive the endpoint.

    Args:
        base_url: the router's (or one engine's) base URL, e.g. ``http://127.0.0.1:8000``.
        model: the ``model`` field sent with every request.
        concurrency: closed loop with this many workers; ``None`` = open loop on arrival times.
        metrics_urls: engine base URLs whose ``/metrics`` are sampled for queue depth.
        ignore_eos: ask for exactly ``output_len`` tokens (vLLM's ``ignore_eos``).
    """

    base_url: str
    model: str
    api: Literal["completions", "chat"] = "completions"
    concurrency: int | None = None
    metrics_urls: list[str] = field(default_factory=list)
    sample_interval_s: float = 0.5
    stream: bool = True
    ignore_eos: bool = True
    request_timeout_s: float = 600.0
    headers: dict[str, str] = field(default_factory=dict)
    progress: bool = True
    label: str = "run"


def _request_body(spec: RequestSpec, options: RunOptions) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": options.model,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": options.stream,
    }
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.stream:
        body["stream_options"] = {"include_usage": True}
    if options.api == "chat" and spec.messages is not None:
        body["messages"] = spec.messages
        return "/v1/chat/completions", body
    body["prompt"] = spec.prompt_token_ids
    return "/v1/completions", body


def _usage_into(result: RequestResult, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    if isinstance(usage.get("prompt_tokens"), int):
        result.prompt_tokens = usage["prompt_tokens"]
    if isinstance(usage.get("completion_tokens"), int):
        result.output_tokens = usage["completion_tokens"]
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        result.cached_tokens = details["cached_tokens"]


async def send_request(
    session: aiohttp.ClientSession, spec: RequestSpec, options: RunOptions, t0: float
) -> RequestResult:
    """Send one request and measure it; failures come back as ``ok=False`` with the error text."""
    path, body = _request_body(spec, options)
    send = time.perf_counter()
    result = RequestResult(
        request_id=spec.request_id,
        stage=spec.stage,
        send_s=send - t0,
        ok=False,
        prompt_tokens=len(spec.prompt_token_ids),
        reusable_prefix_len=spec.reusable_prefix_len,
        group=spec.group,
    )
    headers = {"x-request-id": spec.request_id, **options.headers}
    chunks = 0
    try:
        async with session.post(options.base_url.rstrip("/") + path, json=body, headers=headers) as resp:
            result.endpoint = resp.headers.get(ENDPOINT_HEADER)
            result.cache_note = resp.headers.get(CACHE_HEADER)
            if resp.status >= 400:
                text = await resp.text()
                result.error = f"HTTP {resp.status}: {text[:300]}"
                return result
            if not options.stream:
                data = _json_decoder.decode(await resp.read())
                now = time.perf_counter()
                result.ttft_s = result.e2e_s = now - send
                _usage_into(result, data.get("usage") if isinstance(data, dict) else None)
                result.ok = True
                return result
            last = send
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                data = _json_decoder.decode(payload)
                if not isinstance(data, dict):
                    continue
                if data.get("error"):
                    result.error = f"stream error: {data['error']}"
                    return result
                if data.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft_s = now - send
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    chunks += 1
                if data.get("usage"):
                    _usage_into(result, data["usage"])
            result.e2e_s = last - send
            if result.output_tokens == 0:
                result.output_tokens = chunks
            # An OpenAI stream ends with [DONE]: one cut short (its engine stopped) lost its tail
            # and its usage, whatever it streamed before.
            result.ok = chunks > 0 and done
            if chunks == 0:
                result.error = "stream ended without output"
            elif not done:
                result.error = "stream ended before [DONE]"
    except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def parse_queue_metrics(text: str) -> tuple[float, float]:
    """Sum of ``vllm:num_requests_waiting`` and of ``vllm:num_requests_running`` in a /metrics page."""
    waiting = running = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_waiting":
                waiting += sample.value
            elif sample.name == "vllm:num_requests_running":
                running += sample.value
    return waiting, running


async def _sample_queues(
    session: aiohttp.ClientSession, urls: Sequence[str], interval: float, t0: float, out: list[QueueSample]
) -> None:
    timeout = aiohttp.ClientTimeout(total=max(interval * 4, 2.0))

    async def one(url: str) -> tuple[str, tuple[float, float] | None]:
        try:
            async with session.get(url.rstrip("/") + "/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    return url, None
                return url, parse_queue_metrics(await resp.text())
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return url, None

    while True:
        t = time.perf_counter() - t0
        got = await asyncio.gather(*(one(u) for u in urls))
        waiting = {u: v[0] for u, v in got if v is not None}
        running = {u: v[1] for u, v in got if v is not None}
        if waiting:
            out.append(QueueSample(t_s=t, waiting=waiting, running=running))
        await asyncio.sleep(interval)


class _Progress:
    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self._progress: Progress | None = None
        if enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("failed {task.fields[failed]}"),
                TimeElapsedColumn(),
                transient=True,
            )
            self._task = self._progress.add_task(label, total=total, failed=0)
        self._failed = 0

    def __enter__(self) -> _Progress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def advance(self, result: RequestResult) -> None:
        self._failed += not result.ok
        if self._progress is not None:
            self._progress.update(self._task, advance=1, failed=self._failed)


async def run_workload(
    workload: Workload | Iterable[RequestSpec],
    options: RunOptions,
    *,
    stage_rates: Sequence[float] = (),
) -> RunResult:
    """Drive ``workload`` against ``options.base_url`` and return every measurement.

    Args:
        workload: a :class:`Workload` or an iterable of request specs in arrival order.
        stage_rates: offered rate of each stage, for the per-stage table (taken from the workload's
            ``stages`` when it has them).
    """
    name = getattr(workload, "name", "requests")
    specs = list(workload.requests()) if hasattr(workload, "requests") else list(workload)
    stages = getattr(workload, "stages", None) or []
    if not stage_rates:
        stage_rates = [s.rate for s in stages]
    warmup = [k for k, s in enumerate(stages) if getattr(s, "warmup", False)]
    results: list[RequestResult] = []
    queue: list[QueueSample] = []
    # per session, the last request's future; its result is when that request finished (perf_counter)
    session_done: dict[str, asyncio.Future[float]] = {}
    timeout = aiohttp.ClientTimeout(total=options.request_timeout_s, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        sampler = (
            asyncio.create_task(
                _sample_queues(session, options.metrics_urls, options.sample_interval_s, t0, queue)
            )
            if options.metrics_urls
            else None
        )
        with _Progress(len(specs), options.label, options.progress) as progress:

            async def run_one(spec: RequestSpec, wait_for: asyncio.Future[float] | None, paced: bool) -> None:
                due = t0 + spec.arrival_s if paced else 0.0
                if wait_for is not None:
                    finished = await wait_for
                    if spec.gap_after_previous_s is not None:
                        due = max(due, finished + spec.gap_after_previous_s)
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                result = await send_request(session, spec, options, t0)
                results.append(result)
                progress.advance(result)

            def chain(spec: RequestSpec) -> tuple[asyncio.Future[float] | None, asyncio.Future[float] | None]:
                if spec.session_id is None:
                    return None, None
                prev = session_done.get(spec.session_id)
                mine: asyncio.Future[float] = loop.create_future()
                session_done[spec.session_id] = mine
                return prev, mine

            async def finish(
                coro_wait: asyncio.Future[float] | None,
                mine: asyncio.Future[float] | None,
                spec: RequestSpec,
                paced: bool,
            ) -> None:
                try:
                    await run_one(spec, coro_wait, paced)
                finally:
                    if mine is not None and not mine.done():
                        mine.set_result(time.perf_counter())

            try:
                if options.concurrency is None:
                    tasks = []
                    for spec in specs:
                        prev, mine = chain(spec)
                        tasks.append(asyncio.create_task(finish(prev, mine, spec, True)))
                    await asyncio.gather(*tasks)
                else:
                    if options.concurrency <= 0:
                        raise ValueError(f"concurrency must be > 0, got {options.concurrency}")
                    pending = iter(specs)

                    async def worker() -> None:
                        for spec in pending:
                            prev, mine = chain(spec)
                            await finish(prev, mine, spec, False)

                    await asyncio.gather(*(worker() for _ in range(options.concurrency)))
            finally:
                if sampler is not None:
                    sampler.cancel()
                    await asyncio.gather(sampler, return_exceptions=True)
    results.sort(key=lambda r: r.send_s)
    rates = list(stage_rates)
    measured = [r for r in results if r.stage not in warmup]
    return RunResult(
        label=options.label,
        workload=name,
        results=results,
        queue=queue,
        stage_rates=rates,
        summary=summarize(measured or results, queue),
        stages=summarize_stages(results, queue, rates or None),
        warmup_stages=warmup if measured else [],
    )
