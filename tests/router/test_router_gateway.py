"""The gateway in-process (aiohttp test client) in front of real local test engines."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient
from front_testing import served
from router_fakes import MODEL, FakeEngine, free_port

from kvmesh.router.config import router_config_from_dict
from kvmesh.router.gateway import ENDPOINT_HEADER, Gateway

pytestmark = pytest.mark.usefixtures("both_servers")

PROMPT = list(range(3000, 3000 + 16 * 10))


class ByteTokenizer:
    """A test tokenizer: UTF-8 bytes as ids; chat rendered as "role: content" lines."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + list(text.encode())

    def apply_chat_template(self, messages: Any, *, add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
        return self.encode(text + ("assistant: " if add_generation_prompt else ""), add_special_tokens=False)


@contextlib.asynccontextmanager
async def gateway_client(engines: list[FakeEngine], **overrides: Any):
    raw: dict[str, Any] = {
        "endpoints": [{"url": e.url} for e in engines],
        "policy": "precise",
        "seed": 1,
        "health": {"intervalS": 0.2, "timeoutS": 0.5, "failureThreshold": 2, "metricsIntervalS": 0.2},
    }
    raw.update(overrides)
    gw = Gateway(router_config_from_dict(raw), tokenizer=ByteTokenizer())
    client = TestClient(served(gw))
    await client.start_server()
    try:
        yield gw, client
    finally:
        await client.close()


async def wait_for(cond, timeout: float = 5.0) -> float:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def completion(client: TestClient, prompt: Any, headers: dict | None = None, **body: Any):
    resp = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3, **body}, headers=headers
    )
    return resp, await resp.json()


async def test_precise_routing_follows_the_prefix(engines):
    es = await engines(3)
    async with gateway_client(es) as (gw, client):
        # what each engine reports of itself reaches the scorers (the TTFT estimate's transfer size, KV room)
        states = [gw.pool.get(e.url).state for e in es]  # type: ignore[union-attr]
        assert all(s.kv_bytes_per_token == 1024 and s.kv_capacity_tokens == 65536 for s in states)
        resp, body = await completion(client, PROMPT)
        assert resp.status == 200
        holder = resp.headers[ENDPOINT_HEADER]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        await wait_for(lambda: gw.applier is not None and gw.applier.num_blocks(holder) == 10)  # type: ignore[arg-type]
        for i in range(5):
            resp, body = await completion(client, PROMPT + [i] * 20)
            assert resp.headers[ENDPOINT_HEADER] == holder
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
        metrics = await (await client.get("/metrics")).text()
        assert "kvmesh_router_predicted_hit_tokens_total 800.0" in metrics
        assert "kvmesh_router_realized_hit_tokens_total 800.0" in metrics
        assert f'kvmesh_router_decisions_total{{endpoint="{holder}"}} 6.0' in metrics
        assert 'kvmesh_router_scorer_seconds_count{scorer="precise-prefix-cache-scorer"} 6.0' in metrics
        assert "kvmesh_router_index_ops_total" in metrics


async def test_token_prompts_pass_through_untouched(engines):
    (e,) = await engines(1)
    async with gateway_client([e]) as (_, client):
        sent = {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 2,
            "temperature": 0.5,
            "extra_field": {"x": [1]},
        }
        resp = await client.post("/v1/completions", json=sent)
        assert resp.status == 200
        assert e.received[-1] == sent


async def test_tenant_header_salts_routing_and_engine_cache(engines):
    es = await engines(2)
    async with gateway_client(es) as (gw, client):
        resp, body = await completion(client, PROMPT, headers={"x-tenant-id": "acme"})
        holder = resp.headers[ENDPOINT_HEADER]
        engine = next(e for e in es if e.url == holder)
        assert engine.received[-1]["cache_salt"] == "acme"
        assert engine.headers[-1]["x-tenant-id"] == "acme"
        await wait_for(lambda: gw.applier is not None and gw.applier.num_blocks(holder) == 10)  # type: ignore[arg-type]
        resp, body = await completion(client, PROMPT, headers={"x-tenant-id": "globex"})
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        resp, body = await completion(client, PROMPT, headers={"x-tenant-id": "acme"})
        assert resp.headers[ENDPOINT_HEADER] == holder
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
        resp, body = await completion(client, PROMPT, headers={"x-tenant-id": "acme"}, cache_salt="other")
        assert resp.status == 400 and "different tenants" in body["error"]["message"]


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"model": "\xff\xfe", "prompt": [1]}', "not UTF-8"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ],
)
async def test_undecodable_bodies_get_400_not_500(engines, raw, needle):
    es = await engines(1)
    async with gateway_client(es) as (_, client):
        resp = await client.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"})
        assert resp.status == 400
        assert needle in (await resp.json())["error"]["message"]
        assert es[0].received == []


