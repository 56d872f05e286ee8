"""vLLM's classes the connector builds on, resolved once: vLLM's own when it is installed.

Without vLLM (kvmesh's own environment), the connector must still import and run for anything
that makes vLLM's calls, so each base resolves to the least that stands for it:

- ``ConnectorBase``: the part of ``KVConnectorBase_V1``'s contract the connector relies on (it
  keeps the config and role, and binds the step's metadata), nothing more;
- ``MetadataBase`` and ``EventsBase``: plain bases (vLLM's are empty or abstract containers);
- ``BlockStoredEvent``: :class:`kvmesh.core.events.BlockStored`, which encodes to vLLM's wire form.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "HAS_VLLM",
    "BlockStoredEvent",
    "ConnectorBase",
    "EventsBase",
    "MetadataBase",
    "SharedTierEvents",
    "cache_hit_source",
    "external_block_hash",
    "kv_group_tags",
    "tensor_parallel_rank",
]

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1 as ConnectorBase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata as MetadataBase,
    )

    HAS_VLLM = True
except ImportError:
    HAS_VLLM = False

    class MetadataBase:  # type: ignore[no-redef]
        """vLLM's metadata base is an empty marker class."""

    class ConnectorBase:  # type: ignore[no-redef]
        """What the connector uses of vLLM's connector base: config, role and metadata binding."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._connector_metadata: Any = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self) -> Any:
            return self._role

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def get_block_ids_with_load_errors(self) -> set[int]:
            return set()


try:
    from vllm.distributed.kv_events import BlockStored as BlockStoredEvent
    from vllm.distributed.kv_events import KVConnectorKVEvents as EventsBase
except ImportError:  # no vLLM, or one whose connectors cannot publish KV events
    from kvmesh.core.events import BlockStored as BlockStoredEvent

    class EventsBase:  # type: ignore[no-redef]
        """vLLM's container of connector KV events is an abstract base."""


class SharedTierEvents(EventsBase):
    """SHARED events one worker hands vLLM after a step (vLLM's container for connector events).

    Only tensor-parallel rank 0 announces (the scheduler's lookup checks rank 0's chunks too), so
    when vLLM merges the workers' containers there is nothing to reduce.
    """

    def __init__(self, events: list[Any] | None = None) -> None:
        self._events = list(events or [])
        self._num_workers = 1

    def add_events(self, events: list[Any]) -> None:
        self._events.extend(events)

    def aggregate(self) -> SharedTierEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._events.clear()


def external_block_hash() -> Any:
    """vLLM's conversion of its block hashes to the ones its events carry (as is without vLLM)."""
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    except ImportError:
        return lambda block_hash: block_hash
    return maybe_convert_block_hash


def kv_group_tags(kv_cache_config: Any) -> tuple[int | None, str | None, int | None]:
    """``(group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window)`` as vLLM's own events for
    the (only) KV cache group carry them; all ``None`` when vLLM passed no KV cache config."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return None, None, None
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
    except ImportError:  # a vLLM whose events carry no cache kind
        return 0, None, None
    spec = groups[0].kv_cache_spec
    return 0, str(get_kv_cache_spec_kind(spec).value), get_kv_cache_spec_sliding_window(spec)


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 without vLLM)."""
    if not HAS_VLLM:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def cache_hit_source(name: str) -> Any:
    """vLLM's ``CacheHitSource`` member named ``name``; ``None`` without vLLM or in a vLLM without
    per-source hit metrics."""
    if not HAS_VLLM:
        return None
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return CacheHitSource(name)
