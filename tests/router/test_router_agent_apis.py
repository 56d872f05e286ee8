"""``/v1/responses`` and ``/v1/messages`` through the router to emulated kvmesh engines.

The engines run the real SmolLM2 tokenizer and chat template; the router tokenizes with the same
files. Checked: the router hashes exactly the ids the engine prefills (tools included), the
second turn of a conversation is a cache hit on both APIs, streaming passes through in each API's
own event shape, and an endpoint that does not serve an API gives a 4xx naming it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient
from front_testing import served

from kvmesh.core.agent_apis import PromptApi, chat_input
from kvmesh.core.cache_usage import CACHE_HEADER
from kvmesh.core.tokens import Tokenizer
from kvmesh.engine.app import EngineOptions, build_engine
from kvmesh.engine.server import EngineServer
from kvmesh.errors import RequestError
from kvmesh.router.config import router_config_from_dict
from kvmesh.router.gateway import Gateway
from kvmesh.router.request_parser import RequestParser
from kvmesh.router.tokenize import CachedTokenizer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("both_servers")]

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 8
WEATHER_TOOL_OPENAI = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
WEATHER_TOOL_ANTHROPIC = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load("smollm2")


@contextlib.asynccontextmanager
async def fleet(
    tokenizer: Tokenizer, **config: Any
) -> AsyncIterator[tuple[EngineServer, Gateway, TestClient]]:
    opts = EngineOptions(
        model="smollm2",
        emulate="tiny-h100",
        events="tcp://127.0.0.1:0",
        events_replay="tcp://127.0.0.1:0",
        stream_interval=0.0,
    )
    engine = await build_engine(opts)
    await engine.start("127.0.0.1", 0)
    gw = Gateway(
        router_config_from_dict(
            {
                "endpoints": [{"url": engine.url}],
                "flowControl": {"enabled": False},
                "tokenizer": "smollm2",
                **config,
            }
        ),
        tokenizer=tokenizer,
    )
    client = TestClient(served(gw))
    await client.start_server()
    try:
        yield engine, gw, client
    finally:
        await client.close()
        await engine.stop()


def cache_header(value: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in value.split(";"))


def responses_body(turns: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "smollm2", "instructions": SYSTEM, "input": turns, "max_output_tokens": 4,
            "temperature": 0, "tools": [WEATHER_TOOL_OPENAI], **extra}  # fmt: skip


def messages_body(turns: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "smollm2", "system": SYSTEM, "messages": turns, "max_tokens": 4, "temperature": 0,
            "tools": [WEATHER_TOOL_ANTHROPIC], **extra}  # fmt: skip


def test_conversion_keeps_tool_use_and_results():
    body = responses_body(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ]
    )
    converted = chat_input(PromptApi.RESPONSES, body)
    assert [m["role"] for m in converted.messages] == ["system", "user", "assistant", "tool"]
    assert converted.messages[2]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city":"Paris"}',
    }
    assert converted.messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert converted.tools[0]["function"]["parameters"] == WEATHER_TOOL_OPENAI["parameters"]

    anthropic = messages_body(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
        ]
    )  # fmt: skip
    converted = chat_input(PromptApi.MESSAGES, anthropic)
    assert [m["role"] for m in converted.messages] == ["system", "user", "assistant", "tool"]
    assert converted.messages[2]["content"] == "Checking."
    assert converted.messages[2]["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'
    assert converted.tools[0]["function"]["parameters"] == WEATHER_TOOL_ANTHROPIC["input_schema"]


def test_stateful_and_non_text_requests_are_rejected():
    with pytest.raises(RequestError, match="previous_response_id"):
        chat_input(PromptApi.RESPONSES, {"input": "hi", "previous_response_id": "resp_1"})
    with pytest.raises(RequestError, match="input_text"):
        chat_input(PromptApi.RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_image"}]}]})
    with pytest.raises(RequestError, match="image"):
        chat_input(PromptApi.MESSAGES, {"messages": [{"role": "user", "content": [{"type": "image"}]}]})


@pytest.mark.parametrize("api", [PromptApi.RESPONSES, PromptApi.MESSAGES])
async def test_router_tokens_equal_the_engines_with_tools(api: PromptApi, tokenizer: Tokenizer):
    turns = [{"role": "user", "content": "Weather in Paris?"}]
    body = responses_body(turns) if api is PromptApi.RESPONSES else messages_body(turns)
    parser = RequestParser(CachedTokenizer(tokenizer), tokenize_thread_min_chars=1 << 20)
    parsed = await parser.parse(msgspec.json.encode(body), {}, chat=True, model=None, revision=None, api=api)
    converted = chat_input(api, body)
    engine_ids = tokenizer.apply_chat_template(converted.messages, tools=converted.tools)
    assert parsed.routing.tokens.tolist() == engine_ids
    without_tools = tokenizer.apply_chat_template(converted.messages)
    if tokenizer.render_chat(converted.messages, tools=converted.tools) != tokenizer.render_chat(
        converted.messages
    ):
        assert engine_ids != without_tools
    async with fleet(tokenizer) as (_, _gw, client):
        resp = await client.post(api.path, json=body)
        answer = await resp.json()
        assert resp.status == 200, answer
        usage = answer["usage"]
        prompt = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
        assert prompt == len(engine_ids)
        assert int(cache_header(resp.headers[CACHE_HEADER])["prompt"]) == len(engine_ids)


@pytest.mark.parametrize("api", [PromptApi.RESPONSES, PromptApi.MESSAGES])
async def test_second_turn_hits_the_cache(api: PromptApi, tokenizer: Tokenizer):
    async with fleet(tokenizer) as (_, _gw, client):
        first = [{"role": "user", "content": "Name a city in France."}]
        body = responses_body(first) if api is PromptApi.RESPONSES else messages_body(first)
        resp = await client.post(api.path, json=body)
        answer = await resp.json()
        assert resp.status == 200, answer
        if api is PromptApi.RESPONSES:
            reply = answer["output"][0]["content"][0]["text"]
            second = [
                *first,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "And in Spain?"},
            ]
            cached = lambda u: u["input_tokens_details"]["cached_tokens"]  # noqa: E731
        else:
            reply = answer["content"][0]["text"]
            second = [
                *first,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "And in Spain?"},
            ]
            cached = lambda u: u["cache_read_input_tokens"]  # noqa: E731
        assert cached(answer["usage"]) == 0
        body = responses_body(second) if api is PromptApi.RESPONSES else messages_body(second)
        resp = await client.post(api.path, json=body)
        answer = await resp.json()
        assert resp.status == 200, answer
        header = cache_header(resp.headers[CACHE_HEADER])
        assert cached(answer["usage"]) >= 64
        assert int(header["cached"]) == cached(answer["usage"])


async def test_streams_pass_through_in_each_apis_events(tokenizer: Tokenizer):
    async with fleet(tokenizer) as (_, _gw, client):
        turns = [{"role": "user", "content": "Say hello."}]
        resp = await client.post("/v1/responses", json=responses_body(turns, stream=True))
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line[7:] for line in (await resp.text()).splitlines() if line.startswith("event: ")]
        assert events[:3] == ["response.created", "response.output_item.added", "response.content_part.added"]
        assert "response.output_text.delta" in events
        assert events[-1] in ("response.completed", "response.incomplete")
        assert CACHE_HEADER in resp.headers

        resp = await client.post("/v1/messages", json=messages_body(turns, stream=True))
        assert resp.status == 200
        text = await resp.text()
        events = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
        assert events[:2] == ["message_start", "content_block_start"]
        assert "content_block_delta" in events
        assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        data = [msgspec.json.decode(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
        streamed = "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta")
        assert streamed


async def test_malformed_agent_bodies_are_4xx_in_the_apis_shape(tokenizer: Tokenizer):
    async with fleet(tokenizer, maxBodyBytes=4096) as (_, _gw, client):
        resp = await client.post(
            "/v1/messages", data=b"x" * 5000, headers={"Content-Type": "application/json"}
        )
        body = await resp.json()
        assert resp.status == 413
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
        resp = await client.post("/v1/messages", json={"model": "smollm2", "messages": []})
        body = await resp.json()
        assert resp.status == 400
        assert body["type"] == "error" and "messages" in body["error"]["message"]
        resp = await client.post("/v1/responses", json={"model": "smollm2", "input": 5})
        body = await resp.json()
        assert resp.status == 400 and body["error"]["param"] == "input"


async def test_an_endpoint_without_the_api_gives_a_4xx_naming_it(engines):
    (fake,) = await engines(1)
    gw = Gateway(
        router_config_from_dict({"endpoints": [{"url": fake.url}], "flowControl": {"enabled": False}})
    )
    client = TestClient(served(gw))
    await client.start_server()
    try:
        resp = await client.post(
            "/v1/messages", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        )
        body = await resp.json()
        assert resp.status in (404, 405)
        assert body["type"] == "error" and "/v1/messages" in body["error"]["message"]
        resp = await client.post("/v1/responses", json={"model": "m", "input": "hi"})
        body = await resp.json()
        assert resp.status in (404, 405)
        assert "/v1/responses" in body["error"]["message"]
    finally:
        await client.close()
