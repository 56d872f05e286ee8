"""Request builders shared by the simulator tests."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvmesh.workload import RequestSpec


@dataclass
class ListWorkload:
    """A fixed list of requests (already in arrival order)."""

    specs: list[RequestSpec]
    name: str = "list"
    stages: list = field(default_factory=list)

    def requests(self) -> Iterator[RequestSpec]:
        for s in self.specs:
            yield RequestSpec(
                s.request_id,
                s.arrival_s,
                list(s.prompt_token_ids),
                s.output_len,
                group=s.group,
                session_id=s.session_id,
                stage=s.stage,
                reusable_prefix_len=s.reusable_prefix_len,
            )


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(n)]


def spec(i: int, t: float, toks: list[int], out: int, **kw) -> RequestSpec:
    return RequestSpec(f"r{i}", t, list(toks), out, **kw)
