"""Records the scheduler consumes and produces.

``RoutingRequest`` and ``EndpointState`` go in, ``Decision`` comes out. They are plain slotted
dataclasses so the fleet simulator can build them in virtual time without any I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

import numpy as np

from kvmesh.core.hashing import Namespace
from kvmesh.core.tenancy import Role
from kvmesh.core.types import Medium, PodId
from kvmesh.router.known_prefix import KnownPrefix
from kvmesh.router.lora_state import LoraState

PromptTokens: TypeAlias = Sequence[int] | np.ndarray
"""Prompt token ids: the gateway's u32 array (converted once, when the request is parsed) or a list."""


class KVReleases(Protocol):
    """When an endpoint's running requests give their KV back (:mod:`kvmesh.router.kv_forecast`)."""

    def held_ratio(self) -> float:
        """The engine's KV fill over the sum of its running prompts (at most 1)."""
        ...

    def wait(self, short: float, rate: float) -> float | None:
        """Seconds until ``short`` tokens are free (``None``: no forecast)."""
        ...


@dataclass(slots=True)
class EndpointState:
    """One endpoint as the scheduler sees it at decision time.

    Attributes:
        pod: the endpoint's identity (its base URL), also the pod id of its KV events.
        role: which part of a request it serves.
        waiting: requests queued at the engine (``vllm:num_requests_waiting``).
        running: requests being decoded (``vllm:num_requests_running``).
        kv_cache_usage: device KV cache fill in [0, 1] (``vllm:kv_cache_usage_perc``).
        in_flight: requests the router has sent and not yet seen finish.
        healthy: passes health checks.
        pending_prefill_tokens: prompt tokens of this router's requests the endpoint still has to
            compute (sent, no first token yet), as predicted from the index when each was routed;
            weighted by position when the ledger has an attention context (``prefill_work``).
        pending_kv_tokens: whole prompts of those requests (cached tokens included): the device KV
            they take when the engine admits them.
        pending_prefills: how many of this router's requests there have no first token yet.
        seconds_per_prefill_token: the endpoint's prefill cost learned from first-token times;
            0 until enough samples, when scorers use their configured prior.
        attention_context_tokens: the context at which attention doubles a prompt token's cost,
            learned with ``seconds_per_prefill_token`` (``PrefillLedger``); 0 until learned, or
            when it is not learned, when scorers use their configured value.
        kv_bytes_per_token: KV bytes per token the engine reports (``/kvmesh/info``); 0 unknown,
            when scorers use their configured value.
        kv_capacity_tokens: device KV tokens the engine holds (``/kvmesh/info``, else vLLM's
            ``vllm:cache_config_info``); 0 unknown.
        kv_release_tokens_per_s: device KV tokens the endpoint's requests released per second
            lately, as this router saw them end (:mod:`kvmesh.router.kv_release`); 0 unknown.
        kv_releases: when the answers running there release their KV, as this router saw them
            start (:mod:`kvmesh.router.kv_forecast`); ``None``: none seen.
        session_kv_tokens: the latest prompts of the live sessions whose last turn this router
            sent there: the device KV they will ask for again (:mod:`kvmesh.router.session_contexts`).
        lora: the endpoint's LoRA adapters (``vllm:lora_requests_info``, ``/v1/models``); ``None``
            when it reports none.
    """

    pod: PodId
    role: Role = Role.BOTH
    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    in_flight: int = 0
    healthy: bool = True
    pending_prefill_tokens: int = 0
    pending_kv_tokens: int = 0
    pending_prefills: int = 0
    seconds_per_prefill_token: float = 0.0
    attention_context_tokens: float = 0.0
    kv_bytes_per_token: int = 0
    kv_capacity_tokens: int = 0
    kv_release_tokens_per_s: float = 0.0
    kv_releases: KVReleases | None = None
    session_kv_tokens: int = 0
    lora: LoraState | None = None


@dataclass(slots=True)
class PodMatch:
    """How much of a request's prefix one pod holds.

    Attributes:
        num_blocks: consecutive blocks from the start the pod holds in any tier.
        blocks_by_tier: matched blocks per best tier, for transfer-time estimates.
    """

    num_blocks: int = 0
    blocks_by_tier: dict[Medium, int] = field(default_factory=dict)


