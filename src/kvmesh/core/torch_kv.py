"""KV tensors ⇄ the store's numpy arrays, bit for bit.

The store carries KV as numpy arrays shaped ``(L, 2, H, T, D)`` in float32, float16 or bfloat16;
numpy has no bfloat16, so bfloat16 travels as its uint16 bit patterns. Every torch-side producer
and consumer of store arrays (the reference engine's runner, the vLLM connector) converts here, so
a bfloat16 model's KV is stored at 2 bytes per element and reads back unchanged, and both move
loaded chunks to a GPU through :class:`PinnedStager`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence

import numpy as np
import torch

# torch warns on every read-only buffer it wraps; from_store_array wraps them on purpose, from worker
# threads (catch_warnings is not thread-safe, so the filter is set once, for that message alone).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

_STORE_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


def store_dtype_name(dtype: torch.dtype) -> str:
    """The store's KV dtype name for a torch dtype.

    Raises:
        ValueError: a dtype the store cannot carry (e.g. an fp8 KV cache).
    """
    name = _STORE_DTYPES.get(dtype)
    if name is None:
        raise ValueError(f"KV cache dtype must be float32, float16 or bfloat16, got {dtype}")
    return name


def to_store_array(kv: torch.Tensor) -> np.ndarray:
    """A CPU numpy array of ``kv`` in the store's dtype (bfloat16 → uint16 bit patterns)."""
    kv = kv.detach().to("cpu").contiguous()
    if kv.dtype == torch.bfloat16:
        return kv.view(torch.int16).numpy().view(np.uint16)
    store_dtype_name(kv.dtype)
    return kv.numpy()


def from_store_array(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``dtype`` over a store array (uint16 bit patterns when ``dtype`` is bfloat16).

    The tensor shares the array's memory, read-only memory included: store chunks are read-only
    views of the bytes a tier returned, and a contiguous one is wrapped where it lies, not copied
    (never write to the tensor). Only a read-only array that is not contiguous is copied first.

    Raises:
        ValueError: the array's dtype cannot hold ``dtype``'s values bit for bit.
    """
    if dtype == torch.bfloat16:
        if array.dtype != np.uint16:
            raise ValueError(f"bfloat16 KV must arrive as uint16 bit patterns, got {array.dtype}")
        raw_np, raw_torch = np.dtype(np.int16), torch.int16
    else:
        name = store_dtype_name(dtype)
        if array.dtype.name != name:
            raise ValueError(f"store array is {array.dtype}, the cache is {name}")
        raw_np, raw_torch = array.dtype, dtype
    if array.flags.writeable:
        return torch.from_numpy(array.view(raw_np)).view(dtype)
    if not array.flags.c_contiguous:
        return torch.from_numpy(array.astype(raw_np, copy=True)).view(dtype)
    flat = torch.frombuffer(array.data.cast("B"), dtype=raw_torch)
    return flat.view(dtype).view(array.shape)


class PinnedStager:
    """Copies store arrays into CUDA tensors, and CUDA tensors out to host memory, through two reused
    page-locked buffers, on a stream of its own.

    A copy from pageable memory runs at a fraction of the link's speed (the driver stages it
    through a small pinned buffer and waits for each piece); here the host copy of one array into
    one buffer overlaps the DMA out of the other. On an H200, 2 GiB of chunks: 0.047 s, against
    0.261 s from pageable memory. Not thread-safe: one stager per thread that loads, and another per
    thread that saves.

    Args:
        device: the CUDA device the tensors live on.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"staged copies need a CUDA device, got {device}")
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        self._buffers: list[torch.Tensor] = []
        self._done: list[torch.cuda.Event] = []

    def copy(self, arrays: Sequence[np.ndarray], dests: Sequence[torch.Tensor]) -> None:
        """Copy each store array into its device tensor (same shape, the tensor's dtype, any strides).

        Work queued on the device's current stream after this returns sees the copies done.

        Raises:
            ValueError: an array cannot hold its destination's dtype bit for bit.
        """
        if not arrays:
            return
        largest = max(a.nbytes for a in arrays)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
            self._done = [torch.cuda.Event(), torch.cuda.Event()]
        if not self._buffers or self._buffers[0].numel() < largest:
            for event in self._done:
                event.synchronize()
            self._buffers = [torch.empty(largest, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        stream = self._stream
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)  # the destinations may have been allocated on the current stream
        try:
            with torch.cuda.stream(stream):
                for n, (array, dest) in enumerate(zip(arrays, dests, strict=True)):
                    slot = n % 2
                    self._done[slot].synchronize()  # the DMA out of this buffer has finished
                    host = from_store_array(array, dest.dtype)
                    staged = self._buffers[slot][: array.nbytes].view(dest.dtype).view(host.shape)
                    staged.copy_(host)
                    dest.copy_(staged, non_blocking=True)
                    self._done[slot].record(stream)
                    dest.record_stream(stream)
        finally:
            current.wait_stream(stream)  # copies queued before a failure are ordered all the same

    def fence(self) -> torch.cuda.Event:
        """An event marking the work queued so far on the device's current stream: a copy-out started
        later, from any thread, with ``after=`` this event reads what that work wrote."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy_out(
        self,
        sources: Iterable[torch.Tensor],
        dests: Sequence[torch.Tensor],
        after: torch.cuda.Event | None = None,
    ) -> None:
        """Copy each device tensor ``sources`` yields into its host tensor of ``dests`` (same shape and
        dtype; any strides) and return once all are there.

        ``sources`` is drawn on the stager's stream after ``after``, so a lazy producer (a gather out
        of the paged cache) queues its kernels there and never on the engine's stream; the DMA of one
        source into one buffer overlaps the host copy of the previous one out of the other.
        """
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
            self._done = [torch.cuda.Event(), torch.cuda.Event()]
        stream = self._stream
        waiting: tuple[int, torch.Tensor, torch.Tensor] | None = None
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            for n, source in enumerate(sources):
                dest = dests[n]
                if tuple(source.shape) != tuple(dest.shape) or source.dtype != dest.dtype:
                    raise ValueError(
                        f"source {n} is {list(source.shape)} {source.dtype}, its destination "
                        f"{list(dest.shape)} {dest.dtype}"
                    )
                nbytes = source.numel() * source.element_size()
                slot = n % 2
                if not self._buffers or self._buffers[slot].numel() < nbytes:
                    self._grow(nbytes)
                staged = self._buffers[slot][:nbytes].view(source.dtype).view(source.shape)
                staged.copy_(source, non_blocking=True)
                self._done[slot].record(stream)
                if waiting is not None:
                    self._drain(*waiting)
                waiting = (slot, staged, dest)
            if waiting is not None:
                self._drain(*waiting)

    def _drain(self, slot: int, staged: torch.Tensor, dest: torch.Tensor) -> None:
        self._done[slot].synchronize()
        dest.copy_(staged)

    def _grow(self, nbytes: int) -> None:
        # Both buffers may hold a copy in flight: wait for them before they are replaced.
        for event in self._done:
            event.synchronize()
        size = max(nbytes, self._buffers[0].numel() if self._buffers else 0)
        self._buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
