"""Coding-agent sessions: tens to hundreds of turns, each resending the whole growing context.

A session of agent kind ``k`` is one context, held as a chain of hash ids of ``block_tokens``-token
blocks (as in a Mooncake trace, see :mod:`kvmesh.workload.trace_blocks`), never as token lists::

    turn t      | system + tools of kind k | task | out tool | out tool |...  h (partial) |
    turn t+1    | same                     | same ...                     h (fuller) | new |
    compacted   | system + tools of kind k | summary (new ids) |
    truncated   | system + tools of kind k | newest whole blocks of the history ... |

Appending fills the last block with more of block ``h``'s tokens (a block's tokens depend only on
``(seed, h)``, so a prompt cut inside ``h`` is a prefix of a later one holding more of ``h``), then
takes fresh ids. The system prefix of a kind is whole blocks with ids shared by every session of
that kind; a session's own blocks have ids no other session uses.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from kvmesh.errors import ConfigError
from kvmesh.workload.block_replay import block_source, with_token_ids
from kvmesh.workload.spec import Arrival, RequestSpec
from kvmesh.workload.synthetic import DEFAULT_TOKEN_LOW, DEFAULT_VOCAB_SIZE, check_token_range
from kvmesh.workload.trace_blocks import DEFAULT_CAPACITY_BLOCKS, BlockTokens, PromptBlocks

DrawLike: TypeAlias = int | float | Mapping[str, Any]
"""A number drawn per use: fixed (a number), normal (``{mean, std_dev, min, max}``) or log-normal
(``{median, sigma, min, max}``, ``sigma`` of the logarithm), clipped to ``[min, max]``."""

OnCap = Literal["compact", "truncate"]

_KIND_SHIFT = 24
"""The system blocks of agent kind ``k`` are ids ``k << 24 | j``."""
_SESSION_SHIFT = 48
"""Session ``s`` names its own blocks ``(s + 1) << 48 | n`` (below that: the kinds' system blocks)."""
_MAX_KINDS = 1 << (_SESSION_SHIFT - _KIND_SHIFT)


@dataclass(frozen=True, slots=True)
class _Draw:
    """A parsed :data:`DrawLike`: ``center`` is the value, the mean (normal) or the median (log-normal)."""

    center: float
    spread: float = 0.0
    lognormal: bool = False
    lo: float = 0.0
    hi: float = math.inf

    def sample(self, rng: random.Random) -> float:
        """One draw (a fixed value draws nothing from ``rng``)."""
        if self.spread == 0.0:
            x = self.center
        elif self.lognormal:
            x = rng.lognormvariate(math.log(self.center), self.spread)
        else:
            x = rng.gauss(self.center, self.spread)
        return min(self.hi, max(self.lo, x))

    def tokens(self, rng: random.Random) -> int:
        """One draw rounded to a token count."""
        return round(self.sample(rng))


def _parse_draw(value: DrawLike, what: str) -> _Draw:
    form = "a number, {mean, std_dev, min, max} (normal) or {median, sigma, min, max} (log-normal)"
    if isinstance(value, bool) or not isinstance(value, int | float | Mapping):
        raise ConfigError(f"{what}: expected {form}, got {value!r}")
    if not isinstance(value, Mapping):
        if value < 0:
            raise ConfigError(f"{what} must be >= 0, got {value}")
        return _Draw(float(value), lo=float(value), hi=float(value))
    lognormal = "median" in value
    keys = {"median", "sigma", "min", "max"} if lognormal else {"mean", "std_dev", "min", "max"}
    center_key, spread_key = ("median", "sigma") if lognormal else ("mean", "std_dev")
    if center_key not in value or not set(value) <= keys:
        raise ConfigError(f"{what}: expected {form}, got keys {sorted(value)}")
    try:
        center = float(value[center_key])
        spread = float(value.get(spread_key, 0.0))
        lo = float(value.get("min", 0.0))
        hi = float(value.get("max", math.inf))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what}: {form} takes numbers, got {dict(value)}") from exc
    if spread < 0 or lo < 0 or hi < lo or center < 0 or (lognormal and center <= 0):
        raise ConfigError(
            f"{what}: need {center_key} {'> 0' if lognormal else '>= 0'}, {spread_key} >= 0 and "
            f"0 <= min <= max, got {dict(value)}"
        )
    return _Draw(center, spread, lognormal, lo, hi)


