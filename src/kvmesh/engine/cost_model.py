"""GPU cost model: how long a replica takes to run a step, as pure functions of the work in it.

The emulated runner sleeps for these times and the fleet simulator advances virtual time by them, so
nothing here sleeps, reads a clock or keeps state beyond the spec it was built from.

Formulas (per step; ``tp`` GPUs work on one replica)::

    prefill FLOPs(start, end) = 2·P·(end-start) + 4·L·Hq·D·Σ_{i=start}^{end-1} (i+1)
    decode FLOPs(ctx)         = 2·P + 4·L·Hq·D·ctx
    compute time              = FLOPs / (peak · tp · mfu)
    memory time               = (weight bytes + KV bytes read) / (HBM BW · tp · mbu)
    step time                 = max(compute time, memory time) + step overhead
    KV load time(tier, n)     = tier latency + n · KV bytes/token / tier bandwidth

``P`` counts non-embedding parameters; the attention term counts every (query, key) pair a causal
prefill attends to. A step that mixes prefill chunks and decodes pays the sum of their FLOPs once and
reads the weights once, which is what continuous batching buys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.engine.runner import KVLayout


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """One accelerator."""

    name: str
    peak_flops: float
    """Dense bf16 FLOP/s."""
    hbm_bandwidth: float
    """Bytes/s."""
    hbm_bytes: float


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape facts of a decoder-only transformer that set its cost."""

    name: str
    num_params: float
    """Non-embedding parameters (the ones every token multiplies through)."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    total_params: float
    """All parameters, embeddings included: what the weights occupy in HBM."""
    vocab_size: int
    max_model_len: int
    bytes_per_param: int = 2
    kv_bytes_per_element: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        """2 × layers × kv_heads × head_dim × bytes/element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.bytes_per_param

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs for one (query, key) pair over all layers: QK^T and AV, 2 FLOPs per MAC."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    @property
    def attention_context_tokens(self) -> float:
        """Context at which attention doubles a prefill token's cost: ``2P`` over the FLOPs per
        (query, key) pair (about 30k tokens for Qwen3-32B, 27k for Llama-3.1-8B)."""
        return 2.0 * self.num_params / self.attention_flops_per_pair

    def kv_layout(self) -> KVLayout:
        dtype = "bfloat16" if self.kv_bytes_per_element == 2 else "float32"
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, dtype)


@dataclass(frozen=True, slots=True)
class TierLink:
    """How fast KV comes back from a store tier into device memory."""

    bandwidth: float
    """Bytes/s."""
    latency: float
    """Seconds per load, independent of size."""


H100 = GPUSpec("H100-SXM", peak_flops=989.5e12, hbm_bandwidth=3.35e12, hbm_bytes=80e9)
H200 = GPUSpec("H200", peak_flops=989.5e12, hbm_bandwidth=4.8e12, hbm_bytes=141e9)
CPU_LAPTOP = GPUSpec("cpu", peak_flops=2.0e11, hbm_bandwidth=2.0e10, hbm_bytes=16e9)

DEFAULT_TIER_LINKS: dict[str, TierLink] = {
    "GPU": TierLink(bandwidth=float("inf"), latency=0.0),
    "CPU": TierLink(bandwidth=50e9, latency=0.2e-3),
    "DISK": TierLink(bandwidth=6e9, latency=0.5e-3),
    "SHARED": TierLink(bandwidth=10e9, latency=1.5e-3),
}
"""PCIe Gen5 host memory, local NVMe, and a shared tier behind a 100 Gb/s network."""


@dataclass(frozen=True, slots=True)
class CostPreset:
    """A model on a GPU type at a tensor-parallel degree, with the engine's budget."""

    name: str
    model: ModelSpec
    gpu: GPUSpec
    tp: int = 1
    mfu: float = 0.45
    """Model FLOPs utilisation of prefill and of the compute side of decode."""
    mbu: float = 0.8
    """Memory bandwidth utilisation of decode."""
    step_overhead: float = 1.5e-3
    """Scheduling + launch time every step pays."""
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float = 6e9
    """Per replica: activations, CUDA graphs and workspace that are not KV."""
    kv_capacity_tokens: int | None = None
    """Measured KV pool size; ``None`` derives it from memory (see :meth:`CostModel.kv_capacity_tokens`)."""
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    """vLLM's OpenAI-server defaults on GPUs with 70 GiB or more (H100, H200): 8192 tokens, 1024 sequences."""
    tier_links: dict[str, TierLink] = field(default_factory=lambda: dict(DEFAULT_TIER_LINKS))