@dataclass(slots=True)
class PrefixMatch:
    """The index's answer for one request: per-pod consecutive matches.

    Attributes:
        num_blocks: full blocks in the prompt.
        block_size: tokens per block.
        pods: pods holding at least the first block; a pod's match already runs on through the
            blocks of the shared tier it could load (counted under ``Medium.SHARED``).
        shared: the prefix the fleet's shared tier holds, which every endpoint can load; ``None``
            when it holds none of it.
    """

    num_blocks: int
    block_size: int
    pods: dict[PodId, PodMatch] = field(default_factory=dict)
    shared: PodMatch | None = None

    def match_of(self, pod: PodId) -> PodMatch | None:
        """What ``pod`` can use: its own match, else the shared tier's."""
        match = self.pods.get(pod)
        return self.shared if match is None else match

    def hit_tokens(self, pod: PodId) -> int:
        """Prompt tokens ``pod`` holds as a prefix or can load from the shared tier."""
        match = self.match_of(pod)
        return 0 if match is None else match.num_blocks * self.block_size

    def longest_blocks(self) -> int:
        """The longest prefix any pod or the shared tier holds, in blocks."""
        longest = 0 if self.shared is None else self.shared.num_blocks
        for match in self.pods.values():
            longest = max(longest, match.num_blocks)
        return longest

    def longest_own_blocks(self) -> int:
        """The longest prefix any pod holds in its own tiers (not counting what it would load from
        the shared tier), in blocks."""
        longest = 0
        for match in self.pods.values():
            longest = max(longest, match.num_blocks - match.blocks_by_tier.get(Medium.SHARED, 0))
        return longest


@dataclass(slots=True)
class RoutingRequest:
    """What the scheduler knows about one request.

    Attributes:
        request_id: unique id, used for logs and history.
        tokens: prompt token ids (as the engine will see them); the gateway passes one u32 array,
            which is hashed and matched as is.
        namespace: model/LoRA/tenant the prompt's blocks live in; ``namespace.lora`` is the
            adapter the request names (empty for the base model).
        session_id: ``x-session-id`` header, for session affinity.
        prefix: per-pod cached prefix; filled by the scheduler from its index when ``None``.
        num_prompt_tokens: the whole prompt's estimated length where ``tokens`` holds only its
            leading ids (a long prompt tokenized up to its first block no cache holds,
            :mod:`kvmesh.router.first_miss`); ``None``: ``tokens`` is the whole prompt.
        known_prefix: a learnt prefix whose ids lead ``tokens`` (its block keys are computed
            once, :mod:`kvmesh.router.known_prefix`); ``None``: none known.
    """

    request_id: str
    tokens: PromptTokens
    namespace: Namespace
    session_id: str | None = None
    prefix: PrefixMatch | None = None
    num_prompt_tokens: int | None = None
    known_prefix: KnownPrefix | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt length in tokens (estimated where only the leading ids are known)."""
        return len(self.tokens) if self.num_prompt_tokens is None else self.num_prompt_tokens


@dataclass(slots=True)
class ScoreTerms:
    """The per-scorer scores behind a decision's totals, kept as the scheduler computed them.

    Attributes:
        candidates: the endpoints scored, in column order.
        names: each scorer's name in its profile.
        weights: each scorer's weight.
        columns: per scorer, one score in [0, 1] per candidate.
    """

    candidates: list[PodId]
    names: list[str]
    weights: list[float]
    columns: list[list[float]]

    def of(self, pod: PodId) -> dict[str, float]:
        """``pod``'s weighted term per scorer (the terms sum to its total score); empty when it
        was not scored."""
        try:
            i = self.candidates.index(pod)
        except ValueError:
            return {}
        div = sum(self.weights) or 1.0
        return {n: w * col[i] / div for n, w, col in zip(self.names, self.weights, self.columns, strict=True)}


@dataclass(slots=True)
class Decision:
    """Where a request goes.

    Attributes:
        endpoint: the chosen endpoint (for P/D, the decode endpoint).
        ranked: every candidate, best first, ``endpoint`` included; the gateway retries down it.
        scores: final weighted score per candidate.
        prefill: the prefill endpoint when the P/D decider splits the request, else ``None``.
        predicted_hit_tokens: prompt tokens the index says ``endpoint`` already holds.
        profile: name of the scheduling profile that chose ``endpoint``.
        terms: the deciding profile's per-scorer scores (``None`` when not kept).
    """

    endpoint: PodId
    ranked: list[PodId]
    scores: dict[PodId, float]
    prefill: PodId | None = None
    predicted_hit_tokens: int = 0
    profile: str = "default"
    terms: ScoreTerms | None = None
