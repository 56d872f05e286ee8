"""A small emulated fleet shared by the harness tests of this directory (started once per module)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from kvmesh.fleet import Fleet, FleetConfig


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def emulated_fleet(tmp_path_factory) -> AsyncIterator[Fleet]:
    config = FleetConfig(
        num_engines=2,
        model="tiny-random-llama",
        emulate="tiny-h100",
        shared="none",
        policy="precise",
        run_dir=tmp_path_factory.mktemp("fleet"),
        health_timeout_s=120,
    )
    async with Fleet(config) as fleet:
        yield fleet
