"""Workloads: deterministic request streams for the load runner (`kvmesh.bench`) and the fleet simulator.

Four shapes, all yielding :class:`RequestSpec` in arrival order:

- :class:`SharedPrefixWorkload` — inference-perf's ``shared_prefix`` data generator: ``num_groups``
  system prompts, each followed by ``num_prompts_per_group`` questions. The prompts are built once,
  shuffled once and then cycled round-robin, so after one full cycle whole prompts recur.
- :class:`MultiTurnWorkload` — LMCache's multi-round QA table: conversations whose history grows by one
  user turn and one assistant answer per turn.
- :class:`MooncakeTraceWorkload` — replay of a Mooncake-format jsonl trace (``timestamp`` ms,
  ``input_length``, ``output_length``, ``hash_ids`` of 512-token blocks): equal hash ids become equal
  synthetic token blocks, replayed by timestamp with a speed-up factor.
- :class:`AgenticWorkload` — coding-agent sessions: tens to hundreds of turns, each resending the whole
  growing context (system prompt and tools shared by every session, then the session's history) after
  a think time that starts when the previous turn finished; contexts are capped by compaction or
  truncation. Prompts are hash-id block chains, as in a trace replay.

Load shape: open loop in ``stages`` (``{rate, duration}``, Poisson or constant arrivals) or, without
stages, ``num_requests`` requests all due at time 0 for a closed-loop runner to pace by concurrency.

``RequestSpec.reusable_prefix_len`` is the number of leading prompt tokens an ideal fleet-wide cache of
unbounded size could serve: the longest prefix this prompt shares with any earlier prompt of the
stream. Hit rates are judged against it.

Every stream is a pure function of its parameters and ``seed``.

Modules: ``spec`` (stages, :class:`RequestSpec`, the protocols), ``lengths``, ``arrivals``,
``synthetic`` (token ids and the word list), one module per generator (``shared_prefix``,
``multi_turn``, ``mooncake``, ``agentic``), ``trace_blocks`` (a trace's token blocks, drawn on demand),
``shift`` and ``config`` (the YAML loader).
"""

from kvmesh.workload.agentic import AgenticWorkload
from kvmesh.workload.arrivals import expected_num_requests, request_arrivals, stage_arrivals
from kvmesh.workload.config import load_workload
from kvmesh.workload.lengths import LengthDist, LengthLike
from kvmesh.workload.mooncake import MooncakeTraceWorkload
from kvmesh.workload.multi_turn import MultiTurnWorkload
from kvmesh.workload.shared_prefix import SharedPrefixWorkload
from kvmesh.workload.shift import ShiftedTokens, shifted
from kvmesh.workload.spec import (
    Arrival,
    BlockWorkload,
    RequestSpec,
    Stage,
    Workload,
    total_prompt_tokens,
    total_reusable_tokens,
)
from kvmesh.workload.synthetic import DEFAULT_TOKEN_LOW, DEFAULT_VOCAB_SIZE, synthetic_text, synthetic_tokens
from kvmesh.workload.trace_blocks import DEFAULT_CAPACITY_BLOCKS, BlockTokens, PromptBlocks, block_token_array

__all__ = [
    "DEFAULT_CAPACITY_BLOCKS",
    "DEFAULT_TOKEN_LOW",
    "DEFAULT_VOCAB_SIZE",
    "AgenticWorkload",
    "Arrival",
    "BlockTokens",
    "BlockWorkload",
    "LengthDist",
    "LengthLike",
    "MooncakeTraceWorkload",
    "MultiTurnWorkload",
    "PromptBlocks",
    "RequestSpec",
    "SharedPrefixWorkload",
    "ShiftedTokens",
    "Stage",
    "Workload",
    "block_token_array",
    "expected_num_requests",
    "load_workload",
    "request_arrivals",
    "shifted",
    "stage_arrivals",
    "synthetic_text",
    "synthetic_tokens",
    "total_prompt_tokens",
    "total_reusable_tokens",
]
