"""Workloads: deterministic request streams for the load runner and the fleet simulator.

Three shapes, all yielding :class:`RequestSpec` in arrival order:

- :class:`SharedPrefixWorkload` — inference-perf's ``shared_prefix`` data generator: ``num_groups``
  system prompts, each followed by ``num_prompts_per_group`` questions. The prompts are built once,
  shuffled once and then cycled round-robin, so after one full cycle whole prompts recur.
- :class:`MultiTurnWorkload` — LMCache's multi-round QA table: conversations whose history grows by one
  user turn and one assistant answer per turn.
- :class:`MooncakeTraceWorkload` — replay of a Mooncake-format jsonl trace (``timestamp`` ms,
  ``input_length``, ``output_length``, ``hash_ids`` of 512-token blocks): equal hash ids become equal
  synthetic token blocks, replayed by timestamp with a speed-up factor.

Load shape: open loop in ``stages`` (``{rate, duration}``, Poisson or constant arrivals) or, without
stages, ``num_requests`` requests all due at time 0 for a closed-loop runner to pace by concurrency.

``RequestSpec.reusable_prefix_len`` is the number of leading prompt tokens an ideal fleet-wide cache of
unbounded size could serve: the longest prefix this prompt shares with any earlier prompt of the
stream. Hit rates are judged against it.

Every stream is a pure function of its parameters and ``seed``.
"""

from __future__ import annotations

import gzip
import json
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO, TypeAlias, runtime_checkable

import yaml

from kvmesh.bench.trace_blocks import DEFAULT_CAPACITY_BLOCKS, BlockTokens, PromptBlocks
from kvmesh.errors import ConfigError

Arrival = Literal["poisson", "constant"]
DEFAULT_VOCAB_SIZE = 32_000
DEFAULT_TOKEN_LOW = 100
"""Synthetic token ids start here so that special tokens (BOS, EOS, chat markers) never appear."""


@dataclass(slots=True)
class Stage:
    """One load stage: ``rate`` requests per second for ``duration`` seconds.

    A ``warmup`` stage fills the fleet's caches; runs report it on its own row and leave it out of
    their headline summary, as llm-d's benchmarks do with their first stage.
    """

    rate: float
    duration: float
    warmup: bool = False

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.duration <= 0:
            raise ConfigError(
                f"stage needs rate > 0 and duration > 0, got rate={self.rate} duration={self.duration}"
            )


@dataclass(slots=True)
class RequestSpec:
    """One request of a workload."""

    request_id: str
    arrival_s: float
    """Seconds after the start of the run at which the request is due."""
    prompt_token_ids: list[int]
    """Read-only: workloads hand out one list per distinct prompt to every request that sends it."""
    output_len: int
    group: str | None = None
    session_id: str | None = None
    """Requests of one session are sent one after another (each after the previous one finished)."""
    stage: int = 0
    reusable_prefix_len: int = 0
    """Tokens of this prompt that an ideal fleet-wide cache could hold (shared with an earlier prompt)."""
    messages: list[dict[str, str]] | None = None
    """Chat form of the prompt, for workloads that are chat-shaped (text mode)."""
    prompt_id: int | None = None
    """Which of the workload's distinct prompts this is (equal ids, equal tokens); ``None`` if untracked."""
    prompt_blocks: PromptBlocks | None = None
    """The same prompt as a chain of shared token blocks (trace replays), for consumers that work
    block by block and need not hold the tokens (the simulator, through
    :meth:`BlockWorkload.block_requests`, where ``prompt_token_ids`` is left empty)."""


class Workload(Protocol):
    """A named, deterministic stream of requests in arrival order."""

    name: str

    def requests(self) -> Iterator[RequestSpec]: ...


@runtime_checkable
class BlockWorkload(Workload, Protocol):
    """A workload whose prompts are chains of shared token blocks (trace replays)."""

    def block_requests(self) -> Iterator[RequestSpec]:
        """The stream of :meth:`requests` without token lists: each prompt is only in
        ``prompt_blocks`` and ``prompt_token_ids`` is empty (for consumers that read blocks)."""
        ...


