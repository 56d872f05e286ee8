"""The tier a KV event speaks of, from its ``medium`` and ``locality`` strings."""

from __future__ import annotations

from kvmesh.core.events import BlockRemoved, BlockStored
from kvmesh.core.types import Medium

_KNOWN_MEDIA: dict[str | None, Medium] = {None: Medium.GPU, "GPU": Medium.GPU}
"""Wire ``medium`` strings already parsed (``Medium.parse`` walks the enum: ~1 µs an event)."""
_MAX_KNOWN_MEDIA = 64


def event_medium(ev: BlockStored | BlockRemoved) -> Medium:
    """The tier an event speaks of: a remote tier behind vLLM's native offloading (locality
    ``REMOTE``, such as kvmesh's secondary tier) is reachable from every pod, so it counts as SHARED."""
    if ev.locality is not None and ev.locality.upper() == "REMOTE":
        return Medium.SHARED
    medium = _KNOWN_MEDIA.get(ev.medium)
    if medium is None:
        medium = Medium.parse(ev.medium)
        if len(_KNOWN_MEDIA) < _MAX_KNOWN_MEDIA:  # a publisher's odd strings cannot grow it
            _KNOWN_MEDIA[ev.medium] = medium
    return medium
