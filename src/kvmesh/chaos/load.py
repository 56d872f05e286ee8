"""Steady open-loop load through the router, kept up across faults, and its per-second series.

Requests are sent at a constant rate from a fixed set of prompts (shared system prompts, so the
caches matter), each measured by :func:`kvmesh.bench.runner.send_request` on the run's clock.
The rate can be changed, and sending paused while the router itself is down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import numpy as np

from kvmesh.bench.metrics import RequestResult
from kvmesh.bench.runner import RunOptions, send_request
from kvmesh.chaos.schedule import FaultLog
from kvmesh.core.tasks import cancel_and_wait
from kvmesh.workload import RequestSpec, SharedPrefixWorkload

MAX_IN_FLIGHT = 512
"""Beyond this many unanswered requests the load stops sending (and counts what it skipped)."""


def chaos_prompts(
    vocab_size: int, *, num_groups: int = 8, per_group: int = 8, seed: int = 0
) -> list[RequestSpec]:
    """The load's prompts: ``num_groups`` system prompts of 465 tokens, each with ``per_group``
    questions of 48 tokens, 8 output tokens.

    513 tokens: over two 256-token store chunks, so every request asks the shared tier, and one
    token past them, so the cacheable part (all but the block holding the last token) is whole
    chunks. A restarted engine then reloads a prompt from the shared tier as fully as its device
    cache held it: the restart scenarios measure the index and the routing, not the store's chunk
    granularity (with 336-token prompts, 256 of 320 cacheable tokens come back from the shared tier,
    which cost a rolling restart of every engine about 2 points of hit rate in the quick run).
    """
    workload = SharedPrefixWorkload(
        num_groups=num_groups,
        num_prompts_per_group=per_group,
        system_prompt_len=465,
        question_len=48,
        output_len=8,
        seed=seed,
        vocab_size=vocab_size,
        token_low=min(3, vocab_size - 1),
        name="chaos",
    )
    return list(workload.requests())


class SteadyLoad:
    """Sends ``rate`` requests per second to ``base_url`` until closed.

    Args:
        base_url: the router.
        model: the served model name.
        clock: the run's clock (results' ``send_s`` are on it).
        prompts: cycled in order.
        rate: requests per second.
        headers: sent with every request (tenant, auth).
        fresh_every: every this many requests, a prompt of new tokens is sent instead, which no
            cache holds: the engine asks the shared tier and writes its KV there (0: never).
        vocab_size: token ids of fresh prompts stay below it.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        clock: FaultLog,
        prompts: Sequence[RequestSpec],
        *,
        rate: float,
        headers: dict[str, str] | None = None,
        timeout_s: float = 30.0,
        fresh_every: int = 4,
        vocab_size: int = 259,
    ) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        if not prompts:
            raise ValueError("the load needs at least one prompt")
        self.options = RunOptions(
            base_url=base_url,
            model=model,
            stream=True,
            ignore_eos=True,
            request_timeout_s=timeout_s,
            headers=dict(headers or {}),
            progress=False,
            label="chaos",
        )
        self.clock = clock
        self.rate = rate
        self.results: list[RequestResult] = []
        self.num_skipped = 0
        self.fresh_every = fresh_every
        self.vocab_size = vocab_size
        self._rng = random.Random(0)
        self._prompts = itertools.cycle(prompts)
        self._counter = itertools.count()
        self._running = asyncio.Event()
        self._running.set()
        self._inflight: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.options.request_timeout_s, sock_connect=5)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=MAX_IN_FLIGHT)
        )
        self._task = asyncio.get_running_loop().create_task(self._run())

    def pause(self) -> None:
        """Stop sending new requests (those in flight finish)."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._inflight)

    async def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until every request sent so far has its result."""
        if self._inflight:
            await asyncio.wait(list(self._inflight), timeout=timeout_s)

    async def aclose(self) -> None:
        """Stop sending, let requests in flight finish (bounded by their timeout), close."""
        await cancel_and_wait([self._task])
        self._task = None
        await self.wait_idle(self.options.request_timeout_s + 5)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            if not self._running.is_set():
                await self._running.wait()
                next_at = loop.time()
            next_at += 1.0 / self.rate
            if len(self._inflight) >= MAX_IN_FLIGHT:
                self.num_skipped += 1
            else:
                task = loop.create_task(self._send_one())
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -1.0:
                next_at = loop.time()  # fell behind by a second: do not burst to catch up

    async def _send_one(self) -> None:
        assert self._session is not None, "SteadyLoad.start() not called"
        n = next(self._counter)
        spec = dataclasses.replace(next(self._prompts), request_id=f"chaos-{n}")
        if self.fresh_every and n % self.fresh_every == 0:
            low = min(spec.prompt_token_ids)
            tokens = [self._rng.randrange(low, self.vocab_size) for _ in spec.prompt_token_ids]
            spec = dataclasses.replace(spec, prompt_token_ids=tokens, reusable_prefix_len=0, group=None)
        self.results.append(await send_request(self._session, spec, self.options, self.clock.t0))

    def window(self, start_s: float, end_s: float) -> list[RequestResult]:
        """Results of requests sent in ``[start_s, end_s)``."""
        return [r for r in self.results if start_s <= r.send_s < end_s]