# --- lengths -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token length: fixed, or normal with ``mean``/``std_dev`` clipped to ``[min, max]``.

    Accepts inference-perf's forms: a plain int, or ``{mean, std_dev, min, max}``.
    """

    mean: float
    std_dev: float = 0.0
    min: int = 1
    max: int = 1 << 30

    @classmethod
    def parse(cls, value: int | float | Mapping[str, Any] | LengthDist, what: str = "length") -> LengthDist:
        """Build a distribution from an int or a mapping.

        Raises:
            ConfigError: a negative or inconsistent specification.
        """
        if isinstance(value, LengthDist):
            return value
        if isinstance(value, bool):
            raise ConfigError(f"{what}: expected an int or {{mean, std_dev, min, max}}, got {value!r}")
        if isinstance(value, int | float):
            if value < 0:
                raise ConfigError(f"{what} must be >= 0, got {value}")
            return cls(mean=float(value), std_dev=0.0, min=int(value), max=int(value))
        if isinstance(value, Mapping):
            unknown = set(value) - {"mean", "std_dev", "min", "max"}
            if unknown or "mean" not in value:
                raise ConfigError(f"{what}: expected keys mean, std_dev, min, max; got {sorted(value)}")
            mean = float(value["mean"])
            std = float(value.get("std_dev", 0.0))
            lo = int(value.get("min", 0 if std else mean))
            hi = int(value.get("max", 1 << 30 if std else mean))
            if std < 0 or lo < 0 or hi < lo:
                raise ConfigError(f"{what}: need std_dev >= 0 and 0 <= min <= max, got {dict(value)}")
            return cls(mean=mean, std_dev=std, min=lo, max=hi)
        raise ConfigError(f"{what}: expected an int or {{mean, std_dev, min, max}}, got {value!r}")

    def sample(self, rng: random.Random) -> int:
        """Draw one length (a fixed length draws nothing from ``rng``)."""
        if self.std_dev == 0.0:
            return max(self.min, min(self.max, round(self.mean)))
        return max(self.min, min(self.max, round(rng.gauss(self.mean, self.std_dev))))


LengthLike: TypeAlias = int | float | Mapping[str, Any] | LengthDist


# --- arrivals ------------------------------------------------------------------------------------


def stage_arrivals(
    stages: Sequence[Stage], arrival: Arrival, rng: random.Random
) -> Iterator[tuple[float, int]]:
    """Yield ``(arrival_s, stage_index)`` for back-to-back stages.

    Poisson stages draw exponential gaps at the stage's rate; constant stages space requests ``1/rate``
    apart. A stage's arrivals all fall inside its own ``[start, start + duration)`` window.
    """
    if arrival not in ("poisson", "constant"):
        raise ConfigError(f"arrival must be 'poisson' or 'constant', got {arrival!r}")
    start = 0.0
    for index, stage in enumerate(stages):
        end = start + stage.duration
        t = start
        k = 0
        while True:
            k += 1
            # constant arrivals are computed, not summed, so rounding never adds one at the stage end
            t = t + rng.expovariate(stage.rate) if arrival == "poisson" else start + k / stage.rate
            if t >= end:
                break
            yield t, index
        start = end


def _arrivals(
    stages: Sequence[Stage] | None, num_requests: int | None, arrival: Arrival, rng: random.Random
) -> Iterator[tuple[float, int]]:
    if stages:
        yield from stage_arrivals(stages, arrival, rng)
        return
    if num_requests is None:
        raise ConfigError("a workload needs load stages or num_requests")
    for _ in range(num_requests):
        yield 0.0, 0


def synthetic_tokens(
    rng: random.Random, n: int, vocab_size: int, token_low: int = DEFAULT_TOKEN_LOW
) -> list[int]:
    """``n`` token ids drawn uniformly from ``[token_low, vocab_size)``."""
    if vocab_size <= token_low:
        raise ConfigError(f"vocab_size ({vocab_size}) must exceed token_low ({token_low})")
    return [rng.randrange(token_low, vocab_size) for _ in range(n)]


_WORDS = [
    "alpha",
    "bravo",
    "cedar",
    "delta",
    "ember",
    "falcon",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "kestrel",
    "lumen",
    "meadow",
    "nectar",
    "orchid",
    "pebble",
    "quartz",
    "raven",
    "saffron",
    "timber",
    "umber",
    "velvet",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
    "anchor",
    "beacon",
    "canyon",
    "dune",
    "estuary",
    "fjord",
    "glacier",
    "heath",
    "island",
    "jetty",
    "knoll",
    "lagoon",
    "mesa",
    "nook",
    "oasis",
    "prairie",
    "quarry",
    "ridge",
    "savanna",
    "tundra",
    "upland",
    "valley",
    "wharf",
]


def synthetic_text(rng: random.Random, num_words: int) -> str:
    """``num_words`` words from a fixed list of plain lowercase words (stable under BPE tokenizers)."""
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


# --- shared prefix -------------------------------------------------------------------------------


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
        for i, (t, stage) in enumerate(_arrivals(self.stages, self.num_requests, self.arrival, arrival_rng)):
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


# --- multi-turn ----------------------------------------------------------------------------------


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


# --- Mooncake trace ------------------------------------------------------------------------------


@dataclass(slots=True)
class MooncakeTraceWorkload:
    """Replay of a Mooncake-format trace.

    Each jsonl line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``.
    Hash id ``h`` stands for one block of ``block_tokens`` tokens; its tokens are drawn from a PRNG
    seeded by ``(seed, h)``, so equal ids give equal blocks in every run. A prompt is the concatenation
    of its blocks cut to ``input_length`` (the last block may be partial); each request also carries
    it as ``prompt_blocks``, and :meth:`block_requests` yields the stream with blocks only. Arrival =
    (timestamp − first timestamp) / 1000 / ``speedup``.

    Args:
        max_requests: replay only the first lines of the trace.
        max_input_len: cut longer prompts (and their output) to fit a model's context.
        cached_blocks: token blocks kept between requests (see :class:`BlockTokens`); memory, not
            results, depends on it.
    """

    path: str | Path
    speedup: float = 1.0
    block_tokens: int = 512
    max_requests: int | None = None
    max_input_len: int | None = None
    seed: int = 0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    token_low: int = DEFAULT_TOKEN_LOW
    name: str = "mooncake"
    cached_blocks: int = DEFAULT_CAPACITY_BLOCKS

    def __post_init__(self) -> None:
        if self.speedup <= 0 or self.block_tokens <= 0:
            raise ConfigError(
                f"speedup and block_tokens must be > 0, got {self.speedup}, {self.block_tokens}"
            )

    def _records(self) -> Iterator[tuple[int, dict[str, Any]]]:
        path = Path(self.path)
        try:
            handle: TextIO = (
                gzip.open(path, "rt", encoding="utf-8")  # noqa: SIM115 - closed by the `with` below
                if path.suffix == ".gz"
                else path.open("r", encoding="utf-8")
            )
        except OSError as exc:
            raise ConfigError(f"cannot open trace {path}: {exc}") from exc
        with handle:
            yield from self._parse_lines(path, handle)

    def _parse_lines(self, path: Path, handle: TextIO) -> Iterator[tuple[int, dict[str, Any]]]:
        lineno = 0
        while True:
            try:
                line = handle.readline()
            except (OSError, EOFError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{path}:{lineno + 1}: unreadable trace ({exc})") from exc
            if not line:
                return
            lineno += 1
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ok = (
                    isinstance(rec, dict)
                    and isinstance(rec.get("timestamp"), int | float)
                    and isinstance(rec.get("input_length"), int)
                    and isinstance(rec.get("output_length"), int)
                    and isinstance(rec.get("hash_ids"), list)
                    and all(isinstance(h, int) for h in rec["hash_ids"])
                )
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
            if not ok:
                raise ConfigError(
                    f"{path}:{lineno}: expected timestamp, input_length, output_length (numbers) and hash_ids (ints)"
                )
            if rec["input_length"] > len(rec["hash_ids"]) * self.block_tokens:
                raise ConfigError(
                    f"{path}:{lineno}: input_length {rec['input_length']} exceeds "
                    f"{len(rec['hash_ids'])} blocks of {self.block_tokens} tokens"
                )
            yield lineno, rec

    def requests(self) -> Iterator[RequestSpec]:
        for spec in self.block_requests():
            assert spec.prompt_blocks is not None, "block_requests carries every prompt as blocks"
            spec.prompt_token_ids = spec.prompt_blocks.token_ids()
            yield spec

    def block_requests(self) -> Iterator[RequestSpec]:
        source = BlockTokens(
            self.block_tokens,
            seed=self.seed,
            vocab_size=self.vocab_size,
            token_low=self.token_low,
            capacity_blocks=self.cached_blocks,
        )
        seen_len: dict[int, int] = {}
        t0: float | None = None
        size = self.block_tokens
        for i, (_lineno, rec) in enumerate(self._records()):
            if self.max_requests is not None and i >= self.max_requests:
                return
            if t0 is None:
                t0 = float(rec["timestamp"])
            n = rec["input_length"]
            if self.max_input_len is not None:
                n = min(n, self.max_input_len)
            hash_ids = tuple(rec["hash_ids"][: -(-n // size)])
            reusable = 0
            reusing = True
            for j, h in enumerate(hash_ids):
                take = min(size, n - j * size)
                if reusing:
                    reused = min(take, seen_len.get(h, 0))
                    reusable += reused
                    reusing = reused == take
                seen_len[h] = max(seen_len.get(h, 0), take)
            yield RequestSpec(
                request_id=f"{self.name}-{i}",
                arrival_s=(float(rec["timestamp"]) - t0) / 1000.0 / self.speedup,
                prompt_token_ids=[],
                output_len=max(1, rec["output_length"]),
                reusable_prefix_len=reusable,
                prompt_blocks=PromptBlocks(hash_ids, n, source),
            )


# --- configuration -------------------------------------------------------------------------------


def _parse_stages(raw: Any) -> list[Stage] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"stages must be a non-empty list of {{rate, duration[, warmup]}}, got {raw!r}")
    stages = []
    for item in raw:
        if not isinstance(item, Mapping) or not {"rate", "duration"} <= set(item) <= {
            "rate",
            "duration",
            "warmup",
        }:
            raise ConfigError(f"each stage must be {{rate, duration[, warmup]}}, got {item!r}")
        warmup = item.get("warmup", False)
        if not isinstance(warmup, bool):
            raise ConfigError(f"a stage's warmup must be true or false, got {warmup!r}")
        stages.append(Stage(rate=float(item["rate"]), duration=float(item["duration"]), warmup=warmup))
    return stages


_KINDS = {
    "shared_prefix": SharedPrefixWorkload,
    "multi_turn": MultiTurnWorkload,
    "mooncake": MooncakeTraceWorkload,
    "mooncake_trace": MooncakeTraceWorkload,
}


def load_workload(source: str | Path | Mapping[str, Any]) -> Workload:
    """Build a workload from a YAML file, a YAML string or a mapping.

    Two layouts are accepted. inference-perf's::

        load: {type: poisson, stages: [{rate: 15, duration: 50}]}
        data: {type: shared_prefix, shared_prefix: {num_groups: 150, ...}}

    and a flat one::

        type: shared_prefix          # or multi_turn, mooncake
        num_groups: 150
        stages: [{rate: 15, duration: 50}]
        arrival: poisson

    Raises:
        ConfigError: unknown type, missing or unknown fields, bad values.
    """
    cfg = _read_config(source)
    if "data" in cfg:
        data = cfg["data"]
        load = cfg.get("load") or {}
        if not isinstance(data, Mapping) or not isinstance(load, Mapping):
            raise ConfigError("'data' and 'load' must be mappings")
        kind = str(data.get("type", ""))
        params = dict(data.get(kind) or {})
        if "stages" in load:
            params["stages"] = load["stages"]
        if "type" in load:
            params["arrival"] = load["type"]
        for key in ("seed", "num_requests"):
            if key in cfg:
                params[key] = cfg[key]
    else:
        params = dict(cfg)
        kind = str(params.pop("type", ""))
    factory = _KINDS.get(kind)
    if factory is None:
        raise ConfigError(f"unknown workload type {kind!r}; choose one of {sorted(_KINDS)}")
    if "stages" in params:
        params["stages"] = _parse_stages(params["stages"])
    if factory is MooncakeTraceWorkload:
        params.pop("stages", None)
        params.pop("arrival", None)
    try:
        workload: Workload = factory(**params)
    except TypeError as exc:
        raise ConfigError(f"{kind} workload: {exc}") from exc
    return workload


def _read_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    text: str
    if isinstance(source, Path) or (
        isinstance(source, str) and "\n" not in source and Path(source).is_file()
    ):
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read workload file {source}: {exc}") from exc
    else:
        text = str(source)
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"workload is not valid YAML: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ConfigError(f"workload must be a mapping, got {type(cfg).__name__}")
    return cfg


def total_prompt_tokens(specs: Sequence[RequestSpec]) -> int:
    """Sum of prompt lengths."""
    return sum(len(s.prompt_token_ids) for s in specs)


def total_reusable_tokens(specs: Sequence[RequestSpec]) -> int:
    """Sum of ``reusable_prefix_len``: what an ideal fleet-wide cache could serve."""
    return sum(s.reusable_prefix_len for s in specs)


def expected_num_requests(stages: Sequence[Stage]) -> int:
    """Mean number of requests of open-loop stages (rate × duration summed)."""
    return math.floor(sum(s.rate * s.duration for s in stages))


@dataclass(slots=True)
class ShiftedTokens:
    """Another workload with every prompt token id shifted by ``offset`` (modulo the id range).

    Lengths, order, arrival times and reusable prefixes are unchanged, but no block of the shifted
    stream equals a block of the original: runs that must not hit each other's caches use different
    offsets. ``messages`` are passed through unchanged.
    """

    inner: Workload
    offset: int
    vocab_size: int = DEFAULT_VOCAB_SIZE
    token_low: int = DEFAULT_TOKEN_LOW
    name: str = ""
    stages: list[Stage] | None = None

    def __post_init__(self) -> None:
        if self.vocab_size <= self.token_low:
            raise ConfigError(f"vocab_size ({self.vocab_size}) must exceed token_low ({self.token_low})")
        self.name = self.name or self.inner.name
        self.stages = self.stages or getattr(self.inner, "stages", None)

    def requests(self) -> Iterator[RequestSpec]:
        span = self.vocab_size - self.token_low
        low = self.token_low
        for spec in self.inner.requests():
            spec.prompt_token_ids = [low + (t - low + self.offset) % span for t in spec.prompt_token_ids]
            spec.prompt_blocks = None
            yield spec


def shifted(workload: Workload, offset: int) -> Workload:
    """``workload`` with token ids shifted by ``offset`` (itself when ``offset`` is 0); the id range is
    taken from the workload's ``vocab_size``/``token_low`` when it has them."""
    if offset == 0:
        return workload
    return ShiftedTokens(
        workload,
        offset,
        vocab_size=getattr(workload, "vocab_size", DEFAULT_VOCAB_SIZE),
        token_low=getattr(workload, "token_low", DEFAULT_TOKEN_LOW),
    )
