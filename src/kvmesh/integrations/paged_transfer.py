"""Worker-side execution of load and save plans against one paged KV cache.

A :class:`PagedKVTransfer` owns nothing but references: the engine's per-layer cache tensors and
a :class:`~kvmesh.integrations.store_bridge.StoreBridge`. Loads block (bounded by the bridge's
timeout) and write straight into the request's blocks, chunk by chunk as the store read them (no
joined copy in host memory; chunks before the span vLLM asks for are not copied at all; on a CUDA
cache through page-locked buffers, :class:`~kvmesh.core.torch_kv.PinnedStager`); blocks the store
could not fill are returned so the engine recomputes them. Saves copy the KV out of the blocks
before returning, so the engine may reuse the blocks at once, and hand the copy to the bridge; on
a CUDA cache through page-locked buffers on a stream of their own, ordered after the engine's work
by a :meth:`PagedKVTransfer.fence` the engine thread took.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.core.torch_kv import PinnedStager, from_store_array, to_store_array
from kvmesh.integrations.paged_kv import PagedGeometry, gather, picked_layers, scatter, token_slots
from kvmesh.integrations.request_tracker import LoadSpec, SaveSpec
from kvmesh.integrations.store_bridge import StoreBridge
from kvmesh.store.cache_engine import PrefixWritten

BACKGROUND_LOAD_MIB_PER_S = 50.0
"""The slowest a background load may read before it counts as failed: a 2 GiB prefix gets 41 s more
than the fixed retrieve timeout. Nothing but the request itself waits for it."""

LOAD_BATCH_BYTES = 256 << 20
"""Loaded chunks staged on the device at once before they are scattered into their blocks: the
rest of the device belongs to the engine's own cache."""


def _batches(
    pieces: list[tuple[int, int, np.ndarray]], max_bytes: int
) -> Iterator[list[tuple[int, int, np.ndarray]]]:
    batch: list[tuple[int, int, np.ndarray]] = []
    size = 0
    for piece in pieces:
        if batch and size + piece[2].nbytes > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(piece)
        size += piece[2].nbytes
    if batch:
        yield batch


@dataclass(slots=True)
class TransferStats:
    """Token counters of one :class:`PagedKVTransfer`."""

    num_loaded_tokens: int = 0
    num_failed_load_tokens: int = 0
    num_saved_tokens: int = 0
    num_refused_save_tokens: int = 0


