"""The base of the router's collectors that read their figures only when scraped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from prometheus_client.core import Metric

S = TypeVar("S")


class ScrapeCollector(Generic[S]):
    """A Prometheus collector whose ``collect`` reads ``source()`` at scrape time.

    ``describe`` answers no families, so registering one reads nothing, even on a registry that
    describes a collector by collecting it (``auto_describe``): what ``source`` reads may not exist
    yet.

    Args:
        source: returns what the subclass's ``collect`` exports.
    """

    def __init__(self, source: Callable[[], S]) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []
