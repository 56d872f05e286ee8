"""inference-perf's ``shared_prefix`` workload: groups of prompts behind one system prompt each."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvmesh.errors import ConfigError
from kvmesh.workload.arrivals import request_arrivals
from kvmesh.workload.lengths import LengthDist, LengthLike
from kvmesh.workload.spec import Arrival, RequestSpec, Stage
from kvmesh.workload.synthetic import DEFAULT_TOKEN_LOW, DEFAULT_VOCAB_SIZE, synthetic_text, synthetic_tokens


@dataclass(slots=True)
class SharedPrefixWorkload:
    """inference-perf's ``shared_prefix`` workload.

    Prompt ``(g, q)`` = system prompt of group ``g`` followed by question ``q`` of that group. The
    ``num_groups * num_prompts_per_group`` prompts are built once, shuffled once, and cycled
    round-robin: request ``i`` uses prompt ``order[i % num_prompts]``.

    Args:
        stages: open-loop load; without stages, ``num_requests`` requests (default: one full cycle)
            are all due at time 0 for a closed-loop runner.
        text: also fill ``RequestSpec.messages`` (system + user) with word text of the same lengths
            in words, for real-model fleets driven through the chat API.
    """

    num_groups: int
    num_prompts_per_group: int
    system_prompt_len: LengthLike
    question_len: LengthLike
    output_len: LengthLike
    stages: list[Stage] | None = None
    arrival: Arrival = "poisson"
    num_requests: int | None = None
    seed: int = 0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    token_low: int = DEFAULT_TOKEN_LOW
    text: bool = False
    name: str = "shared_prefix"
    _system: LengthDist = field(init=False, repr=False)
    _question: LengthDist = field(init=False, repr=False)
    _output: LengthDist = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_groups <= 0 or self.num_prompts_per_group <= 0:
            raise ConfigError(
                f"num_groups and num_prompts_per_group must be > 0, got {self.num_groups}, {self.num_prompts_per_group}"
            )
        self._system = LengthDist.parse(self.system_prompt_len, "system_prompt_len")
        self._question = LengthDist.parse(self.question_len, "question_len")
        self._output = LengthDist.parse(self.output_len, "output_len")
        if self.stages is None and self.num_requests is None:
            self.num_requests = self.num_groups * self.num_prompts_per_group

    @property
    def num_prompts(self) -> int:
        return self.num_groups * self.num_prompts_per_group

    def requests(self) -> Iterator[RequestSpec]:
        rng = random.Random(self.seed)
        prompts: list[tuple[int, int, list[int], int, int, list[dict[str, str]] | None, str]] = []
        for g in range(self.num_groups):
            sys_len = self._system.sample(rng)
            system = synthetic_tokens(rng, sys_len, self.vocab_size, self.token_low)
            sys_text = synthetic_text(rng, sys_len) if self.text else ""
            for q in range(self.num_prompts_per_group):
                q_len = self._question.sample(rng)
                question = synthetic_tokens(rng, q_len, self.vocab_size, self.token_low)
                out_len = max(1, self._output.sample(rng))
                messages = None
                if self.text:
                    messages = [
                        {"role": "system", "content": sys_text},
                        {"role": "user", "content": synthetic_text(rng, q_len)},
                    ]
                prompts.append((g, q, system + question, sys_len, out_len, messages, f"g{g}"))
        rng.shuffle(prompts)

        seen_groups: set[int] = set()
        seen_prompts: set[int] = set()
        arrival_rng = random.Random(self.seed + 1)
        for i, (t, stage) in enumerate(
            request_arrivals(self.stages, self.num_requests, self.arrival, arrival_rng)
        ):
            g, q, tokens, sys_len, out_len, messages, group = prompts[i % len(prompts)]
            prompt_id = g * self.num_prompts_per_group + q
            if prompt_id in seen_prompts:
                reusable = len(tokens)
            else:
                reusable = sys_len if g in seen_groups else 0
                seen_groups.add(g)
                seen_prompts.add(prompt_id)
            yield RequestSpec(
                request_id=f"{self.name}-{i}",
                arrival_s=t,
                prompt_token_ids=tokens,
                output_len=out_len,
                group=group,
                stage=stage,
                reusable_prefix_len=reusable,
                messages=[dict(m) for m in messages] if messages is not None else None,
                prompt_id=prompt_id,
            )
