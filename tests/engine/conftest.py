"""Fixtures of the engine tests: in-process emulated engines and an HTTP client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from kvmesh.core.tokens import Tokenizer
from kvmesh.engine.app import EngineOptions, build_engine
from kvmesh.engine.emulated_runner import EmulatedRunner
from kvmesh.engine.server import EngineServer


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.load("tiny-random-llama")


@pytest.fixture
async def make_engine(tiny_tokenizer: Tokenizer) -> AsyncIterator[Callable[..., Any]]:
    """Start emulated engines (``tiny-h100`` preset unless told otherwise); all stop at teardown."""
    servers: list[EngineServer] = []

    async def make(preset: str = "tiny-h100", **kwargs: Any) -> EngineServer:
        opts = EngineOptions(model="tiny-random-llama", emulate=preset, **kwargs)
        runner = EmulatedRunner(
            preset,
            model_name=opts.served_model_name,
            vocab_size=tiny_tokenizer.vocab_size,
            eos_token_ids=tiny_tokenizer.eos_token_ids,
            max_model_len=opts.max_model_len,
        )
        server = await build_engine(opts, runner=runner, tokenizer=tiny_tokenizer)
        await server.start("127.0.0.1", 0)
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture
def eventually() -> Callable[..., Any]:
    """``await eventually(predicate, timeout=10.0)``: poll until it holds; returns its last value."""
    return _eventually


async def _eventually(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; returns its last value."""
    for _ in range(int(timeout / 0.005)):
        if predicate():
            return True
        await asyncio.sleep(0.005)
    return predicate()