class PagedKVTransfer:
    """Loads and saves request KV between a paged cache and the store.

    Args:
        layers: the cache, one tensor per attention layer in model order, all of ``geometry``.
        geometry: the layers' shape.
        bridge: the store.
        background: loads run off the engine's step (a transfer used by a thread other than the
            engine's): on a CUDA cache on a stream of their own, waited for before they return; and
            a load may take the store's retrieve timeout plus its size at
            :data:`BACKGROUND_LOAD_MIB_PER_S`, since no step waits for it. The engine's thread leaves
            it off: its loads feed the forward pass queued after them and keep the fixed timeout.
    """

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        geometry: PagedGeometry,
        bridge: StoreBridge,
        *,
        background: bool = False,
    ) -> None:
        self.layers = list(layers)
        self.geometry = geometry
        self.bridge = bridge
        self.stats = TransferStats()
        device = self.layers[0].device if self.layers else torch.device("cpu")
        self._stager = PinnedStager(device) if device.type == "cuda" else None
        self._save_stager = PinnedStager(device) if device.type == "cuda" else None
        self.background = background
        self._own_stream = torch.cuda.Stream(device) if background and device.type == "cuda" else None

    def fence(self) -> torch.cuda.Event | None:
        """On a CUDA cache, an event marking the engine's work queued so far (pass it to
        :meth:`save` as ``after`` when the save runs on another thread); ``None`` on the CPU, where
        the step's writes are done when it returns."""
        return None if self._save_stager is None else self._save_stager.fence()

    def load(self, spec: LoadSpec) -> set[int]:
        """Fill tokens ``spec.start..spec.end-1`` from the store.

        Off the engine's thread (a background load) on a CUDA cache, the copies run on a stream of
        this transfer's own and are complete when this returns.

        Returns:
            Block ids that were not filled (empty when the whole range loaded); the engine must
            recompute them.
        """
        if spec.end <= spec.start:
            return set()
        if self._own_stream is None:
            return self._load(spec)
        with torch.cuda.stream(self._own_stream):
            failed = self._load(spec)
        self._own_stream.synchronize()
        return failed

    def blocks_of(self, spec: LoadSpec) -> set[int]:
        """The block ids ``spec`` writes."""
        if spec.end <= spec.start:
            return set()
        bs = self.geometry.block_size
        return set(spec.block_ids[spec.start // bs : (spec.end - 1) // bs + 1])

    def _load(self, spec: LoadSpec) -> set[int]:
        timeout_s = None
        if self.background:
            g = self.geometry
            num_bytes = (
                len(spec.token_ids) * 2 * len(self.layers) * g.num_kv_heads * g.head_dim * g.dtype.itemsize
            )
            timeout_s = self.bridge.retrieve_timeout_s + num_bytes / (1 << 20) / BACKGROUND_LOAD_MIB_PER_S
        result = self.bridge.retrieve(
            spec.token_ids, spec.namespace, max_tokens=len(spec.token_ids), join=False, timeout_s=timeout_s
        )
        got = self._scatter_loaded(spec, result.parts) if result.parts else 0
        if got < spec.end:
            self.stats.num_failed_load_tokens += spec.end - max(got, spec.start)
            partial = dataclasses.replace(spec, start=max(got, spec.start))
            return self.blocks_of(partial)
        return set()

    def _scatter_loaded(self, spec: LoadSpec, parts: Sequence[np.ndarray]) -> int:
        """Write what ``parts`` (consecutive chunks from token 0) hold of the span; returns the tokens
        now valid from 0 (block-aligned at a partial load, so a block is never half-written and
        reported as good)."""
        g = self.geometry
        want = (len(self.layers), 2, g.num_kv_heads, g.head_dim)
        if any(p.ndim != 5 or (p.shape[0], p.shape[1], p.shape[2], p.shape[4]) != want for p in parts):
            return 0
        end = min(sum(p.shape[3] for p in parts), spec.end)
        if end < spec.end:
            end -= end % g.block_size
        if end <= spec.start:
            return 0
        pieces: list[tuple[int, int, np.ndarray]] = []
        first = 0
        for part in parts:
            last = first + part.shape[3]
            lo, hi = max(first, spec.start), min(last, end)
            if lo < hi:
                pieces.append((lo, hi, part[:, :, :, lo - first : hi - first, :]))
            if last >= end:
                break
            first = last
        for batch in _batches(pieces, LOAD_BATCH_BYTES):
            if self._stager is not None:
                device = self.layers[0].device
                values = [torch.empty(p.shape, dtype=g.dtype, device=device) for _, _, p in batch]
                self._stager.copy([p for _, _, p in batch], values)
            else:
                values = [from_store_array(p, g.dtype) for _, _, p in batch]
            for (lo, hi, _), piece in zip(batch, values, strict=True):
                scatter(self.layers, g, token_slots(spec.block_ids, g.block_size, lo, hi), piece)
        self.stats.num_loaded_tokens += end - spec.start
        return end

    def save(
        self,
        spec: SaveSpec,
        on_written: PrefixWritten | None = None,
        after: torch.cuda.Event | None = None,
    ) -> bool:
        """Copy the KV of the chunks after ``spec.skip_tokens`` out of the cache and start storing it.

        On a CUDA cache the gather and the device-to-host copy run on a stream of their own through
        page-locked buffers, never on the engine's stream; the call returns once the KV is in host
        memory (the store writes it on its own threads).

        Args:
            spec: what to save.
            on_written: told how far the prompt reaches in each tier the write landed in.
            after: :meth:`fence` taken on the engine's thread when the KV was complete.

        Returns:
            ``False`` when the store refused the save (too many in flight, closed).
        """
        if spec.end <= spec.skip_tokens:
            # Nothing to write; a pin of chunks stored before still goes to the store.
            return (
                spec.pin_ttl_s is None
                or spec.end == 0
                or self.bridge.pin(spec.token_ids[: spec.end], spec.namespace, spec.pin_ttl_s)
            )
        g = self.geometry
        start = spec.skip_tokens - spec.skip_tokens % self.bridge.chunk_size
        slots = token_slots(spec.block_ids, g.block_size, start, spec.end)
        # The store encodes only chunks past skip_tokens; tokens before ``start`` are never read.
        kv = torch.empty((len(self.layers), 2, g.num_kv_heads, spec.end, g.head_dim), dtype=g.dtype)
        if self._save_stager is None:
            gather(self.layers, g, slots, out=kv[:, :, :, start:, :])
        else:
            tail = kv[:, :, :, start:, :]
            self._save_stager.copy_out(picked_layers(self.layers, g, slots), list(tail), after=after)
        kv_array = to_store_array(kv)
        ok = self.bridge.save(
            spec.token_ids[: spec.end],
            spec.namespace,
            kv_array,
            skip_tokens=spec.skip_tokens,
            on_written=on_written,
            pin_ttl_s=spec.pin_ttl_s,
        )
        if ok:
            self.stats.num_saved_tokens += spec.end - start
        else:
            self.stats.num_refused_save_tokens += spec.end - start
        return ok
