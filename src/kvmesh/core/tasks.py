"""Stopping background asyncio tasks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any] | None]) -> None:
    """Cancel every task of ``tasks`` (``None`` entries skipped), then wait until each has ended.

    A task's own ``CancelledError`` is swallowed; the caller's cancellation still propagates.
    """
    pending = [task for task in tasks if task is not None]
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task
