# Over 450 lines: one runner owns the model, its worker thread and every sequence's KV; prefill, decode and KV export all work on that state.
"""TorchRunner: a ModelRunner that computes real KV with a Hugging Face causal LM (CPU or CUDA).

Each sequence owns a transformers ``DynamicCache`` (in ``Sequence.runner_state``). A sequence's first
prefill chunk may start after a cached prefix: its KV, shaped (L, 2, H, T, D), becomes the initial
cache content and only ``token_ids[start:end]`` is run through the model::

    token_ids   [ p0 p1 ... p(start-1) | p(start) ... p(end-1) | ... ]
                  └── cached_kv ───────┘ └── computed now ─────┘
    positions     0 ........ start-1     start ....... end-1

Later chunks continue from the cache; a chunk that ends at ``len(token_ids)`` samples the next token
and reports its logits row. A step's decodes run as one left-padded batch (one pass over the weights
for all of them); each sequence's cache stays its own between steps.

Prefix cap: the last known token is always recomputed, because its logits are needed to sample. A
first chunk whose ``start`` reaches ``len(token_ids)`` (the whole prompt was cached) is moved back to
``len(token_ids) - 1`` and its ``cached_kv`` trimmed to match. Callers should cap cache hits at
``len(prompt) - 1`` tokens themselves; the runner enforces it either way.

Threading: ``execute`` runs the step on one dedicated worker thread, so steps never overlap and the
event loop stays free. ``export_kv`` and ``free`` run on the caller's thread; call them only for
sequences that are not part of the step in flight.

Where KV lives: on the CPU the runner's KV arrays are numpy (:data:`~kvmesh.engine.runner.NUMPY_KV`);
on a GPU they are tensors in device memory (:class:`DeviceKVOps`), so the engine's device tier keeps
cached blocks on the GPU and a hit is a device-side copy. Only the store's traffic crosses the bus:
writes on a worker thread, loads when their request is admitted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvmesh.core.models import resolve_model
from kvmesh.core.tokens import Tokenizer
from kvmesh.core.torch_kv import PinnedStager, from_store_array, store_dtype_name, to_store_array
from kvmesh.engine.runner import (
    NUMPY_KV,
    EngineDefaults,
    KVArray,
    KVLayout,
    KVOps,
    ModelRunner,
    PrefillChunk,
    RunnerInfo,
    Sequence,
    StepOutput,
    StepPlan,
)
from kvmesh.engine.sampling import make_generator, sample_token
from kvmesh.errors import ModelLoadError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
"""Model dtypes by flag value. KV leaves the runner in the model's dtype (bfloat16 as uint16 bit
patterns, :mod:`kvmesh.core.torch_kv`), so a bfloat16 model stores 2 bytes per element and its
chunks share the store namespace of other bfloat16 publishers of the same layout (vLLM's connector)."""


class DeviceKVOps:
    """KV as tensors in one device's memory, in the model's dtype.

    Args:
        device: where the KV lives.
        dtype: the model's KV dtype.
        staged: copy store chunks to a CUDA device through page-locked buffers on a copy stream
            (:class:`~kvmesh.core.torch_kv.PinnedStager`) rather than straight from pageable
            memory; default: on CUDA devices.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, *, staged: bool | None = None) -> None:
        self.device = device
        self.dtype = dtype
        if staged is None:
            staged = device.type == "cuda"
        self._stager = PinnedStager(device) if staged else None

    @property
    def staged(self) -> bool:
        return self._stager is not None

    def copy(self, kv: KVArray) -> KVArray:
        return kv.clone(memory_format=torch.contiguous_format)

    def concat(self, parts: Sequence_[KVArray]) -> KVArray:
        return torch.cat(list(parts), dim=3)

    def to_host(self, kv: KVArray) -> np.ndarray:
        return to_store_array(kv)

    def from_host(self, array: np.ndarray) -> KVArray:
        return from_store_array(array, self.dtype).to(self.device)

    def join_host(self, parts: Sequence_[np.ndarray]) -> KVArray:
        """Each chunk copied into its slice of one device tensor: no joined copy in host memory.

        The result is ready for work queued on the device's current stream after this returns.
        """
        first = parts[0]
        shape = (*first.shape[:3], sum(p.shape[3] for p in parts), first.shape[4])
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        slices = []
        start = 0
        for part in parts:
            slices.append(out[:, :, :, start : start + part.shape[3]])
            start += part.shape[3]
        if self._stager is not None:
            self._stager.copy(parts, slices)
            return out
        for part, dest in zip(parts, slices, strict=True):
            dest.copy_(from_store_array(part, self.dtype))
        return out


@dataclass(slots=True)
class _SeqState:
    cache: Any
    """transformers ``DynamicCache``; its length is the sequence's ``num_computed_tokens``."""
    generator: torch.Generator | None


class TorchRunner:
    """Runs scheduler steps on a transformers causal LM.

    Build one with :meth:`load`; the constructor takes an already loaded model for tests that bring
    their own.
    """

    def __init__(
        self,
        model: Any,
        *,
        model_name: str,
        eos_token_ids: tuple[int, ...],
        max_model_len: int | None = None,
        tokenizer: Tokenizer | None = None,
        keep_decode_logits: bool = False,
        batch_decodes: bool = True,
        tensor_kv: bool | None = None,
    ) -> None:
        """Wrap ``model`` (already on its device, in eval mode).

        Args:
            model: a transformers ``*ForCausalLM`` whose cache is a ``DynamicCache``.
            model_name: served name, reported in ``info``.
            eos_token_ids: ids that end generation (for ``info``; stopping is the scheduler's job).
            max_model_len: longest sequence served; defaults to ``max_position_embeddings``.
            tokenizer: kept as ``self.tokenizer`` for the server; the runner itself only sees ids.
            keep_decode_logits: also report logits rows for decode tokens (prefills always do).
            batch_decodes: run a step's single-token decodes as one padded batch (one pass over
                the weights) instead of one forward per sequence.
            tensor_kv: hand KV to the engine as tensors on the model's device (:class:`DeviceKVOps`)
                rather than numpy; default: on every device but the CPU.
        """
        config = model.config
        self.model = model
        self.config = config
        self.device = next(model.parameters()).device
        self.dtype: torch.dtype = next(model.parameters()).dtype
        if tensor_kv is None:
            tensor_kv = self.device.type != "cpu"
        self.kv_ops: KVOps = DeviceKVOps(self.device, self.dtype) if tensor_kv else NUMPY_KV
        self.tokenizer = tokenizer
        self.keep_decode_logits = keep_decode_logits
        self.batch_decodes = batch_decodes
        positions = int(getattr(config, "max_position_embeddings", 0) or 0)
        limit = max_model_len or positions
        if positions and limit > positions:
            raise ValueError(f"max_model_len {limit} exceeds the model's {positions} positions")
        if limit <= 0:
            raise ValueError("max_model_len is unknown for this model; pass it explicitly")
        num_heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
        self.info = RunnerInfo(
            model_name=model_name,
            max_model_len=limit,
            vocab_size=int(config.vocab_size),
            eos_token_ids=tuple(eos_token_ids),
            kv=KVLayout(
                num_layers=int(config.num_hidden_layers),
                num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
                head_dim=head_dim,
                dtype=store_dtype_name(self.dtype),
            ),
            device=str(self.device),
        )
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmesh-torch")

    @classmethod
    def load(
        cls,
        spec: str | None = None,
        *,
        device: str = "cpu",
        dtype: str | None = None,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        keep_decode_logits: bool = False,
        batch_decodes: bool = True,
        tensor_kv: bool | None = None,
    ) -> TorchRunner:
        """Resolve ``spec`` (see :func:`kvmesh.core.models.resolve_model`) and load it.

        Args:
            spec: model spec; ``None`` is SmolLM2-135M-Instruct.
            device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
            dtype: one of :data:`DTYPES`; default float32 on CPU, bfloat16 on CUDA.
            max_model_len: cap on prompt + output tokens.
            num_threads: intra-op threads for CPU inference (``torch.set_num_threads``, which is
                process-wide). ``None`` on CPU means half the cores, at least one: several replicas
                and their clients usually share a small machine, and oversubscribed OpenMP threads
                slow every step many times over. Ignored on CUDA unless given.
            keep_decode_logits, batch_decodes, tensor_kv: see ``__init__``.

        Raises:
            ModelLoadError: files missing or unreadable, or CUDA requested but unavailable.
            ValueError: unknown dtype.
        """
        dtype_name = dtype or ("float32" if device == "cpu" else "bfloat16")
        if dtype_name not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype_name!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
        if num_threads is None and device == "cpu":
            num_threads = default_num_threads()
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)
        files = resolve_model(spec)
        tokenizer = Tokenizer.from_dir(files.path, name=files.name)
        try:
            from transformers import AutoModelForCausalLM

            model: Any = AutoModelForCausalLM.from_pretrained(
                str(files.path), dtype=DTYPES[dtype_name], local_files_only=True
            )
        except (OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot load model weights from {files.path}: {exc}") from exc
        model.to(device)
        model.eval()
        return cls(
            model,
            model_name=files.name,
            eos_token_ids=tokenizer.eos_token_ids,
            max_model_len=max_model_len,
            tokenizer=tokenizer,
            keep_decode_logits=keep_decode_logits,
            batch_decodes=batch_decodes,
            tensor_kv=tensor_kv,
        )

    async def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step on the worker thread; see :meth:`execute_sync`."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, self.execute_sync, plan)

    def execute_sync(self, plan: StepPlan) -> StepOutput:
        """Run one step on the calling thread (benchmarks and tests; the engine uses ``execute``).

        Every chunk and decode is validated before any is run, so a bad plan changes nothing.

        Raises:
            ValueError: a chunk does not continue its sequence's cache, a decode has no cache or
                nothing to compute, ``cached_kv`` has the wrong shape, or a sequence would exceed
                ``max_model_len``.
        """
        prepared = [self._prepare_prefill(chunk) for chunk in plan.prefills]
        for seq in plan.decodes:
            self._check_decode(seq)
        out = StepOutput()
        with torch.inference_mode():
            for chunk, (start, end, kv) in zip(plan.prefills, prepared, strict=True):
                self._run_prefill(chunk.seq, start, end, kv, out)
            single = [s for s in plan.decodes if _num_pending(s) == 1]
            batched = single if self.batch_decodes and len(single) > 1 else []
            rest = [s for s in plan.decodes if not any(s is b for b in batched)]
            if batched:
                self._run_decode_batch(batched, out)
            for seq in rest:
                self._run_decode(seq, out)
        return out

    def export_kv(self, seq: Sequence, start: int, end: int) -> KVArray | None:
        """A copy of the KV of ``seq.token_ids[start:end]``, (L, 2, H, end-start, D), in :attr:`kv_ops`'
        form: numpy in the store's dtype on the CPU, a tensor in device memory on a GPU.

        Returns:
            ``None`` when the sequence has no runner state (never prefilled, or freed).

        Raises:
            ValueError: the range is empty or reaches past the computed tokens.
        """
        state = seq.runner_state
        if not isinstance(state, _SeqState):
            return None
        computed = state.cache.get_seq_length()
        if not 0 <= start < end <= computed:
            raise ValueError(f"export_kv range [{start}, {end}) outside the {computed} computed tokens")
        per_layer = [
            torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end]))
            for layer in state.cache.layers
        ]
        kv = torch.stack(per_layer)
        return to_store_array(kv) if self.kv_ops is NUMPY_KV else kv

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's cache and random stream."""
        seq.runner_state = None

    def engine_defaults(self) -> EngineDefaults:
        """32k KV tokens, 16 sequences and 2048 tokens a step; the model's own KV format; every
        token streamed as it comes."""
        kv = self.info.kv
        return EngineDefaults(
            kv_capacity_tokens=32_768,
            max_num_seqs=16,
            max_num_batched_tokens=2048,
            stream_interval_s=0.0,
            keeps_kv=True,
            store_kv_dtype=kv.dtype,
            store_kv_layout=kv.name(),
            store_bytes_per_token=kv.bytes_per_token,
        )

    def close(self) -> None:
        """Stop the worker thread (waits for a step in flight)."""
        self._worker.shutdown(wait=True)

    # -- step internals (worker thread) ------------------------------------------------------

    def _prepare_prefill(self, chunk: PrefillChunk) -> tuple[int, int, KVArray | None]:
        """Validate a chunk; return the effective (start, end, prefix kv) after the prefix cap."""
        seq = chunk.seq
        total = len(seq.token_ids)
        start, end = chunk.start, chunk.end
        if end > total:
            raise ValueError(f"{seq.request_id}: chunk end {end} beyond its {total} tokens")
        if end > self.info.max_model_len:
            raise ValueError(f"{seq.request_id}: {end} tokens exceed max_model_len {self.info.max_model_len}")
        if isinstance(seq.runner_state, _SeqState):
            computed = seq.runner_state.cache.get_seq_length()
            if chunk.cached_kv is not None:
                raise ValueError(f"{seq.request_id}: cached_kv given on a continuation chunk")
            if start != computed:
                raise ValueError(
                    f"{seq.request_id}: chunk starts at {start} but {computed} tokens are computed"
                )
            if end <= start:
                raise ValueError(f"{seq.request_id}: empty chunk [{start}, {end})")
            return start, end, None
        if start >= total:  # the whole sequence was cached: recompute its last token
            start, end = total - 1, total
        if end <= start:
            raise ValueError(f"{seq.request_id}: empty chunk [{start}, {end})")
        if start == 0:
            return 0, end, None
        kv = chunk.cached_kv
        if kv is None:
            raise ValueError(f"{seq.request_id}: first chunk starts at {start} without cached_kv")
        layout = self.info.kv
        expected = (layout.num_layers, 2, layout.num_kv_heads, layout.head_dim)
        if kv.ndim != 5 or (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) != expected:
            raise ValueError(
                f"{seq.request_id}: cached_kv shape {kv.shape} does not match the model's "
                f"(L, 2, H, T, D) = ({expected[0]}, 2, {expected[2]}, T, {expected[3]})"
            )
        if isinstance(kv, torch.Tensor):
            if kv.dtype != self.dtype or kv.device != self.device:
                raise ValueError(
                    f"{seq.request_id}: cached_kv is {kv.dtype} on {kv.device}, the model's KV is "
                    f"{self.dtype} on {self.device}"
                )
        else:
            carried = "uint16" if layout.dtype == "bfloat16" else layout.dtype
            if kv.dtype.name != carried:
                raise ValueError(
                    f"{seq.request_id}: cached_kv dtype {kv.dtype} does not match the model's KV "
                    f"({layout.dtype}, carried as {carried})"
                )
        if kv.shape[3] < start:
            raise ValueError(
                f"{seq.request_id}: cached_kv holds {kv.shape[3]} tokens, chunk starts at {start}"
            )
        return start, end, kv[:, :, :, :start]

    def _check_decode(self, seq: Sequence) -> None:
        state = seq.runner_state
        if not isinstance(state, _SeqState):
            raise ValueError(f"{seq.request_id}: decode before its prefill")
        computed = state.cache.get_seq_length()
        if computed >= len(seq.token_ids):
            raise ValueError(f"{seq.request_id}: decode with nothing to compute ({computed} tokens computed)")
        if len(seq.token_ids) > self.info.max_model_len:
            raise ValueError(
                f"{seq.request_id}: {len(seq.token_ids)} tokens exceed max_model_len {self.info.max_model_len}"
            )

    def _new_state(self, seq: Sequence, kv: KVArray | None) -> _SeqState:
        from transformers import DynamicCache

        if kv is None:
            cache = DynamicCache(config=self.config)
        else:
            layers = [
                (self._to_device(kv[layer, 0]), self._to_device(kv[layer, 1])) for layer in range(kv.shape[0])
            ]
            cache = DynamicCache(ddp_cache_data=layers, config=self.config)
        return _SeqState(cache=cache, generator=make_generator(seq.sampling))

    def _to_device(self, array: KVArray) -> torch.Tensor:
        """One layer's K or V, (H, T, D), as a fresh (1, H, T, D) cache tensor on the device."""
        tensor = array if isinstance(array, torch.Tensor) else from_store_array(array, self.dtype)
        return tensor.to(device=self.device).unsqueeze(0).clone(memory_format=torch.contiguous_format)

    def _run_prefill(self, seq: Sequence, start: int, end: int, kv: KVArray | None, out: StepOutput) -> None:
        state = seq.runner_state
        if not isinstance(state, _SeqState):
            state = self._new_state(seq, kv)
            seq.runner_state = state
        logits = self._forward(state, seq.token_ids[start:end])
        seq.num_computed_tokens = end
        if end == len(seq.token_ids):
            out.sampled[seq.request_id] = sample_token(logits, seq.sampling, state.generator)
            out.last_logits[seq.request_id] = logits.to(device="cpu", dtype=torch.float32).numpy()

    def _run_decode(self, seq: Sequence, out: StepOutput) -> None:
        state = seq.runner_state
        assert isinstance(state, _SeqState), "decode validated in execute_sync"
        logits = self._forward(state, seq.token_ids[state.cache.get_seq_length() :])
        seq.num_computed_tokens = len(seq.token_ids)
        out.sampled[seq.request_id] = sample_token(logits, seq.sampling, state.generator)
        if self.keep_decode_logits:
            out.last_logits[seq.request_id] = logits.to(device="cpu", dtype=torch.float32).numpy()

    def _run_decode_batch(self, seqs: list[Sequence], out: StepOutput) -> None:
        """One forward for many single-token decodes, their caches left-padded to a common length::

            row b:  [ 0 ... 0 | k_0 ... k_(n_b - 1) ] + new token at position n_b
                      masked    sequence b's cache

        The new token's K/V is then appended to each sequence's own cache.
        """
        from transformers import DynamicCache

        states = [s.runner_state for s in seqs]
        assert all(isinstance(st, _SeqState) for st in states), "decodes validated in execute_sync"
        lengths = [st.cache.get_seq_length() for st in states]
        width = max(lengths)
        batch, layers = len(seqs), []
        first = states[0].cache.layers[0].keys
        heads, head_dim = first.shape[1], first.shape[3]
        for li in range(len(states[0].cache.layers)):
            keys = torch.zeros((batch, heads, width, head_dim), dtype=first.dtype, device=self.device)
            values = torch.zeros_like(keys)
            for b, (st, n) in enumerate(zip(states, lengths, strict=True)):
                keys[b, :, width - n :] = st.cache.layers[li].keys[0]
                values[b, :, width - n :] = st.cache.layers[li].values[0]
            layers.append((keys, values))
        cache: Any = DynamicCache(ddp_cache_data=layers, config=self.config)
        mask = torch.zeros((batch, width + 1), dtype=torch.long, device=self.device)
        for b, n in enumerate(lengths):
            mask[b, width - n :] = 1
        ids = torch.tensor([[s.token_ids[-1]] for s in seqs], dtype=torch.long, device=self.device)
        positions = torch.tensor([[n] for n in lengths], dtype=torch.long, device=self.device)
        result = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        for b, (seq, st) in enumerate(zip(seqs, states, strict=True)):
            for li, layer in enumerate(st.cache.layers):
                new = cache.layers[li]
                layer.update(new.keys[b : b + 1, :, -1:], new.values[b : b + 1, :, -1:])
            seq.num_computed_tokens = len(seq.token_ids)
            logits = result.logits[b, -1]
            out.sampled[seq.request_id] = sample_token(logits, seq.sampling, st.generator)
            if self.keep_decode_logits:
                out.last_logits[seq.request_id] = logits.to(device="cpu", dtype=torch.float32).numpy()

    def _forward(self, state: _SeqState, token_ids: list[int]) -> torch.Tensor:
        """Append ``token_ids`` to the cache; return the last position's logits row."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        result = self.model(input_ids=ids, past_key_values=state.cache, use_cache=True, logits_to_keep=1)
        return result.logits[0, -1]


def default_num_threads() -> int:
    """CPU threads a replica uses by default: half the cores this process may run on, at least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // 2)


def _num_pending(seq: Sequence) -> int:
    """Tokens of ``seq`` whose KV is not computed yet."""
    state = seq.runner_state
    assert isinstance(state, _SeqState), "decodes validated in execute_sync"
    return len(seq.token_ids) - int(state.cache.get_seq_length())


_conforms: type[ModelRunner] = TorchRunner
