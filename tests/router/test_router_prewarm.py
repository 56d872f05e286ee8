"""``POST /v1/kvmesh/prewarm`` in front of test engines: strict validation, one computation per
document, the skip of what the fleet holds, and the wait for the shared tier's announcement."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from router_fakes import BLOCK, MODEL, FakeEngine, engine_hash

from kvmesh.core.events import BlockStored
from kvmesh.core.hashing import BlockHasher, Namespace
from kvmesh.router.config import router_config_from_dict
from kvmesh.router.gateway import Gateway
from kvmesh.router.prewarm import PREWARM_PATH, one_token_body, prefill_role_body
from kvmesh.router.prewarm_request import MAX_DOCUMENTS
from kvmesh.router.types import RoutingRequest

CHUNK = 64
"""The test store's chunk size (``store_chunk_tokens`` in the requests)."""
DOC = list(range(5000, 5000 + 200))
"""200 tokens: 12 full blocks, 3 whole chunks (192 tokens) for the shared tier."""


class ByteTokenizer:
    """UTF-8 bytes as ids; chat rendered as "role: content" lines."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + list(text.encode())

    def apply_chat_template(self, messages: Any, *, add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
        return self.encode(text + ("assistant: " if add_generation_prompt else ""), add_special_tokens=False)


@dataclass
class SharedTierEngine(FakeEngine):
    """A test engine whose store has a shared tier: after computing a prompt it announces the
    prompt's whole chunks as SHARED blocks, at once or (``step_loop``, as vLLM does) only on the
    next request it serves."""

    step_loop: bool = False
    pending: list[BlockStored] = field(default_factory=list)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        if self.pending and self.publisher is not None:
            self.publisher.publish(self.pending)
            self.pending = []
        resp = await super()._completions(request)
        body = self.received[-1]
        prompt = body.get("prompt")
        tenant = body.get("cache_salt") or ""
        if isinstance(prompt, list) and len(prompt) >= CHUNK:
            whole = len(prompt) // CHUNK * CHUNK
            keys = BlockHasher(Namespace(MODEL, tenant=tenant), BLOCK).hash_blocks(prompt[:whole])
            event = BlockStored(
                [engine_hash(k) for k in keys], None, prompt[:whole], BLOCK, medium="SHARED",
                extra_keys=[tenant] if tenant else None,
            )  # fmt: skip
            if self.step_loop:
                self.pending.append(event)
            elif self.publisher is not None:
                self.publisher.publish([event])
        return resp


@contextlib.asynccontextmanager
async def router(engines: list[FakeEngine], *, tokenizer: Any = None, vllm_like: bool = False):
    endpoints: list[dict[str, Any]] = []
    for e in engines:
        entry: dict[str, Any] = {"url": e.url}
        if vllm_like:
            assert e.publisher is not None
            entry["eventsEndpoint"] = e.publisher.endpoint
        endpoints.append(entry)
    raw: dict[str, Any] = {
        "endpoints": endpoints,
        "policy": "precise",
        "seed": 1,
        "model": MODEL,
        "health": {"intervalS": 0.2, "timeoutS": 0.5, "failureThreshold": 2, "metricsIntervalS": 0.2},
    }
    gw = Gateway(router_config_from_dict(raw), tokenizer=tokenizer)
    client = TestClient(TestServer(gw.app))
    await client.start_server()
    try:
        await wait_healthy(gw, len(engines))
        yield gw, client
    finally:
        await client.close()
        for e in engines:
            await e.stop()


async def wait_healthy(gw: Gateway, n: int) -> None:
    deadline = time.monotonic() + 10
    while gw.pool is None or sum(s.healthy for s in gw.pool.states()) < n or gw.intake is None:
        assert time.monotonic() < deadline, "endpoints not healthy"
        await asyncio.sleep(0.05)


async def prewarm(client: TestClient, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    resp = await client.post(PREWARM_PATH, json=body, headers=headers or {})
    return resp.status, await resp.json()


def completions_received(engines: list[FakeEngine]) -> list[dict[str, Any]]:
    return [b for e in engines for b in e.received]


# ---------------------------------------------------------------- validation


BAD_BODIES: list[tuple[Any, str]] = [
    ([], "must be a JSON object"),
    ({}, "'documents' must be a non-empty list"),
    ({"documents": []}, "'documents' must be a non-empty list"),
    ({"documents": [{"prompt_token_ids": DOC}], "max_tokens": 3}, "unknown prewarm fields ['max_tokens']"),
    ({"documents": ["text"]}, "documents[0] must be an object"),
    ({"documents": [{"id": "a"}]}, "needs exactly one of"),
    ({"documents": [{"prompt": "x", "prompt_token_ids": [1]}]}, "needs exactly one of"),
    ({"documents": [{"prompt_token_ids": DOC, "stream": True}]}, "documents[0] has unknown fields ['stream']"),
    ({"documents": [{"prompt": ""}]}, "documents[0].prompt must be a non-empty string"),
    ({"documents": [{"prompt": [1, 2]}]}, "documents[0].prompt must be a non-empty string"),
    ({"documents": [{"prompt_token_ids": [1, -2]}]}, "integers in [0, 2^32)"),
    ({"documents": [{"prompt_token_ids": [True]}]}, "integers in [0, 2^32)"),
    ({"documents": [{"messages": []}]}, "documents[0].messages must be a non-empty list"),
    ({"documents": [{"messages": [{"content": "hi"}]}]}, "messages[0] must be an object with a string 'role'"),
    ({"documents": [{"id": "a", "prompt_token_ids": DOC}, {"id": "a", "prompt_token_ids": DOC}]}, "'a' appears more"),
    ({"documents": [{"id": True, "prompt_token_ids": DOC}]}, "id must be a non-empty string"),
    ({"documents": [{"prompt_token_ids": DOC}], "timeout_s": 0}, "'timeout_s' must be a number"),
    ({"documents": [{"prompt_token_ids": DOC}], "concurrency": 65}, "'concurrency' must be an integer"),
    ({"documents": [{"prompt_token_ids": DOC}], "wait_for_shared": "yes"}, "'wait_for_shared' must be a boolean"),
    ({"documents": [{"prompt_token_ids": DOC}], "kvmesh": 3600}, "'kvmesh' must be an object"),
    ({"documents": [{"prompt_token_ids": DOC, "kvmesh": []}]}, "documents[0].kvmesh must be an object"),
    ({"documents": [{"prompt_token_ids": DOC}], "cache_salt": ""}, "'cache_salt' must be a non-empty string"),
    ({"documents": [{"prompt_token_ids": DOC}], "model": 7}, "'model' must be a non-empty string"),
    ({"documents": [{"prompt_token_ids": [1]}] * (MAX_DOCUMENTS + 1)}, f"at most {MAX_DOCUMENTS} per request"),
]  # fmt: skip


async def test_malformed_prewarm_requests_get_a_400_naming_the_problem_and_compute_nothing(engines):
    es = await engines(1)
    async with router(es, tokenizer=ByteTokenizer()) as (_, client):
        for body, message in BAD_BODIES:
            status, answer = await prewarm(client, body)
            assert status == 400, (body, answer)
            assert message in answer["error"]["message"], (message, answer)
        resp = await client.post(PREWARM_PATH, data=b"{not json")
        assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]["message"]
        resp = await client.post(PREWARM_PATH, data=b"")
        assert resp.status == 400 and "empty" in (await resp.json())["error"]["message"]
        status, answer = await prewarm(
            client, {"documents": [{"prompt_token_ids": DOC}], "cache_salt": "acme"}, {"x-tenant-id": "other"}
        )
        assert status == 400 and "different tenants" in answer["error"]["message"]
        status, answer = await prewarm(
            client, {"documents": [{"prompt_token_ids": [1] * 10}, {"prompt": "ok"}]}
        )
        assert status == 200, answer
    assert len(completions_received(es)) == 2, "only the valid request computed its documents"


async def test_text_documents_need_the_routers_tokenizer(engines):
    es = await engines(1)
    async with router(es) as (_, client):
        status, answer = await prewarm(client, {"documents": [{"prompt": "some text"}]})
        assert status == 400 and "no tokenizer" in answer["error"]["message"]
        status, answer = await prewarm(
            client, {"documents": [{"messages": [{"role": "user", "content": "x"}]}]}
        )
        assert status == 400
        status, _ = await prewarm(
            client, {"documents": [{"prompt_token_ids": DOC}], "wait_for_shared": False}
        )
        assert status == 200
    assert len(es[0].received) == 1


# ---------------------------------------------------------------- one computation per document


async def test_a_document_is_computed_once_as_a_prefill_then_reported_cached(engines):
    es = await engines(2)
    async with router(es) as (gw, client):
        body = {
            "documents": [
                {"id": "manual", "prompt_token_ids": DOC, "kvmesh": {"cache_ttl_s": 3600, "x": [1]}}
            ],
            "wait_for_shared": False,
            "model": MODEL,
        }
        status, answer = await prewarm(client, body, {"x-tenant-id": "acme"})
        assert status == 200, answer
        (result,) = answer["documents"]
        assert result["id"] == "manual" and result["status"] == "prewarmed"
        assert result["tokens"] == 200 and result["blocks"] == 12
        assert (result["blocks_cached"], result["blocks_new"]) == (0, 12)
        assert result["tiers_before"] == {}
        assert result["endpoint"] in {e.url for e in es}
        assert result["engine_cached_tokens"] == 0
        assert answer["summary"]["prewarmed"] == 1 and answer["summary"]["blocks_new"] == 12
        (sent,) = completions_received(es)
        assert sent["prompt"] == DOC
        assert sent["kv_transfer_params"]["role"] == "prefill"
        assert sent["max_tokens"] == 1 and sent["stream"] is False
        assert sent["kvmesh"] == {"cache_ttl_s": 3600, "x": [1]}, "forwarded untouched"
        assert sent["cache_salt"] == "acme" and sent["model"] == MODEL
        # the tenant's usage counts the tokens computed ahead of its requests
        assert gw.cache_report.ledger.get("acme").prewarmed_tokens == 200
        # the pin keeps the document's blocks in the router's index until it expires
        keys = gw.scheduler.hasher(Namespace(MODEL, tenant="acme")).hash_blocks(DOC)
        assert len(keys) == 12 and all(gw.pinned.holds(k) for k in keys)

        # the engine's GPU blocks reach the index: the same document is now cached, nothing sent
        await until_indexed(gw, DOC, "acme")
        unpinned = {**body, "documents": [{"id": "manual", "prompt_token_ids": DOC}]}
        status, again = await prewarm(client, unpinned, {"x-tenant-id": "acme"})
        (cached,) = again["documents"]
        assert cached["status"] == "cached" and cached["endpoint"] is None
        assert (cached["blocks_cached"], cached["blocks_new"]) == (12, 0)
        assert cached["tiers_before"] == {"GPU": 12}
        assert len(completions_received(es)) == 1

        # asking for a pin again is sent although cached: the engine pins (extends) what it holds
        status, repinned = await prewarm(client, body, {"x-tenant-id": "acme"})
        assert repinned["documents"][0]["blocks_cached"] == 12
        assert len(completions_received(es)) == 2
        assert completions_received(es)[-1]["kvmesh"]["cache_ttl_s"] == 3600

        # another tenant's namespace holds nothing of it
        status, other = await prewarm(client, body, {"x-tenant-id": "globex"})
        assert other["documents"][0]["status"] == "prewarmed"
        assert other["documents"][0]["blocks_cached"] == 0
        assert len(completions_received(es)) == 3


async def until_indexed(gw: Gateway, tokens: list[int], tenant: str = "", *, shared: bool = False) -> None:
    """Wait until the router's index holds all of ``tokens``' whole blocks (events are asynchronous)."""
    probe = RoutingRequest("probe", tokens, Namespace(MODEL, tenant=tenant))
    deadline = time.monotonic() + 10
    while True:
        match = gw.scheduler.match(probe)
        held = (match.shared.num_blocks if match.shared else 0) if shared else match.longest_blocks()
        if held >= match.num_blocks:
            return
        assert time.monotonic() < deadline, f"index holds {held} of {match.num_blocks} blocks"
        await asyncio.sleep(0.05)


async def test_many_documents_run_concurrently_and_each_is_reported_in_order(engines):
    es = await engines(2)
    docs = [{"id": f"d{i}", "prompt_token_ids": [7000 + 100 * i + t for t in range(40)]} for i in range(6)]
    async with router(es) as (_, client):
        status, answer = await prewarm(
            client, {"documents": docs, "wait_for_shared": False, "concurrency": 3}
        )
        assert status == 200
        assert [r["id"] for r in answer["documents"]] == [d["id"] for d in docs]
        assert all(r["status"] == "prewarmed" and r["blocks_new"] == 2 for r in answer["documents"])
        assert answer["summary"]["documents"] == 6 and answer["summary"]["tokens"] == 240
    assert sorted(b["prompt"][0] for b in completions_received(es)) == [7000 + 100 * i for i in range(6)]


async def test_text_and_chat_documents_are_tokenized_as_requests_are(engines):
    es = await engines(1)
    text = "a document " * 20
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]
    async with router(es, tokenizer=ByteTokenizer()) as (_, client):
        status, answer = await prewarm(
            client,
            {
                "documents": [{"id": "t", "prompt": text}, {"id": "c", "messages": messages}],
                "wait_for_shared": False,
            },
        )
        assert status == 200, answer
        tok = ByteTokenizer()
        by_id = {r["id"]: r for r in answer["documents"]}
        assert by_id["t"]["tokens"] == len(tok.encode(text))
        assert by_id["c"]["tokens"] == len(tok.apply_chat_template(messages))
    bodies = sorted(es[0].received, key=lambda b: "messages" in b)
    assert bodies[0]["prompt"] == text and bodies[1]["messages"] == messages


# ---------------------------------------------------------------- the shared tier


async def test_the_prewarm_waits_until_the_shared_tier_holds_the_document_and_the_router_knows_it():
    es = [await SharedTierEngine(f"s{i}").start() for i in range(2)]
    async with router(es) as (gw, client):
        body = {"documents": [{"id": "rag", "prompt_token_ids": DOC}], "store_chunk_tokens": CHUNK}
        status, answer = await prewarm(client, body)
        assert status == 200, answer
        (result,) = answer["documents"]
        assert result["status"] == "prewarmed" and result["reached_shared"] is True
        assert result["shared_target_tokens"] == 192 and result["shared_tokens"] == 192
        assert result["tiers"]["SHARED"] == 12 and result["tiers"]["GPU"] == 12
        # every endpoint, the one that computed it or not, is credited with the shared chunks
        match = gw.scheduler.match(RoutingRequest("q", DOC + [9] * 30, Namespace(MODEL)))
        assert {pod: match.hit_tokens(pod) >= 192 for pod in (e.url for e in es)} == {e.url: True for e in es}
        # a second prewarm finds it in the shared tier and computes nothing
        status, again = await prewarm(client, body)
        assert again["documents"][0]["status"] == "cached"
        assert again["documents"][0]["tiers_before"]["SHARED"] == 12
        assert len(completions_received(es)) == 1


async def test_an_engine_that_publishes_from_its_step_loop_is_nudged_until_the_announcement_arrives():
    es = [await SharedTierEngine(f"v{i}", vllm_like=True, step_loop=True).start() for i in range(2)]
    async with router(es, vllm_like=True) as (_, client):
        body = {
            "documents": [{"id": "rag", "prompt_token_ids": DOC}],
            "store_chunk_tokens": CHUNK,
            "model": MODEL,
            "kvmesh": {"cache_ttl_s": 60},
        }
        status, answer = await prewarm(client, body)
        assert status == 200, answer
        (result,) = answer["documents"]
        assert result["status"] == "prewarmed" and result["reached_shared"] is True, result
        computed, *nudges = next(e.received for e in es if e.url == result["endpoint"])
        # not a kvmesh engine: one greedy output token, no P/D role
        assert "role" not in computed.get("kv_transfer_params", {})
        assert computed["max_tokens"] == 1 and computed["temperature"] == 0 and computed["stream"] is False
        assert computed["kvmesh"] == {"cache_ttl_s": 60}
        assert nudges and all(n["prompt"] == DOC[:1] and n["max_tokens"] == 1 for n in nudges)
        assert all(n["model"] == MODEL for n in nudges)


async def test_without_a_shared_tier_the_document_times_out_with_a_reason(engines):
    es = await engines(1)
    async with router(es) as (_, client):
        body = {"documents": [{"prompt_token_ids": DOC}], "store_chunk_tokens": CHUNK, "timeout_s": 0.3}
        status, answer = await prewarm(client, body)
        (result,) = answer["documents"]
        assert status == 200 and result["status"] == "timeout" and result["reached_shared"] is False
        assert "shared tier held 0 of 192 tokens" in result["error"]
        assert answer["summary"]["timeout"] == 1
        # shorter than one store chunk: nothing to wait for
        status, short = await prewarm(
            client, {"documents": [{"prompt_token_ids": [9] * 40}], "store_chunk_tokens": CHUNK}
        )
        assert short["documents"][0]["status"] == "prewarmed"
        assert short["documents"][0]["shared_target_tokens"] == 0


async def test_a_document_no_endpoint_can_compute_is_reported_failed(engines):
    es = await engines(1)
    async with router(es) as (gw, client):
        await es[0].stop()
        deadline = time.monotonic() + 10
        while gw.pool is not None and any(s.healthy for s in gw.pool.states()):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        status, answer = await prewarm(client, {"documents": [{"prompt_token_ids": DOC}]})
        assert status == 200
        (result,) = answer["documents"]
        assert result["status"] == "failed" and "no healthy endpoint" in result["error"]
        assert answer["summary"]["failed"] == 1


def test_a_prefill_leg_keeps_the_transfer_params_the_body_carries() -> None:
    body = {"prompt": [1, 2], "stream": True, "kv_transfer_params": {"kvmesh_cache_ttl_s": 60}}
    leg = prefill_role_body(body)
    assert leg["kv_transfer_params"] == {"kvmesh_cache_ttl_s": 60, "role": "prefill"}
    assert leg["max_tokens"] == 1 and leg["stream"] is False
    assert body["kv_transfer_params"] == {"kvmesh_cache_ttl_s": 60}, "the document's body is not changed"
    assert one_token_body({"prompt": "x", "temperature": 0.7}) == {
        "prompt": "x",
        "stream": False,
        "max_tokens": 1,
        "temperature": 0,
    }
