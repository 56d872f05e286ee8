"""LMCache's multi-round QA workload: conversations whose history grows turn by turn."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvmesh.errors import ConfigError
from kvmesh.workload.lengths import LengthDist, LengthLike
from kvmesh.workload.spec import Arrival, RequestSpec
from kvmesh.workload.synthetic import DEFAULT_TOKEN_LOW, DEFAULT_VOCAB_SIZE, synthetic_text, synthetic_tokens


@dataclass(slots=True)
class MultiTurnWorkload:
    """LMCache-style multi-round QA: each turn resends the whole history plus a new user turn.

    Conversation ``c`` has a private system prompt of ``system_prompt_len`` tokens (0 for none) and
    ``num_turns`` turns. Turn ``k``'s prompt is the previous prompt, a synthetic assistant answer of
    ``output_len`` tokens standing for the previous reply, and ``tokens_per_turn`` new user tokens, so
    turn ``k``'s reusable prefix is turn ``k-1``'s whole prompt.

    Conversations start ``conversation_interval_s`` apart (Poisson when ``arrival`` is poisson), and a
    conversation's turns are due ``turn_interval_s`` apart; every request carries the conversation's
    ``session_id`` so the runner sends a turn only after the previous one finished.
    """

    num_conversations: int
    num_turns: int
    tokens_per_turn: LengthLike
    output_len: LengthLike
    system_prompt_len: LengthLike = 0
    conversation_interval_s: float = 1.0
    turn_interval_s: float = 0.0
    arrival: Arrival = "constant"
    seed: int = 0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    token_low: int = DEFAULT_TOKEN_LOW
    text: bool = False
    name: str = "multi_turn"
    _turn: LengthDist = field(init=False, repr=False)
    _output: LengthDist = field(init=False, repr=False)
    _system: LengthDist = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_conversations <= 0 or self.num_turns <= 0:
            raise ConfigError(
                f"num_conversations and num_turns must be > 0, got {self.num_conversations}, {self.num_turns}"
            )
        if self.conversation_interval_s < 0 or self.turn_interval_s < 0:
            raise ConfigError("conversation_interval_s and turn_interval_s must be >= 0")
        self._turn = LengthDist.parse(self.tokens_per_turn, "tokens_per_turn")
        self._output = LengthDist.parse(self.output_len, "output_len")
        self._system = LengthDist.parse(self.system_prompt_len, "system_prompt_len")

    def requests(self) -> Iterator[RequestSpec]:
        rng = random.Random(self.seed)
        arrival_rng = random.Random(self.seed + 1)
        specs: list[RequestSpec] = []
        start = 0.0
        for c in range(self.num_conversations):
            if c > 0:
                gap = self.conversation_interval_s
                if self.arrival == "poisson" and gap > 0:
                    gap = arrival_rng.expovariate(1.0 / gap)
                start += gap
            history = synthetic_tokens(rng, self._system.sample(rng), self.vocab_size, self.token_low)
            messages: list[dict[str, str]] = []
            if self.text and history:
                messages.append({"role": "system", "content": synthetic_text(rng, len(history))})
            reusable = 0
            for k in range(self.num_turns):
                n_user = max(1, self._turn.sample(rng))
                out_len = max(1, self._output.sample(rng))
                history = history + synthetic_tokens(rng, n_user, self.vocab_size, self.token_low)
                if self.text:
                    messages.append({"role": "user", "content": synthetic_text(rng, n_user)})
                specs.append(
                    RequestSpec(
                        request_id=f"{self.name}-c{c}-t{k}",
                        arrival_s=start + k * self.turn_interval_s,
                        prompt_token_ids=list(history),
                        output_len=out_len,
                        group=f"c{c}",
                        session_id=f"c{c}",
                        stage=k,
                        reusable_prefix_len=reusable,
                        messages=[dict(m) for m in messages] if self.text else None,
                    )
                )
                reusable = len(history)
                history = history + synthetic_tokens(rng, out_len, self.vocab_size, self.token_low)
                if self.text:
                    messages.append({"role": "assistant", "content": synthetic_text(rng, out_len)})
        specs.sort(key=lambda s: s.arrival_s)
        yield from specs
