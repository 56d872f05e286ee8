"""The engine's HTTP surface on an emulated engine: shapes, bad input, tenants, disconnects, metrics."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from kvmesh.engine.detokenizer import StopMatcher, StreamDetokenizer

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


async def post(http: aiohttp.ClientSession, url: str, body: object, **kw) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(
        url, data=data, headers={"Content-Type": "application/json", **kw.get("headers", {})}
    ) as r:
        return r.status, await r.json(content_type=None)


def assert_error(status: int, body: dict, expected: int, needle: str) -> None:
    assert status == expected, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == expected
    assert needle.lower() in err["message"].lower(), err["message"]


async def test_completion_shapes(make_engine, http) -> None:
    eng = await make_engine()
    status, body = await post(http, f"{eng.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 7})
    assert status == 200
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == eng.config.served_model_name
    [choice] = body["choices"]
    assert choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    usage = body["usage"]
    assert usage["completion_tokens"] == 7
    assert usage["total_tokens"] == usage["prompt_tokens"] + 7
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0, "kvmesh_cached_tokens_by_tier": {}}
    # Same prompt again: every full block but the one holding the last token comes from the cache.
    status, again = await post(http, f"{eng.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    n = usage["prompt_tokens"]
    cached = (n - 1) // 16 * 16
    assert again["usage"]["prompt_tokens_details"] == {
        "cached_tokens": cached,
        "kvmesh_cached_tokens_by_tier": {"GPU": cached},
    }
    # Streamed, the same figures go out in a header with the first token.
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{eng.url}/v1/completions", json=body) as r:
        header = r.headers["x-kvmesh-cached"]
        raw = (await r.read()).decode()
    assert header == f"cached={cached};prompt={n};tiers=GPU:{cached}"
    last = json.loads([line[6:] for line in raw.split("\n") if line.startswith("data: {")][-1])
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


async def test_token_ids_and_batch_prompts(make_engine, http) -> None:
    eng = await make_engine()
    status, body = await post(
        http, f"{eng.url}/v1/completions", {"prompt": [[1, 2, 3, 4], [5, 6]], "max_tokens": 3}
    )
    assert status == 200
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 6 and body["usage"]["completion_tokens"] == 6
    status, body = await post(http, f"{eng.url}/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 2})
    assert status == 200 and body["usage"]["prompt_tokens"] == 3


async def test_chat_and_streaming(make_engine, http) -> None:
    eng = await make_engine(stream_interval=0.0)
    status, body = await post(
        http,
        f"{eng.url}/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 4
    req = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(f"{eng.url}/v1/chat/completions", json=req) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_prefill_role_returns_after_one_token(make_engine, http) -> None:
    eng = await make_engine()
    status, body = await post(
        http,
        f"{eng.url}/v1/completions",
        {"prompt": PROMPT, "max_tokens": 50, "kv_transfer_params": {"role": "prefill"}},
    )
    assert status == 200
    assert body["usage"]["completion_tokens"] == 1
    assert body["kv_transfer_params"]["role"] == "prefill"


BAD_COMPLETIONS = [
    (b"{not json", 400, "invalid json"),
    (b"", 400, "empty"),
    (b'{"prompt": "\xff\xfe"}', 400, "not utf-8"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested too deeply"),
    (b"[1, 2]", 400, "invalid request"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": {"a": 1}}, 400, "prompt"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": [1, -5]}, 400, "prompt"),
    ({"prompt": [10**9]}, 400, "vocabulary"),
    ({"prompt": [[1, 2], "x", 3]}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**7}, 400, "maximum context length"),
    ({"prompt": [1] * 9000}, 400, "maximum context length"),
    ({"prompt": "hi", "temperature": 7}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "n": 3}, 400, "n=3"),
    ({"prompt": "hi", "stop": 5}, 400, "stop"),
    ({"prompt": "hi", "model": "nope"}, 404, "does not exist"),
    ({"prompt": ["a", "b"], "stream": True}, 400, "single prompt"),
    ({"prompt": "hi", "kv_transfer_params": {"role": "sideways"}}, 400, "kv_transfer_params.role"),
]


@pytest.mark.parametrize(("body", "status", "needle"), BAD_COMPLETIONS)
async def test_completions_bad_input(make_engine, http, body, status, needle) -> None:
    eng = await make_engine()
    got, resp = await post(http, f"{eng.url}/v1/completions", body)
    assert_error(got, resp, status, needle)


BAD_CHAT = [
    (b"{", 400, "invalid json"),
    ({"max_tokens": 2}, 400, "messages"),
    ({"messages": []}, 400, "non-empty"),
    ({"messages": [{"content": "x"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "parts"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404, "does not exist"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, 400, "max_tokens"),
]


@pytest.mark.parametrize(("body", "status", "needle"), BAD_CHAT)
async def test_chat_bad_input(make_engine, http, body, status, needle) -> None:
    eng = await make_engine()
    got, resp = await post(http, f"{eng.url}/v1/chat/completions", body)
    assert_error(got, resp, status, needle)


async def test_tokenize_detokenize_and_their_bad_input(make_engine, http) -> None:
    eng = await make_engine()
    status, body = await post(http, f"{eng.url}/tokenize", {"prompt": "hello"})
    assert status == 200 and body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    status, back = await post(http, f"{eng.url}/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == "hello"
    status, chat = await post(
        http, f"{eng.url}/tokenize", {"messages": [{"role": "user", "content": "hello"}]}
    )
    assert status == 200 and chat["count"] > body["count"]
    for url, bad, code, needle in [
        ("/tokenize", {}, 400, "exactly one"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "exactly one"),
        ("/tokenize", b"nope", 400, "invalid json"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "x"}, 404, "does not exist"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**8]}, 400, "vocabulary"),
    ]:
        got, resp = await post(http, f"{eng.url}{url}", bad)
        assert_error(got, resp, code, needle)


async def test_get_routes_and_wrong_methods(make_engine, http) -> None:
    eng = await make_engine()
    async with http.get(f"{eng.url}/v1/models") as r:
        models = await r.json()
    assert models["data"][0]["id"] == eng.config.served_model_name
    async with http.get(f"{eng.url}/health") as r:
        assert r.status == 200
    async with http.get(f"{eng.url}/kvmesh/info") as r:
        info = await r.json()
    for key in ("model", "block_size", "hash_algo", "events_endpoint", "replay_endpoint", "role",
                "kv_bytes_per_token", "max_model_len"):  # fmt: skip
        assert key in info
    assert info["block_size"] == 16 and info["role"] == "both"
    async with http.get(f"{eng.url}/model_info") as r:
        assert (await r.json())["max_model_len"] == info["max_model_len"]
    for method, path, code in [
        ("GET", "/v1/completions", 405),
        ("POST", "/v1/models", 405),
        ("POST", "/metrics", 405),
        ("GET", "/nowhere", 404),
    ]:
        async with http.request(method, f"{eng.url}{path}") as r:
            body = await r.json(content_type=None)
            assert r.status == code and body["error"]["code"] == code


async def test_metrics_use_vllm_names_and_count_hits(make_engine, http) -> None:
    eng = await make_engine()
    for _ in range(2):
        await post(http, f"{eng.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    async with http.get(f"{eng.url}/metrics") as r:
        text = await r.text()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)

    def value(prefix: str) -> float:
        return sum(v for k, v in samples.items() if k.startswith(prefix))

    for name in ("vllm:num_requests_waiting{", "vllm:num_requests_running{", "vllm:kv_cache_usage_perc{",
                 "vllm:time_to_first_token_seconds_count{", "vllm:e2e_request_latency_seconds_count{"):  # fmt: skip
        assert any(k.startswith(name) for k in samples), name
    hits = value("vllm:prefix_cache_hits_total{")
    assert hits > 0 and value("vllm:prefix_cache_queries_total{") > hits
    assert (
        samples[f'kvmesh:cached_tokens_total{{model_name="{eng.config.served_model_name}",tier="GPU"}}']
        == hits
    )
    assert value("vllm:time_to_first_token_seconds_count{") == 2
    # two tokens per request: one gap each
    assert value("vllm:inter_token_latency_seconds_count{") == 2
    assert value("vllm:inter_token_latency_seconds_sum{") > 0


async def test_tenants_do_not_share_cache(make_engine, http) -> None:
    eng = await make_engine()
    url = f"{eng.url}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 1}

    async def cached(**kw) -> int:
        status, resp = await post(http, url, {**body, **kw.pop("extra", {})}, **kw)
        assert status == 200
        return resp["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await cached(headers={"x-tenant-id": "acme"}) == 0
    assert await cached(headers={"x-tenant-id": "acme"}) > 0
    assert await cached(headers={"x-tenant-id": "globex"}) == 0
    assert await cached() == 0
    assert await cached(extra={"cache_salt": "acme"}) > 0
    assert await cached(headers={"x-tenant-id": "acme"}, extra={"cache_salt": "acme"}) > 0
    # the router's rule: a header and a cache_salt naming different tenants is the client's error
    status, resp = await post(http, url, {**body, "cache_salt": "globex"}, headers={"x-tenant-id": "acme"})
    assert status == 400
    assert resp["error"]["param"] == "cache_salt"


async def test_disconnecting_stream_frees_its_slot(make_engine, http, eventually) -> None:
    eng = await make_engine(max_num_seqs=1, stream_interval=0.0)
    core = eng.core
    body = {"prompt": PROMPT, "max_tokens": 7000, "stream": True, "ignore_eos": True}
    resp = await http.post(f"{eng.url}/v1/completions", json=body)
    assert resp.status == 200
    await resp.content.readline()
    assert core.num_running == 1 and core.cache.num_used_blocks > 0
    resp.close()  # drop the connection mid-stream
    assert await eventually(lambda: core.num_running == 0)
    assert core.num_running == 0 and core.cache.num_used_blocks == 0
    assert core.stats.num_aborted == 1
    # The single slot serves the next request.
    status, done = await post(http, f"{eng.url}/v1/completions", {"prompt": "again", "max_tokens": 2})
    assert status == 200 and done["usage"]["completion_tokens"] == 2


async def test_disconnect_while_queued_leaves_the_queue(make_engine, http, eventually) -> None:
    eng = await make_engine(max_num_seqs=1)
    core = eng.core
    hog = asyncio.create_task(
        post(http, f"{eng.url}/v1/completions", {"prompt": "x", "max_tokens": 600, "ignore_eos": True})
    )
    assert await eventually(lambda: core.num_running == 1)
    async with aiohttp.ClientSession() as other:
        waiting = asyncio.create_task(
            other.post(f"{eng.url}/v1/completions", json={"prompt": "y", "max_tokens": 5})
        )
        assert await eventually(lambda: core.num_waiting == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    assert await eventually(lambda: core.num_waiting == 0)
    assert core.num_waiting == 0 and core.stats.num_aborted == 1
    status, body = await hog
    assert status == 200 and body["usage"]["completion_tokens"] == 600


def test_stop_matcher_holds_back_partial_matches() -> None:
    m = StopMatcher(["END"])
    assert m.feed("abcE") == "ab"
    assert m.feed("N") == "c"
    assert m.feed("Dxyz") == ""
    assert m.stopped and m.feed("more") == ""
    plain = StopMatcher([])
    assert plain.feed("abc") == "abc"
    tail = StopMatcher(["zz"])
    assert tail.feed("az") == "a" and tail.feed("", final=True) == "z"


def test_stream_detokenizer_joins_to_full_decode(tiny_tokenizer) -> None:
    text = "héllo wörld ✓ done"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    detok = StreamDetokenizer(tiny_tokenizer)
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tiny_tokenizer.decode(ids)
    assert "" in pieces  # multi-byte characters were held back until complete


async def test_reset_prefix_cache(make_engine, http) -> None:
    eng = await make_engine()
    await post(http, f"{eng.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert eng.core.cache.num_cached_blocks > 0
    status, body = await post(http, f"{eng.url}/reset_prefix_cache", {})
    assert status == 200 and body == {"reset": True, "store_chunks_removed": 0}
    assert eng.core.cache.num_cached_blocks == 0
    async with http.get(f"{eng.url}/reset_prefix_cache") as r:
        assert r.status == 405
    async with http.post(f"{eng.url}/kvmesh/info") as r:
        assert r.status == 405


async def test_reset_prefix_cache_empties_the_engines_own_store_tiers_not_the_shared_one(
    make_engine, http, tmp_path
) -> None:
    """A reset starts the engine cold: its RAM tier is emptied too (else the next benchmark run
    hits what the last one left); the shared directory is the fleet's and keeps its chunks."""
    prompt = [(i * 7) % 200 + 3 for i in range(600)]
    body = {"prompt": prompt, "max_tokens": 1}
    private = await make_engine(store="memory")
    shared = await make_engine(store=f"file://{tmp_path / 'shared'}")
    for eng in (private, shared):
        status, _ = await post(http, f"{eng.url}/v1/completions", body)
        assert status == 200
        await eng.core.wait_store_writes()
        status, reply = await post(http, f"{eng.url}/reset_prefix_cache", {})
        assert status == 200 and reply["reset"] is True and reply["store_chunks_removed"] == 2
    _, again = await post(http, f"{private.url}/v1/completions", body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _, again = await post(http, f"{shared.url}/v1/completions", body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
    assert shared.core.stats.cached_tokens_by_tier == {"SHARED": 512}


async def test_reset_prefix_cache_waits_for_a_write_still_on_its_way(make_engine, http) -> None:
    """A prompt's write still being copied or encoded when the reset comes would land after it."""
    prompt = [(i * 7) % 200 + 3 for i in range(600)]
    eng = await make_engine(store="memory")
    store = eng.core.store_sync.store
    real_store = store.store

    async def slow_store(*args, **kwargs):
        await asyncio.sleep(0.3)
        await real_store(*args, **kwargs)

    store.store = slow_store
    status, _ = await post(http, f"{eng.url}/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert status == 200
    status, reply = await post(http, f"{eng.url}/reset_prefix_cache", {})
    assert status == 200 and reply["store_chunks_removed"] == 2
    _, again = await post(http, f"{eng.url}/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