QWEN3_32B = ModelSpec(
    "Qwen/Qwen3-32B",
    num_params=31.2e9,
    num_layers=64,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    total_params=32.8e9,
    vocab_size=151_936,
    max_model_len=40_960,
)
LLAMA_31_70B = ModelSpec(
    "meta-llama/Llama-3.1-70B-Instruct",
    num_params=68.5e9,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    total_params=70.6e9,
    vocab_size=128_256,
    max_model_len=131_072,
)
LLAMA_31_8B = ModelSpec(
    "meta-llama/Llama-3.1-8B-Instruct",
    num_params=7.0e9,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    total_params=8.03e9,
    vocab_size=128_256,
    max_model_len=131_072,
)
SMOLLM2_135M = ModelSpec(
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    num_params=0.106e9,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    total_params=0.135e9,
    vocab_size=49_152,
    max_model_len=8192,
    bytes_per_param=4,
    kv_bytes_per_element=4,
)

PRESETS: dict[str, CostPreset] = {
    p.name: p
    for p in (
        # 307,328 KV tokens per pod is what llm-d measured for this setup (73-capacity benchmark).
        CostPreset("qwen3-32b-h100-tp2", QWEN3_32B, H100, tp=2, kv_capacity_tokens=307_328),
        CostPreset("llama-3.1-70b-h100-tp4", LLAMA_31_70B, H100, tp=4),
        CostPreset("llama-3.1-8b-h100", LLAMA_31_8B, H100, tp=1),
        CostPreset("llama-3.1-8b-h200", LLAMA_31_8B, H200, tp=1),
        CostPreset(
            "smollm2-135m-cpu",
            SMOLLM2_135M,
            CPU_LAPTOP,
            tp=1,
            mfu=0.5,
            mbu=0.5,
            step_overhead=2e-3,
            activation_reserve_bytes=0.5e9,
            kv_capacity_tokens=65_536,
            max_num_batched_tokens=2048,
            max_num_seqs=32,
        ),
        # SmolLM2's shapes on an H100: millisecond steps, for tests and many-pod demos on a laptop.
        CostPreset(
            "tiny-h100",
            SMOLLM2_135M,
            H100,
            tp=1,
            kv_capacity_tokens=65_536,
            max_num_batched_tokens=2048,
            max_num_seqs=64,
        ),
    )
}
"""Named presets: ``kvmesh engine --emulate NAME``."""


