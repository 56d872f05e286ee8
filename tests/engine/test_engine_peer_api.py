"""What sglang-router and vllm-router read from a worker, answered by an emulated engine."""

from __future__ import annotations

import dataclasses
import json

import aiohttp
import pytest
import zmq
import zmq.asyncio

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    async with http.get(url) as r:
        return r.status, await r.json(content_type=None)


async def post(http: aiohttp.ClientSession, url: str, body: object) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None)


async def test_model_info_names_the_model_for_sglang_router(make_engine, http) -> None:
    eng = await make_engine()
    status, info = await get(http, f"{eng.url}/model_info")
    assert status == 200
    name = eng.config.served_model_name
    # sglang-router registers the worker under served_model_name and loads its tokenizer from
    # model_path; an engine built in-process has no directory, so both name the model
    assert info["served_model_name"] == name and info["model_path"] == name == info["tokenizer_path"]
    assert info["is_generation"] is True
    assert info["max_model_len"] == eng.max_model_len and info["block_size"] == 16
    assert (await get(http, f"{eng.url}/get_model_info"))[1] == info


async def test_model_path_is_the_directory_the_engine_loaded(make_engine, http) -> None:
    eng = await make_engine()
    eng.facts = dataclasses.replace(eng.facts, model_path="/models/tiny")
    _, info = await get(http, f"{eng.url}/model_info")
    assert info["model_path"] == "/models/tiny" == info["tokenizer_path"]
    assert info["served_model_name"] == eng.config.served_model_name


async def test_server_info_carries_kvmesh_sglang_and_vllm_fields(make_engine, http) -> None:
    eng = await make_engine(events="tcp://127.0.0.1:0", events_replay="tcp://127.0.0.1:0")
    status, text = await get(http, f"{eng.url}/server_info")
    assert status == 200
    assert {key: text[key] for key in eng.info_dict()} == eng.info_dict()
    assert text["served_model_name"] == eng.config.served_model_name and text["page_size"] == 16
    assert isinstance(text["vllm_config"], str) and "cache_config.block_size=16" in text["vllm_config"]
    _, as_json = await get(http, f"{eng.url}/server_info?config_format=json")
    config = as_json["vllm_config"]
    assert config["model_config"]["model"] == eng.config.served_model_name
    assert config["cache_config"]["block_size"] == 16
    events = config["kv_events_config"]
    assert events["enable_kv_cache_events"] is True and events["endpoint"] == eng.config.events_endpoint
    assert events["topic"] == "kv-events"


async def test_server_info_rejects_an_unknown_config_format(make_engine, http) -> None:
    eng = await make_engine()
    for path in ("/server_info", "/get_server_info"):
        status, body = await get(http, f"{eng.url}{path}?config_format=yaml")
        assert status == 400, body
        assert "config_format" in body["error"]["message"] and body["error"]["param"] == "config_format"


async def test_get_server_info_is_what_vllm_router_discovers(make_engine, http) -> None:
    eng = await make_engine()
    _, first = await get(http, f"{eng.url}/get_server_info")
    _, again = await get(http, f"{eng.url}/get_server_info")
    assert first["model_id"] == eng.config.served_model_name and first["block_size"] == 16
    # vllm-router reads block_size as an alias of kv_block_size: both at once fail its parser
    assert "kv_block_size" not in first
    assert first["instance_id"] == again["instance_id"]
    other = await make_engine()
    assert (await get(http, f"{other.url}/get_server_info"))[1]["instance_id"] != first["instance_id"]


async def test_kv_event_sources(make_engine, http) -> None:
    silent = await make_engine()
    assert await get(http, f"{silent.url}/kv_event_sources") == (200, {})
    eng = await make_engine(events="tcp://127.0.0.1:0", events_replay="tcp://127.0.0.1:0", events_topic="")
    _, sources = await get(http, f"{eng.url}/kv_event_sources")
    assert sources == {
        "0": {
            "endpoint": eng.config.events_endpoint,
            "replay_endpoint": eng.config.replay_endpoint,
            "topic": "",
            "publisher": "zmq",
            "encoding": "msgpack",
            "schema_version": 1,
            "enable_kv_cache_events": True,
            "hwm": 100_000,
        }
    }


