"""Whether a request's cached prefix is one many requests share, or its own session's history.

Chasing free KV means different things for the two. A coding agent's next turn whose holder is full
moves its history once: the old copy goes idle and is evicted in time. A chat on a hot system
prompt whose holder is full makes a second replica of that prompt: both stay hot, each holds it, and
the fleet's KV holds fewer prefixes from then on (on llm-d's KV-short shape pricing the wait for
such requests doubled the p90). So the wait for free KV is priced only for private prefixes.

A prefix is told apart by where the fleet's longest cached match of it ends: a session's turn ends
its match where its previous turn ended (a place no other request's match ends), while the requests
of a shared prompt all end theirs at its last cached block. :class:`SharedPrefixEnds` remembers the
last ``capacity`` match ends (the match's length and the block before it, tokens as they are) and
says whether a request's end was seen before.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvmesh.router.types import RoutingRequest

DEFAULT_CAPACITY = 8192


class SharedPrefixEnds:
    """The match ends of recent requests (see the module docstring).

    Raises:
        ValueError: ``capacity`` not positive.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._ends: OrderedDict[object, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ends)

    def shared(self, request: RoutingRequest) -> bool:
        """Whether ``request``'s longest cached match ends where an earlier request's did (and
        remember that it ends there). A request nothing holds is not shared."""
        prefix = request.prefix
        if prefix is None:
            return False
        blocks = prefix.longest_blocks()
        if blocks == 0:
            return False
        end = blocks * prefix.block_size
        tokens = request.tokens
        if len(tokens) < end:
            return False
        start = end - prefix.block_size
        last = tokens[start:end]
        key = (
            request.namespace,
            end,
            last.tobytes() if isinstance(last, np.ndarray) else tuple(last),
        )
        ends = self._ends
        if key in ends:
            ends.move_to_end(key)
            return True
        ends[key] = None
        if len(ends) > self.capacity:
            ends.popitem(last=False)
        return False
