"""How many HTTP requests engines answered per route, from their ``kvmesh:http_requests_total``.

A router in front of a fleet shows up in these counters: the completions it forwarded, and the
``/v1/*/render`` and ``/tokenize`` calls a peer router makes to prepare each request.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

RouteKey = tuple[str, str]
"""``(route, status)`` as the engine labels them, e.g. ``("/v1/completions", "200")``."""
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
PREPARATION_ROUTES = ("/v1/completions/render", "/v1/chat/completions/render", "/tokenize")


def parse_route_counts(text: str) -> Counter[RouteKey]:
    """The ``kvmesh:http_requests_total`` samples of one ``/metrics`` page."""
    counts: Counter[RouteKey] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvmesh:http_requests_total":
                counts[(sample.labels.get("route", ""), sample.labels.get("status", ""))] += int(sample.value)
    return counts


async def scrape_route_counts(
    session: aiohttp.ClientSession, engine_urls: Sequence[str]
) -> Counter[RouteKey]:
    """The counters of every engine, summed.

    Raises:
        aiohttp.ClientError: an engine did not answer (callers compare before and after a run, so a
            missing engine would make the difference wrong rather than smaller).
    """

    async def one(url: str) -> Counter[RouteKey]:
        async with session.get(url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            resp.raise_for_status()
            return parse_route_counts(await resp.text())

    total: Counter[RouteKey] = Counter()
    for counts in await asyncio.gather(*(one(u) for u in engine_urls)):
        total.update(counts)
    return total


def num_requests(counts: Counter[RouteKey], routes: Sequence[str], *, ok_only: bool = False) -> int:
    """Requests to ``routes`` in ``counts`` (only 2xx answers with ``ok_only``)."""
    return int(
        sum(
            n
            for (route, status), n in counts.items()
            if route in routes and (not ok_only or status.startswith("2"))
        )
    )