# --- figures over a set of results -----------------------------------------------------------------


def num_failed(results: Sequence[RequestResult]) -> int:
    return sum(1 for r in results if not r.ok)


def failure_kinds(results: Sequence[RequestResult], limit: int = 3) -> str:
    """The most common errors of failed requests, as ``error × n`` joined by `` | ``."""
    kinds = Counter((r.error or "no error text")[:120] for r in results if not r.ok)
    return " | ".join(f"{error} × {n}" for error, n in kinds.most_common(limit))


def hit_rate(results: Sequence[RequestResult]) -> float:
    """Cached prompt tokens / prompt tokens of the successful requests (``nan`` when none)."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    return sum(r.cached_tokens for r in ok) / prompt if prompt else float("nan")


def ttft_quantile(results: Sequence[RequestResult], q: float) -> float:
    """The ``q``-quantile (0..1) of TTFT of the successful requests (``nan`` when none)."""
    values = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    return float(np.quantile(values, q)) if values else float("nan")


@dataclass(slots=True)
class Series:
    """Per-bin figures for the timeline; bin ``i`` covers ``[t_s[i], t_s[i] + bin_s)`` by send time."""

    bin_s: float
    t_s: list[float]
    requests_per_s: list[float]
    errors: list[int]
    hit_rate: list[float]
    p90_ttft_s: list[float]


def series(results: Sequence[RequestResult], end_s: float, bin_s: float = 1.0) -> Series:
    """Bin ``results`` by send time from 0 to ``end_s``."""
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    num_bins = max(1, int(np.ceil(end_s / bin_s)))
    bins: list[list[RequestResult]] = [[] for _ in range(num_bins)]
    for r in results:
        i = int(r.send_s // bin_s)
        if 0 <= i < num_bins:
            bins[i].append(r)
    return Series(
        bin_s=bin_s,
        t_s=[i * bin_s for i in range(num_bins)],
        requests_per_s=[sum(1 for r in b if r.ok) / bin_s for b in bins],
        errors=[num_failed(b) for b in bins],
        hit_rate=[hit_rate(b) for b in bins],
        p90_ttft_s=[ttft_quantile(b, 0.9) for b in bins],
    )


def seconds_to_recover(
    results: Sequence[RequestResult], since_s: float, until_s: float, ttft_limit_s: float, bin_s: float = 0.5
) -> float:
    """Seconds after ``since_s`` until every later bin (up to ``until_s``) has no failure and a p90
    TTFT within ``ttft_limit_s``; ``nan`` when that never held."""
    window = [r for r in results if since_s <= r.send_s < until_s]
    shifted = [dataclasses.replace(r, send_s=r.send_s - since_s) for r in window]
    s = series(shifted, until_s - since_s, bin_s)
    good = [
        e == 0 and (np.isnan(p) or p <= ttft_limit_s) for e, p in zip(s.errors, s.p90_ttft_s, strict=True)
    ]
    if not good or not good[-1]:
        return float("nan")
    k = len(good)
    while k > 0 and good[k - 1]:
        k -= 1
    return k * bin_s
