"""What a placement costs in device KV: the wait for free KV and the recompute of what it evicts.

The prefill estimate prices compute only. On a full engine a long prompt first waits until running
requests release enough KV to hold it, and once computed its new blocks push other prompts' cached
blocks out, which those prompts pay for again when they come back. Both grow with the prompt, so on
long-context traffic they, not the prefill queue, decide whether moving a session beats waiting at
its holder.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.router.plugins.base import Params
from kvmesh.router.types import EndpointState


@dataclass(frozen=True, slots=True)
class KVAdmissionPrice:
    """Seconds a placement costs in KV, added to the TTFT estimate.

    Attributes:
        turnover_s: how long the running requests take to release the KV they hold (their
            remaining decode); a request short of ``x`` of the capacity waits ``x × turnover_s``.
        evict_weight: the share of evicted tokens expected back; each is priced at the
            endpoint's seconds per token (0: evictions are free).
    """

    turnover_s: float = 0.0
    evict_weight: float = 0.0
    learned_wait: bool = False
    ahead: float = 1.0

    @classmethod
    def from_params(cls, params: Params) -> KVAdmissionPrice:
        """``kvTurnoverSeconds`` and ``evictWeight`` of the TTFT scorer (0 each: priced as compute only)."""
        return cls(
            params.number("kvTurnoverSeconds", 0.0, minimum=0.0),
            params.number("evictWeight", 0.0, minimum=0.0),
            params.boolean("kvWaitLearned", False),
        )

    @property
    def enabled(self) -> bool:
        return self.turnover_s > 0.0 or self.evict_weight > 0.0 or self.learned_wait

    def seconds(self, endpoint: EndpointState, num_tokens: int, new_tokens: int, spt: float) -> float:
        """The KV cost of ``num_tokens`` (``new_tokens`` not cached there) on ``endpoint``.

        Free KV is what running requests do not hold (``kv_cache_usage``, as vLLM counts it: idle
        cached blocks are free, and taking them is the eviction). Unknown capacity prices nothing.
        """
        capacity = endpoint.kv_capacity_tokens
        if capacity <= 0:
            return 0.0
        free = (1.0 - endpoint.kv_cache_usage) * capacity
        short = min(num_tokens + self.ahead * endpoint.pending_kv_tokens, capacity) - free
        wait = 0.0
        if short > 0.0:
            rate = endpoint.kv_release_tokens_per_s
            if self.learned_wait and rate > 0.0:
                wait = short / rate
            else:
                wait = short / capacity * self.turnover_s
        return wait + self.evict_weight * new_tokens * spt
