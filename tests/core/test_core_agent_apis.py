"""The agent APIs' text and tool fields: what each format accepts and the message a bad one gets."""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh.core.agent_apis import PromptApi, chat_input
from kvmesh.errors import RequestError

HELLO = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}


def _error(api: PromptApi, body: dict[str, Any]) -> RequestError:
    with pytest.raises(RequestError) as info:
        chat_input(api, body)
    return info.value


def test_responses_text_parts_join_and_tools_keep_their_schema() -> None:
    body = {
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
        "tools": [{"type": "function", "name": "read", "description": "reads", "parameters": SCHEMA}],
    }
    got = chat_input(PromptApi.RESPONSES, body)
    assert got.messages == [{"role": "user", "content": "ab"}]
    assert got.tools == [
        {"type": "function", "function": {"name": "read", "description": "reads", "parameters": SCHEMA}}
    ]


def test_messages_text_blocks_join_and_tools_take_input_schema() -> None:
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
        "tools": [{"name": "read", "input_schema": SCHEMA}],
    }
    got = chat_input(PromptApi.MESSAGES, body)
    assert got.messages == [{"role": "user", "content": "ab"}]
    assert got.tools == [{"type": "function", "function": {"name": "read", "parameters": SCHEMA}}]


def test_responses_rejects_a_built_in_tool_and_a_non_text_part() -> None:
    tool = _error(PromptApi.RESPONSES, {"input": "hi", "tools": [{"type": "web_search"}]})
    assert (
        str(tool) == "tools[0] must be a function tool with a string 'name' (built-in tools are not served)"
    )
    assert tool.param == "tools"
    part = _error(PromptApi.RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_image"}]}]})
    assert "parts must be {'type': 'input_text' or 'output_text', 'text': ...}" in str(part)
    assert part.param == "input"


def test_messages_rejects_a_nameless_tool_and_a_non_text_block() -> None:
    tool = _error(PromptApi.MESSAGES, {"messages": HELLO, "tools": [{"description": "x"}]})
    assert str(tool) == "tools[0] must be an object with a string 'name'"
    block = _error(PromptApi.MESSAGES, {"system": [{"type": "image"}], "messages": HELLO})
    assert str(block) == "system blocks must be {'type': 'text', 'text': ...}"
    assert block.param == "system"
    not_list = _error(PromptApi.MESSAGES, {"messages": HELLO, "tools": {"name": "read"}})
    assert str(not_list) == "'tools' must be a list"