async def test_sse_is_relayed_without_buffering(engines):
    (e,) = await engines(1)
    e.gate = asyncio.Event()
    async with gateway_client([e]) as (_, client):
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "stream": True})
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers[ENDPOINT_HEADER] == e.url
        first = await asyncio.wait_for(resp.content.readline(), timeout=5)
        assert b"e0-0" in first  # arrived while the engine still holds the rest of the stream
        e.gate.set()
        rest = await resp.content.read()
        assert rest.endswith(b"data: [DONE]\n\n")
        assert b'"cached_tokens":0' in rest
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "stream": True})
        await resp.read()
        metrics = await (await client.get("/metrics")).text()
        assert "kvmesh_router_realized_hit_tokens_total 160.0" in metrics


async def test_a_sessions_turns_count_once_in_its_endpoints_session_kv(engines):
    (e,) = await engines(1)
    first = list(range(5000, 5600))
    async with gateway_client([e]) as (gw, client):
        assert gw.pool is not None
        (state,) = gw.pool.states()
        for prompt in (first, [*first, *range(9000, 9300)]):  # the second turn continues the first
            resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
            await resp.read()
        assert state.session_kv_tokens == 900
        metrics = await (await client.get("/metrics")).text()
        assert f'kvmesh_router_session_kv_tokens{{endpoint="{e.url}"}} 900.0' in metrics


async def test_prefill_work_is_pending_until_the_first_chunk(engines):
    (e,) = await engines(1)
    e.prefill_gate = asyncio.Event()
    async with gateway_client([e], adminToken="s3cret") as (gw, client):
        assert gw.pool is not None
        (state,) = gw.pool.states()
        request = asyncio.ensure_future(
            client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "stream": True})
        )
        await wait_for(lambda: state.pending_prefill_tokens > 0)
        assert state.pending_prefill_tokens == len(PROMPT)  # nothing cached yet: all of it
        assert state.pending_kv_tokens == len(PROMPT)  # and its KV is still to be taken
        assert state.kv_release_tokens_per_s == 0.0
        metrics = await (await client.get("/metrics")).text()
        assert f'kvmesh_router_pending_prefill_tokens{{endpoint="{e.url}"}} {len(PROMPT)}.0' in metrics
        assert state.pending_prefills == 1
        assert f'kvmesh_router_pending_prefill_requests{{endpoint="{e.url}"}} 1.0' in metrics
        e.prefill_gate.set()
        resp = await request
        await resp.read()
        assert state.pending_prefill_tokens == 0
        assert state.pending_kv_tokens == 0
        assert state.pending_prefills == 0
        assert len(gw.prefill_ledger) == 0
        # the answer is over: the prompt's KV is free again, and the endpoint's release rate knows it
        await wait_for(lambda: state.kv_release_tokens_per_s > 0.0)
        # the release forecast saw the answer start; the admin listing leaves it out and still answers
        assert state.kv_releases is not None
        listing = await client.get("/admin/endpoints", headers={"Authorization": "Bearer s3cret"})
        assert listing.status == 200, await listing.text()
        (item,) = (await listing.json())["endpoints"]
        assert "kv_releases" not in item and item["kv_release_tokens_per_s"] > 0.0


async def test_connect_failure_retries_the_next_endpoint(engines):
    es = await engines(2)
    async with gateway_client(es, policy="round-robin", health={"intervalS": 30, "metricsIntervalS": 0}) as (
        gw,
        client,
    ):
        dead = es[0] if es[0].url < es[1].url else es[1]
        alive = es[1] if dead is es[0] else es[0]
        await dead.stop()
        resp, _ = await completion(client, PROMPT)  # round-robin ranks `dead` first
        assert resp.status == 200
        assert resp.headers[ENDPOINT_HEADER] == alive.url
        assert not gw.pool.get(dead.url).state.healthy  # type: ignore[union-attr]
        metrics = await (await client.get("/metrics")).text()
        assert "kvmesh_router_retries_total 1.0" in metrics
        for _ in range(3):
            resp, _ = await completion(client, PROMPT)
            assert resp.headers[ENDPOINT_HEADER] == alive.url


