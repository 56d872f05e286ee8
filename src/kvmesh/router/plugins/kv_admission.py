"""What a placement costs in device KV: the wait for free KV and the recompute of what it evicts.

The prefill estimate prices compute only. On a full engine a long prompt first waits until running
requests release enough KV to hold it (and so do the prompts sent there before it), and once
computed its new blocks push other prompts' cached blocks out, which those prompts pay for again
when they come back. Both grow with the prompt, so on long-context traffic they, not the prefill
queue, decide whether moving a session beats waiting at its holder.

How fast an engine frees KV depends on its decodes (long agent outputs free it slowly, short chat
answers fast), so the wait is priced at the rate the router saw the endpoint's requests end
(:mod:`kvmesh.router.kv_release`); a fixed turnover time is the fallback until one ended there.

A new session (or one that moves) is priced for more than its first turn: it will come back with a
longer context, and so will the live sessions the endpoint already holds
(:mod:`kvmesh.router.session_contexts`). Where their contexts and the new prompt together outgrow the
endpoint's KV, each turn there from now on waits for KV or recomputes what the others evicted; the
overflow (at most the prompt) is priced as recompute, so new sessions spread over the endpoints
whose KV can hold them and a busy holder's session moves only to one that can.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.router.plugins.base import Params
from kvmesh.router.types import EndpointState, KVReleases


@dataclass(frozen=True, slots=True)
class KVAdmissionPrice:
    """Seconds a placement costs in KV, added to the TTFT estimate.

    Attributes:
        turnover_s: how long the running requests take to release the KV they hold (their
            remaining decode); a request short of ``x`` of the capacity waits ``x × turnover_s``
            (0: no wait, unless learned).
        evict_weight: the share of evicted tokens expected back; each is priced at the
            endpoint's seconds per token (0: evictions are free).
        learned_wait: a request short of ``x`` tokens of free KV waits ``x`` over the endpoint's
            learned release rate (``kv_release_tokens_per_s``) once one is known.
        session_weight: a prompt placed where its prefix is not (a new session, or one that
            moves) joins the live sessions held there (``session_kv_tokens``); the part of it
            beyond what the endpoint's KV holds besides them is priced at this many times the
            endpoint's seconds per token (0: not priced).
    """

    turnover_s: float = 0.0
    evict_weight: float = 0.0
    learned_wait: bool = False
    session_weight: float = 0.0

    @classmethod
    def from_params(cls, params: Params) -> KVAdmissionPrice:
        """``kvTurnoverSeconds``, ``evictWeight``, ``kvWaitLearned`` and ``sessionKVWeight`` of the
        TTFT scorer (0, 0, false and 0: priced as compute only)."""
        return cls(
            params.number("kvTurnoverSeconds", 0.0, minimum=0.0),
            params.number("evictWeight", 0.0, minimum=0.0),
            params.boolean("kvWaitLearned", False),
            params.number("sessionKVWeight", 0.0, minimum=0.0),
        )

    @property
    def enabled(self) -> bool:
        return (
            self.turnover_s > 0.0 or self.evict_weight > 0.0 or self.learned_wait or self.session_weight > 0.0
        )

    def seconds(
        self, endpoint: EndpointState, num_tokens: int, new_tokens: int, spt: float, *, wait: bool = True
    ) -> float:
        """The KV cost of ``num_tokens`` (``new_tokens`` not cached there) on ``endpoint``.

        Free KV is what running requests do not hold (``kv_cache_usage``, as vLLM counts it: idle
        cached blocks are free, and taking them is the eviction); the prompts this router sent
        there that have not started take theirs first (``pending_kv_tokens``). Unknown capacity
        prices nothing. ``wait=False`` leaves the learned wait out (a shared prefix's request:
        :mod:`kvmesh.router.plugins.shared_prefix_ends`).
        """
        capacity = endpoint.kv_capacity_tokens
        if capacity <= 0:
            return 0.0
        evict = self.evict_weight * new_tokens * spt
        if self.session_weight > 0.0 and 2 * new_tokens >= num_tokens:
            crowded = endpoint.session_kv_tokens + num_tokens - capacity
            evict += self.session_weight * min(max(crowded, 0), num_tokens) * spt
        if not wait and self.learned_wait:
            return evict
        free = (1.0 - endpoint.kv_cache_usage) * capacity
        releases = endpoint.kv_releases
        if self.learned_wait:
            # cached blocks that running prompts share are held already; idle ones are taken back
            ratio = 1.0 if releases is None else releases.held_ratio()
            need = new_tokens + (num_tokens - new_tokens) * ratio + endpoint.pending_kv_tokens * ratio
        else:
            need = num_tokens + endpoint.pending_kv_tokens
        short = min(need, capacity) - free
        if short <= 0.0:
            return evict
        return self._wait(endpoint, short, releases) + evict

    def _wait(self, endpoint: EndpointState, short: float, releases: KVReleases | None) -> float:
        if self.learned_wait:
            rate = endpoint.kv_release_tokens_per_s
            if releases is not None:
                wait = releases.wait(short, rate)
                if wait is not None:
                    return wait
            if rate > 0.0:
                return short / rate
        return short / endpoint.kv_capacity_tokens * self.turnover_s
