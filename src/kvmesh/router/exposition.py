"""Reading a few metrics out of a Prometheus text exposition.

The router scrapes each endpoint's ``GET /metrics`` for a handful of gauges. vLLM's page has
hundreds of lines (a histogram is ~25 of them): a pass over every line costs about 0.6 ms in
Python, finding the few wanted names with ``str.find`` about a tenth of that
(``benchmarks/router_scrape.py``), so an endpoint can be scraped often.
:func:`parse_prometheus_gauges` is the pass over every line, the reference the others equal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator


def sample_lines(text: str, name: str) -> list[str]:
    """The sample lines of metric ``name`` (``name{labels} value …`` or ``name value …``), in order.

    Lines of other metrics whose names start with ``name`` (``name_sum``, ``name_bucket``) and
    comment lines are not samples of it.
    """
    found: list[str] = []
    size = len(name)
    for start in _line_starts(text, name):
        if text[start + size : start + size + 1] in ("{", " "):
            end = text.find("\n", start)
            found.append(text[start : end if end >= 0 else len(text)].rstrip("\r"))
    return found


def has_line(text: str, line: str) -> bool:
    """Whether ``line`` is one of the exposition's lines, whole."""
    size = len(line)
    return any(
        text[start + size : start + size + 1] in ("", "\n", "\r") for start in _line_starts(text, line)
    )


def _line_starts(text: str, prefix: str) -> Iterator[int]:
    """Where each line that starts with ``prefix`` starts, found with ``str.find``."""
    if text.startswith(prefix):
        yield 0
    needle = "\n" + prefix
    at = text.find(needle)
    while at >= 0:
        yield at + 1
        at = text.find(needle, at + len(needle))


def sample_value(line: str) -> tuple[str, float] | None:
    """A sample line's metric name and value; ``None`` for a comment, a malformed line, NaN or an
    infinity."""
    if not line or line[0] == "#":
        return None
    brace = line.find("{")
    if brace >= 0:
        name = line[:brace]
        rest = line[line.rfind("}") + 1 :].split()
    else:
        name, _, tail = line.partition(" ")
        rest = tail.split()
    if not rest:
        return None
    try:
        value = float(rest[0])
    except ValueError:
        return None
    return (name, value) if math.isfinite(value) else None


def parse_prometheus_gauges(text: str) -> dict[str, float]:
    """Sum every sample of each metric name in a Prometheus text exposition.

    Only plain finite samples are read; comments, malformed lines, NaN and infinities are skipped.
    """
    totals: dict[str, float] = {}
    for line in text.splitlines():
        sample = sample_value(line)
        if sample is not None:
            totals[sample[0]] = totals.get(sample[0], 0.0) + sample[1]
    return totals


def gauge_totals(text: str, names: Iterable[str]) -> dict[str, float]:
    """:func:`parse_prometheus_gauges` restricted to ``names``, without a pass over every line:
    each name present maps to the sum of its finite samples."""
    totals: dict[str, float] = {}
    for name in names:
        for line in sample_lines(text, name):
            sample = sample_value(line)
            if sample is not None:
                totals[name] = totals.get(name, 0.0) + sample[1]
    return totals