async def test_all_endpoints_down_is_a_503_or_502(engines):
    es = await engines(1)
    async with gateway_client(es, health={"intervalS": 30, "metricsIntervalS": 0}) as (_, client):
        await es[0].stop()
        resp, body = await completion(client, PROMPT)
        assert resp.status == 502 and "no endpoint could be reached" in body["error"]["message"]
        resp, body = await completion(client, PROMPT)
        assert resp.status == 503
        assert (await client.get("/health")).status == 503


async def test_unhealthy_endpoint_leaves_and_returns(engines):
    es = await engines(2)
    async with gateway_client(es, policy="round-robin") as (gw, client):
        es[0].healthy = False
        await wait_for(lambda: not gw.pool.get(es[0].url).state.healthy)  # type: ignore[union-attr]
        for _ in range(4):
            resp, _ = await completion(client, PROMPT)
            assert resp.headers[ENDPOINT_HEADER] == es[1].url
        es[0].healthy = True
        await wait_for(lambda: gw.pool.get(es[0].url).state.healthy)  # type: ignore[union-attr]
        seen = {(await completion(client, PROMPT))[0].headers[ENDPOINT_HEADER] for _ in range(4)}
        assert seen == {es[0].url, es[1].url}


async def test_metrics_scrape_feeds_load_scorers(engines):
    es = await engines(2)
    es[0].waiting = 40
    async with gateway_client(es, policy="load") as (gw, client):
        await wait_for(lambda: gw.pool.get(es[0].url).state.waiting == 40)  # type: ignore[union-attr]
        for _ in range(5):
            resp, _ = await completion(client, PROMPT)
            assert resp.headers[ENDPOINT_HEADER] == es[1].url


async def test_chat_is_tokenized_with_the_template(engines):
    es = await engines(2)
    async with gateway_client(es) as (_, client):
        messages = [{"role": "system", "content": "x" * 200}, {"role": "user", "content": "hi"}]
        resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert resp.status == 200
        engine = next(e for e in es if e.url == resp.headers[ENDPOINT_HEADER])
        assert engine.received[-1]["messages"] == messages
        bad = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"content": "x"}]})
        assert bad.status == 400


async def test_models_and_health(engines):
    es = await engines(1)
    async with gateway_client(es) as (_, client):
        models = await (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == MODEL
        health = await (await client.get("/health")).json()
        assert health == {"status": "ok", "endpoints": 1, "healthy": 1}


async def test_admin_api(engines):
    es = await engines(2)
    async with gateway_client(es[:1], adminToken="s3cret") as (gw, client):
        auth = {"Authorization": "Bearer s3cret"}
        assert (await client.get("/admin/endpoints")).status == 401
        assert (await client.get("/admin/endpoints", headers={"Authorization": "Bearer nope"})).status == 401
        resp = await client.post("/admin/endpoints", json={"url": es[1].url, "role": "decode"}, headers=auth)
        assert resp.status == 201
        assert (await resp.json())["events_endpoint"] == es[1].publisher.endpoint  # type: ignore[union-attr]
        listing = (await (await client.get("/admin/endpoints", headers=auth)).json())["endpoints"]
        assert {e["pod"] for e in listing} == {es[0].url, es[1].url}
        assert next(e for e in listing if e["pod"] == es[1].url)["role"] == "decode"
        bad = await client.post("/admin/endpoints", json={"url": "ftp://x"}, headers=auth)
        assert bad.status == 400 and "http://host:port" in (await bad.json())["error"]["message"]

        resp, _ = await completion(client, PROMPT)
        holder = resp.headers[ENDPOINT_HEADER]
        await wait_for(lambda: gw.applier.num_blocks(holder) == 10)  # type: ignore[union-attr, arg-type]
        stats = await (await client.get("/admin/index", headers=auth)).json()
        assert stats["index"]["num_keys"] == 10 and stats["ingest"]["num_blocks_stored"] == 10
        assert stats["tokenizer"]["prefix_reuse"] is False  # the byte tokenizer has no fast backend
        flushed = await (await client.post("/admin/flush", json={"pod": holder}, headers=auth)).json()
        assert flushed == {"flushed": 10}
        assert (await client.post("/admin/flush", json={"tenant": 5}, headers=auth)).status == 400

        resp = await client.delete("/admin/endpoints", params={"url": es[1].url}, headers=auth)
        assert resp.status == 200
        assert (
            await client.delete("/admin/endpoints", params={"url": es[1].url}, headers=auth)
        ).status == 404
        assert es[1].url not in gw.pool  # type: ignore[operator]


async def test_admin_disabled_without_token(engines):
    es = await engines(1)
    async with gateway_client(es) as (_, client):
        assert (await client.get("/admin/index", headers={"Authorization": "Bearer x"})).status == 403


def _fuzz_bodies(n: int) -> list[bytes]:
    import random

    rng = random.Random(1234)
    atoms: list[Any] = [
        None,
        True,
        0,
        -1,
        2**40,
        1.5,
        "",
        "x",
        [],
        {},
        [1, "a"],
        {"a": 1},
        [[1, 2]],
        [-5],
        [2**33],
    ]
    fields = ["model", "prompt", "stream", "cache_salt", "messages", "max_tokens"]
    out: list[bytes] = []
    for _ in range(n):
        kind = rng.randrange(6)
        if kind == 0:
            out.append(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40))))
        elif kind == 1:
            out.append(msgspec.json.encode(rng.choice(atoms)))
        elif kind == 2:
            body = {f: rng.choice(atoms) for f in rng.sample(fields, rng.randrange(1, 4))}
            body.setdefault("prompt", rng.choice(atoms))
            if body["prompt"] in ("x", [[1, 2]]):  # the two valid prompts among the atoms
                body["prompt"] = {}
            out.append(msgspec.json.encode(body))
        elif kind == 3:
            good = msgspec.json.encode({"model": MODEL, "prompt": [1, 2, 3]})
            cut = rng.randrange(1, len(good))
            out.append(good[:cut])
        elif kind == 4:
            out.append(
                msgspec.json.encode(
                    {"model": MODEL, "prompt": [1, 2, rng.choice(["a", -1, 2**32, 1.0, None])]}
                )
            )
        else:
            out.append(
                msgspec.json.encode({"model": MODEL, "prompt": [1], "stream": rng.choice(["yes", 1, [], {}])})
            )
    return out


