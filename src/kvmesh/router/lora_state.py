"""What LoRA adapters an endpoint serves, and which of them its engine is running now.

Two sources, both scraped by the endpoint pool:

* ``vllm:lora_requests_info`` in ``GET /metrics``: a gauge whose labels carry the adapters of
  running and waiting requests (comma-separated) and ``max_lora``, the adapters one batch can hold.
  vLLM sets a new label set to the current time on every step and never drops old ones, so the
  sample with the largest value is the engine's present state.
* ``GET /v1/models``: every served adapter is listed with ``parent`` set to the base model, loaded
  or not; these are the adapters the endpoint can serve at all.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmesh.router.exposition import has_line, sample_lines

LORA_INFO_METRIC = "vllm:lora_requests_info"
_TYPE_LINE = f"# TYPE {LORA_INFO_METRIC} gauge"

_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(slots=True)
class LoraState:
    """One endpoint's adapters.

    Attributes:
        max_lora: adapters one batch can hold (vLLM's ``--max-loras``); 0 when not reported.
        running: adapters of the requests being decoded.
        waiting: adapters of the queued requests.
        servable: adapters the endpoint lists in ``/v1/models`` (loaded or loadable).
    """

    max_lora: int = 0
    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    servable: frozenset[str] = field(default_factory=frozenset)

    @property
    def active(self) -> frozenset[str]:
        """Adapters the engine holds in its batch slots now (running or waiting)."""
        return self.running | self.waiting

    def can_serve(self, adapter: str) -> bool:
        """Whether ``adapter`` is listed or already active here."""
        return adapter in self.servable or adapter in self.running or adapter in self.waiting

    def has_free_slot(self) -> bool:
        """Whether one more adapter fits in the batch without waiting for another to drain
        (always true when ``max_lora`` is unknown)."""
        return self.max_lora <= 0 or len(self.active) < self.max_lora


class EndpointLoras(Protocol):
    """Anything that carries an endpoint's adapters (the router's ``EndpointState``)."""

    @property
    def lora(self) -> LoraState | None: ...


def _adapters(value: str) -> frozenset[str]:
    return frozenset(name for name in value.split(",") if name)


def parse_lora_info(text: str) -> LoraState | None:
    """The latest ``vllm:lora_requests_info`` sample of a Prometheus exposition.

    Returns:
        The running/waiting adapters and ``max_lora`` of the newest sample (``servable`` empty); an
        empty state when the metric is declared but has no sample yet (vLLM sets it on its first
        step); ``None`` when the endpoint does not export it (LoRA off, or not vLLM).
    """
    best: tuple[float, str] | None = None
    for line in sample_lines(text, LORA_INFO_METRIC):
        end = line.rfind("}")
        rest = line[end + 1 :].split()
        if line[len(LORA_INFO_METRIC)] != "{" or end < 0 or not rest:
            continue
        try:
            stamp = float(rest[0])
        except ValueError:
            continue
        if math.isfinite(stamp) and (best is None or stamp >= best[0]):
            best = (stamp, line[len(LORA_INFO_METRIC) + 1 : end])
    if best is None:
        return LoraState() if has_line(text, _TYPE_LINE) else None
    labels = {key: value.replace('\\"', '"').replace("\\\\", "\\") for key, value in _LABEL.findall(best[1])}
    try:
        max_lora = max(int(labels.get("max_lora", "0")), 0)
    except ValueError:
        max_lora = 0
    return LoraState(
        max_lora=max_lora,
        running=_adapters(labels.get("running_lora_adapters", "")),
        waiting=_adapters(labels.get("waiting_lora_adapters", "")),
    )


def adapters_of_models(document: Any) -> frozenset[str]:
    """The adapters in an OpenAI ``/v1/models`` answer: entries whose ``parent`` names another
    model (vLLM lists base models with ``parent: null``). Malformed documents list none."""
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        return frozenset()
    return frozenset(
        entry["id"]
        for entry in data
        if isinstance(entry, dict)
        and isinstance(entry.get("id"), str)
        and isinstance(entry.get("parent"), str)
        and entry["parent"] != entry["id"]
    )


def requested_adapter(body_model: object, base_model: str, endpoints: Iterable[EndpointLoras]) -> str:
    """The adapter a request names: its ``model`` when some endpoint serves an adapter of that name
    (vLLM lists base models without a parent, so a base model never passes for an adapter); empty
    otherwise, for the base model (``base_model``, which may be empty when the router does not know
    it) and for models no endpoint lists, which the engines answer themselves."""
    if not isinstance(body_model, str) or not body_model or body_model == base_model:
        return ""
    for endpoint in endpoints:
        lora = endpoint.lora
        if lora is not None and lora.can_serve(body_model):
            return body_model
    return ""


def merged_models(lists: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One ``/v1/models`` ``data`` list from several endpoints' lists: each id once (the first
    endpoint's entry), base models and adapters alike, in order of first appearance."""
    seen: set[str] = set()
    merged: list[dict[str, Any]] = []
    for entries in lists:
        for entry in entries:
            model_id = entry.get("id")
            if isinstance(model_id, str) and model_id not in seen:
                seen.add(model_id)
                merged.append(entry)
    return merged
