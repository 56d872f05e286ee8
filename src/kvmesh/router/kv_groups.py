"""Which KV cache group of each pod the router indexes.

vLLM announces the same tokens once per KV cache group (hybrid models: sliding window, Mamba, full
attention, ...) and tags events with ``group_idx`` and, from 0.32, ``kv_cache_spec_kind``. Only
full-prefix kinds (full attention, MLA, sink full attention; untagged events count as full
attention) describe a reusable prefix, and one such group is enough: each pod indexes its lowest
full-attention group and skips the others (``num_skipped_groups``), removals included, so the
applier's engine-hash map never mixes groups (whose hashes are equal for equal tokens).
"""

from __future__ import annotations

import logging
from enum import Enum

from kvmesh.core.events import BlockStored
from kvmesh.core.types import PodId
from kvmesh.router.ingest_stats import IngestStats

logger = logging.getLogger(__name__)

PREFIX_KV_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
"""``kv_cache_spec_kind`` values whose blocks hold a full prefix (an untagged event counts too)."""

_HAS_SPEC_KIND = "kv_cache_spec_kind" in BlockStored.__struct_fields__
"""Whether this events module carries vLLM 0.32's ``kv_cache_spec_kind`` (else it is always unset)."""

_NO_GROUP = -1
"""The group rank of events without ``group_idx`` (lowest: an untagged publisher has one group)."""


class GroupVerdict(Enum):
    """What to do with a BlockStored, by its KV cache group."""

    INDEX = "index"
    """The pod's indexed group: apply it."""
    SKIP = "skip"
    """Another group (counted in ``num_skipped_groups``): ignore it."""
    SWITCH = "switch"
    """A lower full-attention group than the one indexed so far (events seen from mid-stream):
    drop the pod's blocks, whose removals will no longer be followed, then apply it."""


class KVGroupSelector:
    """Per pod, the one KV cache group whose events are indexed.

    Args:
        stats: where skipped events are counted.
    """

    def __init__(self, stats: IngestStats) -> None:
        self.stats = stats
        self._groups: dict[PodId, int] = {}
        """The group indexed per pod (:data:`_NO_GROUP` for untagged events); only pods that
        announced a group or kind have an entry, so untagged streams skip the group checks."""
        self._noted: set[tuple[PodId, int]] = set()
        """(pod, group) of skipped kinds already logged."""

    def group(self, pod: PodId) -> int | None:
        """The group indexed for ``pod`` (``None``: untagged events or none seen yet)."""
        group = self._groups.get(pod, _NO_GROUP)
        return None if group == _NO_GROUP else group

    def forget(self, pod: PodId, *, notes: bool = False) -> None:
        """Learn ``pod``'s group again from its next events (``notes``: and log its skips again)."""
        self._groups.pop(pod, None)
        if notes:
            self._noted = {note for note in self._noted if note[0] != pod}

    def admit_stored(self, pod: PodId, ev: BlockStored) -> GroupVerdict:
        """What to do with a BlockStored of ``pod``."""
        kind = getattr(ev, "kv_cache_spec_kind", None) if _HAS_SPEC_KIND else None
        group_idx = ev.group_idx
        if group_idx is None and kind is None and not self._groups:
            return GroupVerdict.INDEX
        group = _NO_GROUP if group_idx is None else group_idx
        if self._groups.get(pod) == group and (kind is None or kind in PREFIX_KV_KINDS):
            return GroupVerdict.INDEX  # the pod's indexed group again: the common tagged event
        if kind is not None and kind not in PREFIX_KV_KINDS:
            self.stats.num_skipped_groups += 1
            if (pod, group) not in self._noted:
                self._noted.add((pod, group))
                logger.info(
                    "pod %s: KV cache group %s (%s) is not indexed: only full-attention groups hold "
                    "reusable prefixes",
                    pod,
                    ev.group_idx,
                    kind,
                )
            return GroupVerdict.SKIP
        chosen = self._groups.get(pod)
        if chosen == group:
            return GroupVerdict.INDEX
        if chosen is None or group < chosen:
            self._groups[pod] = group
            if chosen is None:
                return GroupVerdict.INDEX
            logger.info("pod %s: indexing KV cache group %s instead of %s", pod, ev.group_idx, chosen)
            return GroupVerdict.SWITCH
        self.stats.num_skipped_groups += 1
        return GroupVerdict.SKIP

    def admit_removed(self, pod: PodId, group_idx: int | None) -> bool:
        """Whether a BlockRemoved of this group concerns the group indexed for ``pod`` (else counted)."""
        if group_idx is None and not self._groups:
            return True
        group = _NO_GROUP if group_idx is None else group_idx
        if self._groups.get(pod, group) == group:
            return True
        self.stats.num_skipped_groups += 1
        return False