@pytest.mark.slow
async def test_fuzzed_bodies_get_4xx_and_the_router_keeps_serving(engines):
    es = await engines(1)
    async with gateway_client(es, health={"intervalS": 30, "metricsIntervalS": 0}) as (_, client):
        bodies = _fuzz_bodies(10_000)
        statuses: dict[int, int] = {}
        for i in range(0, len(bodies), 200):
            chunk = bodies[i : i + 200]
            resps = await asyncio.gather(
                *(
                    client.post("/v1/completions", data=b, headers={"Content-Type": "application/json"})
                    for b in chunk
                )
            )
            for r in resps:
                if r.status == 400:
                    body = await r.json()
                    assert body["error"]["message"]
                statuses[r.status] = statuses.get(r.status, 0) + 1
                r.release()
        assert statuses == {400: 10_000}
        assert es[0].received == []
        resp, body = await completion(client, PROMPT)
        assert resp.status == 200


async def test_oversized_body_is_413(engines):
    es = await engines(1)
    async with gateway_client(es, maxBodyBytes=1024) as (_, client):
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": list(range(2000))})
        assert resp.status == 413
        assert "larger than 1024 bytes" in (await resp.json())["error"]["message"]


async def test_pd_sends_prefill_leg_then_decode(engines):
    prefill, decode = await engines(2)
    prefill.role, decode.role = "prefill", "decode"
    async with gateway_client([prefill, decode], policy="pd") as (_, client):
        long_prompt = list(range(10_000, 10_400))
        resp, _ = await completion(client, long_prompt, max_tokens=8, stream=False)
        assert resp.status == 200 and resp.headers[ENDPOINT_HEADER] == decode.url
        leg = prefill.received[-1]
        assert leg["kv_transfer_params"] == {"role": "prefill"} and leg["max_tokens"] == 1
        assert leg["prompt"] == long_prompt
        assert decode.received[-1]["kv_transfer_params"] == {"role": "decode"}
        assert decode.received[-1]["max_tokens"] == 8
        # a short prompt goes straight to decode
        n_prefill = len(prefill.received)
        resp, _ = await completion(client, list(range(100)))
        assert resp.headers[ENDPOINT_HEADER] == decode.url
        assert len(prefill.received) == n_prefill
        assert "kv_transfer_params" not in decode.received[-1]


