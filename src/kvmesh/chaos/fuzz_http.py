"""Malformed requests to the gateway and to an engine: every answer must be a 4xx with a message.

Cases are hand-picked (truncated and non-JSON bodies, wrong types, out-of-vocabulary and negative
token ids, prompts longer than the context, nesting deeper than any decoder allows, invalid UTF-8,
oversized and conflicting headers) and generated from them (one field of a valid body replaced by a
value of a wrong type or range, a valid body cut at a random byte). Streaming clients that hang up
after the first chunk are mixed in; the processes must outlive all of it.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import msgspec

from kvmesh.chaos.bounds import ScenarioResult
from kvmesh.chaos.context import ChaosContext
from kvmesh.core.tenancy import TENANT_HEADER

BROKEN_STREAMS = 10


@dataclass(frozen=True, slots=True)
class Case:
    """One malformed request."""

    label: str
    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)


def _invalid_values(vocab: int, max_len: int) -> dict[str, list[object]]:
    """Per field of a completion body, values that make it invalid."""
    return {
        "prompt": [
            5,
            None,
            {},
            [],
            "",
            [1.5, 2],
            ["a", 1],
            [True, False],
            [[1, 2], "x", 3],
            [-1, 5],
            [vocab, 5],
            [2**32],
            [2**70],
            [3] * (max_len + 16),
        ],
        "max_tokens": ["ten", -1, 1.5, [], {}, 10**12],
        "temperature": ["hot", -1.0, [], {}],
        "model": [5, [], {}, "no-such-model"],
        "stream": ["yes", 2, [], {}],
        "messages": [5, "hi", [], [{"role": 5, "content": "x"}], [{"content": "x"}], [1, 2]],
    }


def _valid_body(model: str, chat: bool) -> dict[str, object]:
    if chat:
        return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    return {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 4}


def hand_picked(model: str, vocab: int, max_len: int, *, gateway: bool) -> list[Case]:
    """Fixed malformed requests, each on its own line below (``gateway``: add those only a router
    can tell are wrong)."""
    comp, chat = "/v1/completions", "/v1/chat/completions"
    valid = json.dumps(_valid_body(model, False)).encode()
    deep = b"[" * 100_000 + b"]" * 100_000
    only_gateway = [
        Case(
            "tenant header and cache_salt disagree",
            comp,
            json.dumps({**_valid_body(model, False), "cache_salt": "tenant-b"}).encode(),
            (("Content-Type", "application/json"), (TENANT_HEADER, "tenant-a")),
        )
    ]
    return (only_gateway if gateway else []) + [
        Case("empty body", comp, b""),
        Case("not JSON", comp, b"hello there"),
        Case("truncated JSON", comp, valid[: len(valid) // 2]),
        Case("JSON array body", comp, b"[1, 2, 3]"),
        Case("JSON string body", comp, b'"prompt"'),
        Case("JSON null body", comp, b"null"),
        Case("invalid UTF-8", comp, b'{"model": "\xff\xfe", "prompt": [1]}'),
        Case("nesting 100k deep", comp, b'{"model": "m", "prompt": ' + deep + b"}"),
        Case("2 MB of garbage", comp, random.Random(1).randbytes(2 << 20)),
        Case("no prompt", comp, json.dumps({"model": model, "max_tokens": 4}).encode()),
        Case("chat: no messages", chat, json.dumps({"model": model, "max_tokens": 4}).encode()),
        Case("chat: truncated", chat, json.dumps(_valid_body(model, True)).encode()[:-7]),
        Case(
            "prompt over the context",
            comp,
            json.dumps({"model": model, "prompt": [3] * (max_len + 1), "max_tokens": 4}).encode(),
        ),
        Case(
            "header line of 16 KiB",
            comp,
            valid,
            (("Content-Type", "application/json"), ("x-junk", "j" * 16384)),
        ),
    ]


def generated(model: str, vocab: int, max_len: int, seed: int) -> Iterator[Case]:
    """Endless cases: one field of a valid body replaced by an invalid value, or a body cut short."""
    rng = random.Random(seed)
    values = _invalid_values(vocab, max_len)
    while True:
        chat = rng.random() < 0.3
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = _valid_body(model, chat)
        if rng.random() < 0.25:
            raw = json.dumps(body).encode()
            yield Case("cut at a random byte", path, raw[: rng.randrange(1, len(raw) - 1)])
            continue
        fields = [f for f in values if (f == "messages") == chat or f not in ("prompt", "messages")]
        field = rng.choice(fields)
        body[field] = rng.choice(values[field])
        yield Case(f"invalid {field}", path, json.dumps(body).encode())


def _message_of(status: int, text: str) -> bool:
    """Whether an error answer says something: a JSON ``error.message`` or a non-empty text."""
    try:
        data = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return bool(text.strip())
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return bool(data["error"].get("message"))
    return bool(text.strip())


async def _send(session: aiohttp.ClientSession, base: str, case: Case) -> tuple[int, bool]:
    try:
        async with session.post(base + case.path, data=case.body, headers=dict(case.headers)) as resp:
            text = await resp.text(errors="replace")
            return resp.status, _message_of(resp.status, text)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return 0, bool(str(exc))


async def _broken_stream(session: aiohttp.ClientSession, base: str, model: str) -> None:
    """Start a long stream and hang up after the first chunk."""
    body = {"model": model, "prompt": [5] * 64, "max_tokens": 200, "ignore_eos": True, "stream": True}
    try:
        async with session.post(base + "/v1/completions", json=body) as resp:
            await resp.content.readline()
            resp.close()
    except (aiohttp.ClientError, TimeoutError):
        pass


async def _max_model_len(session: aiohttp.ClientSession, engine_url: str) -> int:
    async with session.get(engine_url + "/kvmesh/info") as resp:
        return int((await resp.json())["max_model_len"])


async def malformed_http(ctx: ChaosContext) -> ScenarioResult:
    """Send ``durations.http_cases`` malformed requests to the router and as many to an engine.

    Bounds: no 5xx, every answer a 4xx with a message, every process alive afterwards.
    """
    res = ScenarioResult("fuzz_http", "5b. malformed HTTP bodies and headers (gateway, engine)")
    targets = {"gateway": ctx.router_url, "engine": ctx.fleet.engine_urls[0]}
    n = ctx.durations.http_cases
    statuses: dict[int, int] = {}
    bad: list[str] = []
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        max_model_len = await _max_model_len(session, targets["engine"])
        for name, base in targets.items():
            fixed = hand_picked(ctx.model, ctx.vocab_size, max_model_len, gateway=name == "gateway")
            cases = fixed + [
                c
                for c, _ in zip(
                    generated(ctx.model, ctx.vocab_size, max_model_len, 5),
                    range(n - len(fixed)),
                    strict=False,
                )
            ]
            queue: asyncio.Queue[Case] = asyncio.Queue()
            for c in cases:
                queue.put_nowait(c)

            async def worker(base: str = base, name: str = name, queue: asyncio.Queue[Case] = queue) -> None:
                while not queue.empty():
                    case = queue.get_nowait()
                    status, said = await _send(session, base, case)
                    statuses[status] = statuses.get(status, 0) + 1
                    if not (400 <= status < 500 and said):
                        bad.append(f"{name} {case.label}: {status or 'no answer'}")

            await asyncio.gather(
                *(worker() for _ in range(ctx.durations.http_concurrency)),
                *(_broken_stream(session, base, ctx.model) for _ in range(BROKEN_STREAMS)),
            )
    await asyncio.sleep(0.5)
    procs = [ctx.fleet.router, *(e.process for e in ctx.fleet.engines)]
    dead = [p.name for p in procs if p is not None and p.returncode is not None]
    res.figures.update(
        requests_sent=sum(statuses.values()),
        broken_streams=BROKEN_STREAMS * len(targets),
        statuses=", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())),
    )
    if bad:
        res.figures["not_4xx_examples"] = "; ".join(sorted(set(bad))[:8])
    res.check("5xx answers", sum(v for k, v in statuses.items() if k >= 500), "==", 0)
    res.check("answers that are not a 4xx with a message", len(bad), "==", 0)
    res.check("processes that died", len(dead), "==", 0)
    return res
