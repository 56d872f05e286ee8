"""A ModelRunner with no tensors: each step takes as long as the cost model says a GPU would.

Sleeps are scheduled against a running deadline (``busy_until``), so the event loop's own latency
does not accumulate: a prefill split into many chunks finishes when the sum of its step times says,
not later. Sampled tokens are a deterministic function of (request id, position) that never hits EOS,
so emulated requests run to ``max_tokens``.

Emulated KV has no values, only a size. What the runner exports (to the store) is a placeholder of
one float16 element per (K/V, token)::

    placeholder[0, k_or_v, 0, token, 0] = 0      shape (1, 2, 1, T, 1): 4 bytes per token

so a store holds real chunk objects (keyed, checksummed, tiered, announced) at a few bytes per
token instead of the model's full size (256 KiB per token for Qwen3-32B). Their KV format
(:meth:`EmulatedRunner.store_kv_format`) names the placeholder and the modelled layout, so they never
share store keys with a real engine's chunks. What a load from the store costs is modelled from
the full size: :meth:`CostModel.kv_load_time` over the tier the prefix came from.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import xxhash

from kvmesh.engine.cost_model import CostModel, CostPreset, get_preset
from kvmesh.engine.runner import (
    NUMPY_KV,
    EngineDefaults,
    KVLayout,
    KVOps,
    ModelRunner,
    RunnerInfo,
    Sequence,
    StepOutput,
    StepPlan,
)

PLACEHOLDER_KV = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float16")
"""The shape of exported emulated KV: (1, 2, 1, T, 1) float16 zeros."""


class EmulatedRunner:
    """Cost-model runner.

    Args:
        preset: a :class:`CostPreset` or its name.
        model_name: served model name (defaults to the preset's model).
        vocab_size: sampled tokens lie in ``[0, vocab_size)``; defaults to the model's.
        eos_token_ids: never sampled.
        clock: monotonic clock in seconds (tests may pass their own).
    """

    def __init__(
        self,
        preset: CostPreset | str,
        *,
        model_name: str | None = None,
        vocab_size: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
        max_model_len: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.preset = get_preset(preset) if isinstance(preset, str) else preset
        self.cost = CostModel(self.preset)
        spec = self.preset.model
        self.info = RunnerInfo(
            model_name=model_name or spec.name,
            max_model_len=max_model_len or spec.max_model_len,
            vocab_size=vocab_size or spec.vocab_size,
            eos_token_ids=eos_token_ids,
            kv=spec.kv_layout(),
            device=f"emulated:{self.preset.name}",
        )
        self.kv_ops: KVOps = NUMPY_KV
        self._clock = clock
        self.busy_until = 0.0
        self.busy_seconds = 0.0
        self.num_steps = 0

    def step_seconds(self, plan: StepPlan) -> float:
        """Modelled duration of ``plan``: the batched step plus KV loads of first chunks from slower tiers."""
        prefills = [(c.start, c.end) for c in plan.prefills]
        contexts = [s.num_computed_tokens + 1 for s in plan.decodes]
        seconds = self.cost.step_time(prefills, contexts)
        for chunk in plan.prefills:
            if chunk.cached_tier and chunk.start > 0 and chunk.seq.num_computed_tokens == 0:
                seconds += self.cost.kv_load_time(chunk.start, chunk.cached_tier)
        return seconds

    async def execute(self, plan: StepPlan) -> StepOutput:
        """Sleep until the step would finish, then advance the sequences and sample."""
        seconds = self.step_seconds(plan)
        now = self._clock()
        start = max(now, self.busy_until)
        self.busy_until = start + seconds
        self.busy_seconds += seconds
        self.num_steps += 1
        delay = self.busy_until - now
        if delay > 0:
            await asyncio.sleep(delay)
        out = StepOutput()
        for chunk in plan.prefills:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.end
            if chunk.end == len(seq.token_ids):
                out.sampled[seq.request_id] = self._sample(seq)
        for seq in plan.decodes:
            seq.num_computed_tokens += 1
            out.sampled[seq.request_id] = self._sample(seq)
        return out

    def _sample(self, seq: Sequence) -> int:
        position = len(seq.token_ids)
        digest = xxhash.xxh3_64_intdigest(f"{seq.request_id}:{position}".encode())
        token = digest % self.info.vocab_size
        while token in self.info.eos_token_ids:
            token = (token + 1) % self.info.vocab_size
        return token

    def engine_defaults(self) -> EngineDefaults:
        """The preset's batch limits and KV capacity; placeholder KV, not kept in the device tier
        and stored in its own format (:meth:`store_kv_format`); streams flushed every 50 ms."""
        kv_dtype, kv_layout = self.store_kv_format()
        return EngineDefaults(
            kv_capacity_tokens=self.cost.kv_capacity_tokens(),
            max_num_seqs=self.preset.max_num_seqs,
            max_num_batched_tokens=self.preset.max_num_batched_tokens,
            stream_interval_s=0.05,
            keeps_kv=False,
            store_kv_dtype=kv_dtype,
            store_kv_layout=kv_layout,
            store_bytes_per_token=PLACEHOLDER_KV.bytes_per_token,
        )

    def close(self) -> None:
        """Nothing to release: the emulated runner holds no thread or memory of its own."""

    def store_kv_format(self) -> tuple[str, str]:
        """``(kv_dtype, kv_layout)`` of exported KV, as store namespaces carry it.

        The layout names the placeholder and the modelled model's layout (``emulated-L64xH8xD128``
        for Qwen3-32B): no real engine's layout looks like it, so a real engine never loads a
        placeholder chunk as KV, nor an emulated engine a real one.
        """
        return PLACEHOLDER_KV.dtype, f"emulated-{self.info.kv.name()}"

    def export_kv(self, seq: Sequence, start: int, end: int) -> np.ndarray | None:
        """Placeholder KV of ``seq.token_ids[start:end]``: zeros shaped (1, 2, 1, end-start, 1).

        Returns:
            ``None`` when the sequence has computed nothing yet (as a real runner without state).

        Raises:
            ValueError: the range is empty or reaches past the computed tokens.
        """
        computed = seq.num_computed_tokens
        if computed == 0:
            return None
        if not 0 <= start < end <= computed:
            raise ValueError(f"export_kv range [{start}, {end}) outside the {computed} computed tokens")
        layout = PLACEHOLDER_KV
        shape = (layout.num_layers, 2, layout.num_kv_heads, end - start, layout.head_dim)
        return np.zeros(shape, dtype=layout.dtype)

    def free(self, seq: Sequence) -> None:
        seq.runner_state = None


_: type[ModelRunner] = EmulatedRunner