@dataclass(slots=True)
class _Context:
    """A session's context: the first ``num_tokens`` tokens of the blocks ``hash_ids``."""

    hash_ids: list[int]
    num_tokens: int
    next_id: int
    block_tokens: int

    def extend(self, n: int) -> None:
        """Append ``n`` tokens: the rest of the last block, then blocks with fresh ids."""
        self.num_tokens += n
        need = -(-self.num_tokens // self.block_tokens)
        while len(self.hash_ids) < need:
            self.hash_ids.append(self.next_id)
            self.next_id += 1

    def restart(self, system: tuple[int, ...]) -> None:
        """Drop everything after the system blocks."""
        self.hash_ids = list(system)
        self.num_tokens = len(system) * self.block_tokens

    def drop_after(self, system: tuple[int, ...], num_blocks: int) -> None:
        """Drop the ``num_blocks`` oldest whole blocks after the system blocks."""
        n = len(system)
        del self.hash_ids[n : n + num_blocks]
        self.num_tokens -= num_blocks * self.block_tokens


@dataclass(slots=True)
class AgenticWorkload:
    """Coding-agent sessions: each turn resends the whole context, grown by the model's output and a
    tool result, after the tool ran.

    Sessions start as a Poisson process (``arrival: constant`` spaces them evenly), ``session_interval_s``
    apart on average (or ``session_rate`` per second). A session picks one of ``num_agent_kinds`` agent
    kinds; its first prompt is that kind's system prompt and tool definitions (``system_prompt_len``,
    drawn once per kind and rounded up to whole blocks, shared by every session of the kind) and a
    task of ``task_len`` tokens. It runs ``num_turns`` turns. After turn ``t`` the context grows by
    turn ``t``'s output (``output_len``, also the request's ``output_len``) and a tool result
    (``tool_result_len``), and turn ``t+1`` is sent ``think_time_s`` (the tool's run time) after turn
    ``t`` finished, through :attr:`RequestSpec.gap_after_previous_s`; its ``arrival_s`` is the
    session's start plus the think times before it, a lower bound that only orders the stream.

    A context that would pass ``max_context_tokens`` is cut, per ``on_cap``:

    - ``compact``: system prompt and tools plus a fresh summary of ``summary_len`` tokens (as coding
      agents' automatic compaction does); the next prompt shares only the system prefix with earlier
      ones.
    - ``truncate``: the oldest whole blocks after the system prefix are dropped until the context is
      at most ``truncate_to`` × ``max_context_tokens`` (a tool result longer than that is cut); the
      prompt is a miss from the cut on.

    Each length and time takes :data:`DrawLike`: a number, ``{mean, std_dev, min, max}`` or
    ``{median, sigma, min, max}`` (log-normal). The defaults model coding agents as published:

    - turns: median 40, 10–300. vLLM's Codex/SWE-bench Pro traces (blog "Serving Agentic Workloads
      at Scale with vLLM x Mooncake", 2026) report a median of 33 turns per trace; SWE-agent
      trajectories on SWE-bench Pro run a median 53–78 steps (nilenso's trajectory analysis);
      TraceLab's Claude Code and Codex sessions average about 80 LLM steps (350,000 over 4,300).
    - growth per turn: about 2,300 tokens on average (output mean about 410, tool result median 700
      with a heavy tail, mean about 1,900, up to 32k for a file read or a test log). The vLLM traces
      add "a few hundred to a few thousand" tokens per turn and reach about 80k tokens by turn 30,
      longest beyond 180k; TraceLab reports long contexts, short outputs and heavy-tailed tool calls.
    - the share of a prompt seen before in its session is then about 95% (vLLM's traces: 94.2% cache
      hit rate; SemiAnalysis's Claude Code traces: 96.8% theoretical hit rate, 85.8% in a later set
      with compaction and resets).
    - 128k-token cap with compaction, summary about 4,000 tokens; system prompt and tools 10,240
      tokens; task median 1,500; think time median 1 s (mean about 2.3 s, up to 5 minutes). These are
      chosen, not measured.

    Args:
        num_sessions: sessions in the stream.
        session_interval_s: mean seconds between session starts (default 5 s); give it or
            ``session_rate``, not both.
        block_tokens: tokens per block of the prompts' hash-id chains.
        cached_blocks: token blocks kept between requests (see :class:`BlockTokens`); memory, not
            results, depends on it.
    """

    num_sessions: int = 64
    session_interval_s: float | None = None
    session_rate: float | None = None
    arrival: Arrival = "poisson"
    num_agent_kinds: int = 1
    system_prompt_len: DrawLike = 10_240
    task_len: DrawLike = field(
        default_factory=lambda: {"median": 1500, "sigma": 0.8, "min": 100, "max": 16_000}
    )
    num_turns: DrawLike = field(default_factory=lambda: {"median": 40, "sigma": 0.7, "min": 10, "max": 300})
    output_len: DrawLike = field(default_factory=lambda: {"median": 250, "sigma": 1.0, "min": 8, "max": 8192})
    tool_result_len: DrawLike = field(
        default_factory=lambda: {"median": 700, "sigma": 1.4, "min": 10, "max": 32_768}
    )
    think_time_s: DrawLike = field(
        default_factory=lambda: {"median": 1.0, "sigma": 1.3, "min": 0.05, "max": 300.0}
    )
    max_context_tokens: int = 131_072
    on_cap: OnCap = "compact"
    summary_len: DrawLike = field(
        default_factory=lambda: {"mean": 4000, "std_dev": 1500, "min": 1000, "max": 12_000}
    )
    truncate_to: float = 0.5
    block_tokens: int = 512
    seed: int = 0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    token_low: int = DEFAULT_TOKEN_LOW
    name: str = "agentic"
    cached_blocks: int = DEFAULT_CAPACITY_BLOCKS
    _draws: dict[str, _Draw] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_sessions <= 0:
            raise ConfigError(f"num_sessions must be > 0, got {self.num_sessions}")
        if self.session_interval_s is not None and self.session_rate is not None:
            raise ConfigError(
                f"give session_interval_s ({self.session_interval_s}) or session_rate "
                f"({self.session_rate}), not both"
            )
        if (self.session_interval_s is not None and self.session_interval_s < 0) or (
            self.session_rate is not None and self.session_rate <= 0
        ):
            raise ConfigError(
                f"need session_interval_s >= 0 and session_rate > 0, got {self.session_interval_s}, "
                f"{self.session_rate}"
            )
        if self.arrival not in ("poisson", "constant"):
            raise ConfigError(f"arrival must be 'poisson' or 'constant', got {self.arrival!r}")
        if not 1 <= self.num_agent_kinds <= _MAX_KINDS:
            raise ConfigError(f"num_agent_kinds must be in [1, {_MAX_KINDS}], got {self.num_agent_kinds}")
        if self.on_cap not in ("compact", "truncate"):
            raise ConfigError(f"on_cap must be 'compact' or 'truncate', got {self.on_cap!r}")
        if not 0 < self.truncate_to <= 1:
            raise ConfigError(f"truncate_to must be in (0, 1], got {self.truncate_to}")
        if self.block_tokens <= 0 or self.cached_blocks <= 0:
            raise ConfigError(
                f"block_tokens and cached_blocks must be > 0, got {self.block_tokens}, {self.cached_blocks}"
            )
        check_token_range(self.vocab_size, self.token_low)
        self._draws = {
            what: _parse_draw(getattr(self, what), what)
            for what in (
                "system_prompt_len",
                "task_len",
                "num_turns",
                "output_len",
                "tool_result_len",
                "think_time_s",
                "summary_len",
            )
        }
        system = self._draws["system_prompt_len"].hi
        room = self.max_context_tokens * (self.truncate_to if self.on_cap == "truncate" else 1.0)
        if math.isinf(system) or -(-int(system) // self.block_tokens) * self.block_tokens >= room:
            raise ConfigError(
                f"system_prompt_len (at most {system:g} tokens, rounded up to blocks of {self.block_tokens}) "
                f"must leave room under max_context_tokens={self.max_context_tokens}"
                + (f" × truncate_to={self.truncate_to}" if self.on_cap == "truncate" else "")
            )

    @property
    def mean_session_interval_s(self) -> float:
        """Mean seconds between session starts."""
        if self.session_rate is not None:
            return 1.0 / self.session_rate
        return 5.0 if self.session_interval_s is None else self.session_interval_s

    def requests(self) -> Iterator[RequestSpec]:
        return with_token_ids(self.block_requests())

    def block_requests(self) -> Iterator[RequestSpec]:
        source = block_source(self)
        kinds_rng = random.Random(f"{self.seed}:agent-kinds")
        systems = [
            tuple(
                k << _KIND_SHIFT | j
                for j in range(-(-self._draws["system_prompt_len"].tokens(kinds_rng) // self.block_tokens))
            )
            for k in range(self.num_agent_kinds)
        ]
        arrival_rng = random.Random(f"{self.seed}:session-starts")
        interval = self.mean_session_interval_s
        sessions: list[Iterator[RequestSpec]] = []
        kind_of: dict[str, int] = {}
        start = 0.0
        for s in range(self.num_sessions):
            if s > 0:
                start += (
                    arrival_rng.expovariate(1.0 / interval)
                    if self.arrival == "poisson" and interval > 0
                    else interval
                )
            rng = random.Random(f"{self.seed}:session:{s}")
            kind = rng.randrange(self.num_agent_kinds)
            kind_of[f"s{s}"] = kind
            sessions.append(self._session(s, systems[kind], start, source, rng))
        seen: set[int] = set()
        for spec in heapq.merge(*sessions, key=lambda r: r.arrival_s):
            assert spec.session_id is not None
            kind = kind_of[spec.session_id]
            if kind not in seen:
                # the first prompt of its kind in the stream: nothing of it was seen before
                seen.add(kind)
                spec.reusable_prefix_len = 0
            yield spec

    def _session(
        self, s: int, system: tuple[int, ...], start: float, source: BlockTokens, rng: random.Random
    ) -> Iterator[RequestSpec]:
        """Session ``s``'s requests, in order; every prompt after the first extends the one before it
        unless the context was compacted or truncated in between."""
        d = self._draws
        size = self.block_tokens
        cap = self.max_context_tokens
        shared = len(system) * size
        sid = f"s{s}"
        ctx = _Context(list(system), shared, (s + 1) << _SESSION_SHIFT, size)
        ctx.extend(min(max(1, d["task_len"].tokens(rng)), cap - shared))
        num_turns = max(1, d["num_turns"].tokens(rng))
        arrival = start
        reusable = shared
        gap: float | None = None
        for t in range(num_turns):
            out = max(1, d["output_len"].tokens(rng))
            yield RequestSpec(
                request_id=f"{self.name}-{sid}-t{t}",
                arrival_s=arrival,
                prompt_token_ids=[],
                output_len=out,
                group=sid,
                session_id=sid,
                reusable_prefix_len=reusable,
                prompt_blocks=PromptBlocks(tuple(ctx.hash_ids), ctx.num_tokens, source),
                gap_after_previous_s=gap,
            )
            if t == num_turns - 1:
                return
            growth = out + max(0, d["tool_result_len"].tokens(rng))
            gap = d["think_time_s"].sample(rng)
            arrival += gap
            reusable = ctx.num_tokens
            if ctx.num_tokens + growth <= cap:
                ctx.extend(growth)
                continue
            reusable = shared
            if self.on_cap == "compact":
                ctx.restart(system)
                ctx.extend(min(max(1, d["summary_len"].tokens(rng)), cap - shared))
                continue
            target = int(self.truncate_to * cap)
            body = len(ctx.hash_ids) - len(system)
            drop = -(-(ctx.num_tokens + growth - target) // size)
            if drop >= body:
                ctx.restart(system)
                growth = min(growth, target - shared)
            else:
                ctx.drop_after(system, drop)
            ctx.extend(growth)