def get_preset(name: str) -> CostPreset:
    """Look a preset up by name.

    Raises:
        ValueError: no such preset (the message lists the known ones).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown emulation preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None


def causal_pairs(start: int, end: int) -> int:
    """(query, key) pairs a causal prefill of positions ``[start, end)`` attends to: Σ (i+1)."""
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start <= end, got start={start} end={end}")
    return (end * (end + 1) - start * (start + 1)) // 2


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step times for one preset. Pure: every method is a function of its arguments."""

    preset: CostPreset
    # Constants of the step formula, derived once (a simulation costs millions of steps).
    _param_flops: float = field(init=False, repr=False, compare=False)
    _pair_flops: int = field(init=False, repr=False, compare=False)
    _flops_per_s: float = field(init=False, repr=False, compare=False)
    _bytes_per_s: float = field(init=False, repr=False, compare=False)
    _weight_bytes: float = field(init=False, repr=False, compare=False)
    _kv_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        m, p = self.preset.model, self.preset
        for name, value in (
            ("_param_flops", 2.0 * m.num_params),
            ("_pair_flops", m.attention_flops_per_pair),
            ("_flops_per_s", p.gpu.peak_flops * p.tp * p.mfu),
            ("_bytes_per_s", p.gpu.hbm_bandwidth * p.tp * p.mbu),
            ("_weight_bytes", m.weight_bytes),
            ("_kv_bytes", m.kv_bytes_per_token),
        ):
            object.__setattr__(self, name, value)

    @property
    def model(self) -> ModelSpec:
        return self.preset.model

    @property
    def flops_per_second(self) -> float:
        """Effective compute: peak × tp × MFU."""
        return self._flops_per_s

    @property
    def bytes_per_second(self) -> float:
        """Effective HBM bandwidth: BW × tp × MBU."""
        return self._bytes_per_s

    def kv_capacity_tokens(self) -> int:
        """KV tokens the replica holds: the preset's measured figure, else free HBM / KV bytes per token."""
        p = self.preset
        if p.kv_capacity_tokens is not None:
            return p.kv_capacity_tokens
        free = p.gpu.hbm_bytes * p.tp * p.gpu_memory_utilization
        free -= self.model.weight_bytes + p.activation_reserve_bytes
        if free <= 0:
            raise ValueError(f"preset {p.name}: weights do not fit in {p.tp} × {p.gpu.name}")
        return int(free // self.model.kv_bytes_per_token)

    def prefill_flops(self, start: int, end: int) -> float:
        """FLOPs to compute positions ``[start, end)`` given KV for ``[0, start)``."""
        m = self.model
        return 2.0 * m.num_params * (end - start) + m.attention_flops_per_pair * causal_pairs(start, end)

    def decode_flops(self, context: int) -> float:
        """FLOPs of one decode token attending to ``context`` earlier tokens (itself included)."""
        m = self.model
        return 2.0 * m.num_params + m.attention_flops_per_pair * context

    def prefill_time(self, start: int, end: int) -> float:
        """Seconds of one prefill-only step over ``[start, end)``, overhead included."""
        return self.step_time([(start, end)], [])

    def decode_step_time(self, contexts: Sequence[int]) -> float:
        """Seconds of one decode-only step; ``contexts[i]`` is sequence i's length after the step."""
        return self.step_time([], contexts)

    def step_time(self, prefills: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """Seconds of one batched step.

        Args:
            prefills: ``(start, end)`` token ranges computed this step, one per prefill chunk.
            decode_contexts: context length (tokens attended, the new one included) per decode.

        Returns:
            ``max(compute, memory) + step_overhead``; ``0.0`` for an empty step.
        """
        return self.batch_step_time(prefills, len(decode_contexts), sum(decode_contexts))

    def batch_step_time(
        self, prefills: Sequence[tuple[int, int]], num_decodes: int, decode_context_total: int
    ) -> float:
        """:meth:`step_time` with the decodes summarised by their count and summed contexts.

        The step's cost depends on the decodes only through these two numbers, so a caller that
        tracks them (the fleet simulator) need not build one context per sequence.
        """
        if not prefills and not num_decodes:
            return 0.0
        param, pair = self._param_flops, self._pair_flops
        flops = 0.0
        kv_read = decode_context_total
        for s, e in prefills:  # prefill_flops, inlined
            flops += param * (e - s) + pair * causal_pairs(s, e)
            kv_read += e
        flops += num_decodes * param + pair * decode_context_total
        bytes_moved = self._weight_bytes + kv_read * self._kv_bytes
        return max(flops / self._flops_per_s, bytes_moved / self._bytes_per_s) + self.preset.step_overhead

    def kv_load_time(self, num_tokens: int, tier: str) -> float:
        """Seconds to bring ``num_tokens`` tokens of KV from ``tier`` into device memory (0 for "GPU")."""
        if num_tokens <= 0:
            return 0.0
        link = self.preset.tier_links.get(tier.upper())
        if link is None:
            raise ValueError(f"no link for tier {tier!r}; known: {', '.join(self.preset.tier_links)}")
        if link.bandwidth == float("inf"):
            return link.latency
        return link.latency + num_tokens * self.model.kv_bytes_per_token / link.bandwidth

    def chunked_prefill_time(self, start: int, end: int, chunk: int | None = None) -> float:
        """Seconds for a lone request to compute ``[start, end)`` in chunks of ``chunk`` tokens, back to back.

        Args:
            start: tokens already cached.
            end: prompt length.
            chunk: per-step token budget; defaults to the preset's ``max_num_batched_tokens``.
        """
        budget = chunk or self.preset.max_num_batched_tokens
        total = 0.0
        for s in range(start, end, budget):
            total += self.prefill_time(s, min(end, s + budget))
        return total

    def cold_prefill_time(self, num_tokens: int, chunk: int | None = None) -> float:
        """TTFT of a lone prompt with nothing cached (the emulated engine's target at low load)."""
        return self.chunked_prefill_time(0, num_tokens, chunk)
