"""The ModelRunner protocol: what the engine's scheduler asks of a model.

The scheduler plans one *step* at a time (continuous batching): some prefill chunks and some decode
tokens share a per-step token budget. A runner executes the step and returns the sampled tokens.
Two runners implement it: :mod:`kvmesh.engine.torch_runner` (real KV from a real model) and
:mod:`kvmesh.engine.emulated_runner` (no tensors; sleeps as long as a GPU would take).

KV crosses this boundary as one array per token range::

    kv[layer, k_or_v, kv_head, token, head_dim]      shape (L, 2, H, T, D), dtype = KVLayout.dtype

which is also the payload layout of store chunks, so a prefix loaded from the store or from the
device-tier cache is handed to ``PrefillChunk.cached_kv`` without reshaping. The array lives where the
runner computes: a numpy array for CPU runners, a tensor in GPU memory for a CUDA runner, so the
device tier keeps KV on the device and a hit never crosses the bus. The runner's :class:`KVOps` copy,
join and convert its arrays; only the store sees numpy (``to_host``/``from_host``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import numpy as np

KVArray: TypeAlias = Any
"""A runner's KV of a token range, (L, 2, H, T, D): numpy on the CPU, a device tensor on a GPU."""


class KVOps(Protocol):
    """What the engine does with a runner's KV arrays without knowing where they live."""

    def copy(self, kv: KVArray) -> KVArray:
        """A contiguous copy that keeps nothing else alive (one device-tier block)."""
        ...

    def concat(self, parts: Seq[KVArray]) -> KVArray:
        """``parts`` joined on the token axis."""
        ...

    def to_host(self, kv: KVArray) -> np.ndarray:
        """The store's numpy form (bfloat16 as uint16 bit patterns). Blocks while a device copies."""
        ...

    def from_host(self, array: np.ndarray) -> KVArray:
        """A store array in the runner's form. Blocks while a device copies."""
        ...

    def join_host(self, parts: Seq[np.ndarray]) -> KVArray:
        """Store arrays (chunks in token order) joined on the token axis, in the runner's form."""
        ...


class NumpyKVOps:
    """KV as numpy arrays in host memory (CPU runners, emulation, tests)."""

    def copy(self, kv: KVArray) -> KVArray:
        return np.array(kv, copy=True, order="C")

    def concat(self, parts: Seq[KVArray]) -> KVArray:
        return np.concatenate(parts, axis=3)

    def to_host(self, kv: KVArray) -> np.ndarray:
        return np.asarray(kv)

    def from_host(self, array: np.ndarray) -> KVArray:
        return array

    def join_host(self, parts: Seq[np.ndarray]) -> KVArray:
        return self.concat(parts)


NUMPY_KV = NumpyKVOps()


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape facts of a model's KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    """numpy dtype name of the KV payload: "float32", "float16" or "bfloat16"."""

    @property
    def bytes_per_element(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token: 2 × layers × kv_heads × head_dim × bytes/element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_element

    def name(self) -> str:
        """The layout string that enters store namespaces."""
        return f"L{self.num_layers}xH{self.num_kv_heads}xD{self.head_dim}"


@dataclass(frozen=True, slots=True)
class RunnerInfo:
    """What the server and the scheduler need to know about the loaded model."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv: KVLayout
    device: str = "cpu"


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping rules (OpenAI semantics)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class Sequence:
    """One request as the runner sees it."""

    request_id: str
    token_ids: list[int]
    """Prompt followed by every token generated so far."""
    num_prompt_tokens: int
    sampling: SamplingParams
    num_computed_tokens: int = 0
    """Tokens whose KV the runner holds for this sequence (cached prefix included)."""
    runner_state: Any = None
    """Runner-private state (e.g. a transformers DynamicCache); released by ``ModelRunner.free``."""


@dataclass(slots=True)
class PrefillChunk:
    """Compute KV for ``seq.token_ids[start:end]``.

    On a sequence's first chunk, ``start`` equals the number of prefix tokens found in a cache and
    ``cached_kv`` holds their KV (shape (L, 2, H, start, D)); it is ``None`` for the emulated runner
    and when nothing was cached. ``cached_tier`` names where the prefix came from so the emulated
    runner can charge its transfer time.
    """

    seq: Sequence
    start: int
    end: int
    cached_kv: KVArray | None = None
    cached_tier: str | None = None


@dataclass(slots=True)
class StepPlan:
    """One scheduler step: prefill chunks and decode sequences, run as a batch."""

    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.end - c.start for c in self.prefills) + len(self.decodes)


@dataclass(slots=True)
class StepOutput:
    """Tokens sampled in a step.

    ``sampled`` maps request id → next token for every decode sequence and for every prefill chunk
    that reached the end of its prompt (that token is the first output token). ``logprobs`` is
    optional: request id → last-position logits row (float32) when the runner keeps them.
    """

    sampled: dict[str, int] = field(default_factory=dict)
    last_logits: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineDefaults:
    """What an engine built on a runner takes where its options say nothing, and how it stores KV."""

    kv_capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    stream_interval_s: float
    """Seconds between stream flushes."""
    keeps_kv: bool
    """Whether the device-tier prefix cache keeps the runner's KV (placeholder KV is not kept)."""
    store_kv_dtype: str
    store_kv_layout: str
    """The KV format store namespaces carry: a runner's chunks load only into the same format."""
    store_bytes_per_token: int


class ModelRunner(Protocol):
    """Executes scheduler steps. Implementations must not block the event loop."""

    info: RunnerInfo
    kv_ops: KVOps
    """How the engine copies, joins and converts this runner's KV arrays."""

    def engine_defaults(self) -> EngineDefaults:
        """The engine sizes and the stored KV format that suit this runner."""
        ...

    def close(self) -> None:
        """Release what the runner holds (threads, device memory); blocking."""
        ...

    async def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step; on return each sequence's ``num_computed_tokens`` is advanced."""
        ...

    def export_kv(self, seq: Sequence, start: int, end: int) -> KVArray | None:
        """A copy of the KV of ``seq.token_ids[start:end]``, (L, 2, H, end-start, D), in the runner's
        form (see :attr:`kv_ops`); ``None`` if the runner has none."""
        ...

    def free(self, seq: Sequence) -> None:
        """Release the runner state of a finished or cancelled sequence."""
        ...