async def test_two_router_replicas_share_a_redis_index(engines, redis_url):
    import uuid

    es = await engines(3)
    index = {"backend": "redis", "redisUrl": redis_url, "keyPrefix": f"gw{uuid.uuid4().hex[:8]}:"}
    async with (
        gateway_client(es, index=index) as (gw1, c1),
        gateway_client(es, index=index, seed=7) as (gw2, c2),
    ):
        resp, _ = await completion(c1, PROMPT)
        holder = resp.headers[ENDPOINT_HEADER]
        await wait_for(lambda: gw2.applier is not None and gw2.applier.num_blocks(holder) == 10)  # type: ignore[arg-type]
        for i in range(3):
            resp, body = await completion(c2, PROMPT + [i] * 16)
            assert resp.headers[ENDPOINT_HEADER] == holder
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
        stats = await gw1.index.stats() if False else gw1.index.stats()
        assert stats.backend == "redis" and stats.num_keys >= 10


async def test_a_redis_index_is_never_called_from_the_event_loop(engines, redis_url, monkeypatch):
    import threading
    import uuid

    from kvmesh.router.redis_index import RedisIndex

    callers: dict[str, set[str]] = {"write_batch": set(), "lookup": set(), "clear_pod": set()}
    for name in callers:
        original = getattr(RedisIndex, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            callers[_name].add(threading.current_thread().name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(RedisIndex, name, spy)
    es = await engines(2)
    index = {"backend": "redis", "redisUrl": redis_url, "keyPrefix": f"loop{uuid.uuid4().hex[:8]}:"}
    async with gateway_client(es, index=index) as (gw, client):
        resp, _ = await completion(client, PROMPT)
        holder = resp.headers[ENDPOINT_HEADER]
        await wait_for(lambda: gw.applier is not None and gw.applier.num_blocks(holder) == 10)  # type: ignore[arg-type]
        await wait_for(lambda: gw.writer is not None and gw.writer.num_pending == 0)
        resp, body = await completion(client, PROMPT + [1] * 16)
        assert resp.headers[ENDPOINT_HEADER] == holder
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
    loop_thread = threading.current_thread().name
    assert callers["write_batch"] == {"kvmesh-index-writer"}
    assert callers["lookup"] and loop_thread not in callers["lookup"]
    assert loop_thread not in callers["clear_pod"]


async def test_vllm_pod_without_info_uses_configured_event_endpoints(engines):
    (e,) = await engines(1)
    assert e.publisher is not None
    # a vLLM pod answers 404 on /kvmesh/info: the router takes events and model from config
    e.vllm_like = True
    endpoint = {
        "url": e.url,
        "eventsEndpoint": e.publisher.endpoint,
        "replayEndpoint": e.publisher.replay_endpoint,
    }
    async with gateway_client([e], endpoints=[endpoint], model=MODEL, revision="") as (gw, client):
        assert gw.pool.get(e.url).info is None  # type: ignore[union-attr]
        assert gw.pool.get(e.url).state.kv_bytes_per_token == 0  # type: ignore[union-attr]
        await completion(client, PROMPT)
        await wait_for(lambda: gw.applier is not None and gw.applier.num_blocks(e.url) == 10)  # type: ignore[arg-type]
        _, body = await completion(client, PROMPT)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
        metrics = await (await client.get("/metrics")).text()
        assert "kvmesh_router_predicted_hit_tokens_total 160.0" in metrics


async def test_late_and_restarted_engines_are_rediscovered(engines):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    (other,) = await engines(1)
    async with gateway_client([other], endpoints=[{"url": url}, {"url": other.url}], policy="precise") as (
        gw,
        client,
    ):
        assert not gw.pool.get(url).state.healthy  # type: ignore[union-attr]
        late = await FakeEngine("late").start(port)
        try:
            await wait_for(lambda: gw.pool.get(url).state.healthy)  # type: ignore[union-attr]
            await wait_for(lambda: gw.intake is not None and url in gw.intake.sources)
            assert gw.intake.sources[url][0] == late.publisher.endpoint  # type: ignore[union-attr]
            await late.stop()
            await wait_for(lambda: not gw.pool.get(url).state.healthy)  # type: ignore[union-attr]
            # a new process on the same HTTP port, with new event sockets
            late = await FakeEngine("late2").start(port)
            await wait_for(lambda: gw.intake.sources[url][0] == late.publisher.endpoint)  # type: ignore[union-attr]
            other.healthy = False
            await wait_for(lambda: not gw.pool.get(other.url).state.healthy)  # type: ignore[union-attr]
            resp, _ = await completion(client, PROMPT)
            assert resp.headers[ENDPOINT_HEADER] == url
            # its blocks arrive through the new event stream
            await wait_for(lambda: gw.applier.num_blocks(url) == 10)  # type: ignore[union-attr, arg-type]
        finally:
            await late.stop()