async def test_events_carry_the_configured_topic(make_engine, http) -> None:
    eng = await make_engine(events="tcp://127.0.0.1:0", events_topic="")
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(eng.config.events_endpoint)
        for _ in range(50):  # a SUB socket misses what is published before it has joined
            status, _ = await post(http, f"{eng.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
            assert status == 200
            if await sub.poll(200):
                break
        frames = await sub.recv_multipart()
    finally:
        sub.close(0)
        ctx.term()
    assert frames[0] == b"" and len(frames) == 3


async def test_render_completion_matches_tokenize(make_engine, http) -> None:
    eng = await make_engine()
    _, tokenized = await post(http, f"{eng.url}/tokenize", {"prompt": PROMPT})
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0.5, "stop": ["."], "seed": 3}
    status, rendered = await post(http, f"{eng.url}/v1/completions/render", body)
    assert status == 200 and isinstance(rendered, list) and len(rendered) == 1
    item = rendered[0]
    assert item["token_ids"] == tokenized["tokens"] and item["request_id"].startswith("cmpl-")
    assert item["features"] is None and item["stream"] is False
    params = item["sampling_params"]
    assert (params["max_tokens"], params["temperature"], params["stop"], params["seed"]) == (5, 0.5, ["."], 3)
    status, batch = await post(http, f"{eng.url}/v1/completions/render", {"prompt": [PROMPT, [5, 6, 7]]})
    assert status == 200 and isinstance(batch, list)
    assert [b["token_ids"] for b in batch] == [tokenized["tokens"], [5, 6, 7]]
    assert batch[0]["request_id"].endswith("-0") and batch[1]["request_id"].endswith("-1")
    assert batch[0]["sampling_params"]["max_tokens"] == 16


async def test_render_chat_matches_tokenize(make_engine, http) -> None:
    eng = await make_engine()
    _, tokenized = await post(http, f"{eng.url}/tokenize", {"messages": CHAT})
    body = {"messages": CHAT, "stream": True, "stream_options": {"include_usage": True}, "cache_salt": "t1"}
    status, rendered = await post(http, f"{eng.url}/v1/chat/completions/render", body)
    assert status == 200 and isinstance(rendered, dict)
    assert rendered["token_ids"] == tokenized["tokens"] and rendered["request_id"].startswith("chatcmpl-")
    assert rendered["stream"] is True and rendered["stream_options"]["include_usage"] is True
    assert rendered["cache_salt"] == "t1"
    assert rendered["sampling_params"]["max_tokens"] == eng.max_model_len - len(tokenized["tokens"])


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions/render", b"", 400, "empty"),
        ("/v1/completions/render", b"{not json", 400, "json"),
        ("/v1/completions/render", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions/render", {"prompt": 7}, 400, "prompt must be"),
        ("/v1/completions/render", {"prompt": [1, 10**9]}, 400, "vocabulary"),
        ("/v1/completions/render", {"prompt": "hi", "model": "nope"}, 404, "does not exist"),
        ("/v1/completions/render", {"prompt": "hi", "max_tokens": 10**7}, 400, "context length"),
        ("/v1/completions/render", {"prompt": "hi", "temperature": 9}, 400, "temperature"),
        ("/v1/completions/render", {"prompt": ["a", "b"], "stream": True}, 400, "single prompt"),
        ("/v1/chat/completions/render", {"messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions/render", {"messages": []}, 400, "non-empty"),
        ("/v1/chat/completions/render", {"messages": [{"content": "x"}]}, 400, "role"),
    ],
)
async def test_render_rejects_what_generation_rejects(make_engine, http, path, body, status, needle) -> None:
    eng = await make_engine()
    got, answer = await post(http, f"{eng.url}{path}", body)
    assert got == status, answer
    assert isinstance(answer, dict)
    assert needle in answer["error"]["message"].lower(), answer
