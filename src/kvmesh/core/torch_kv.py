"""KV tensors ⇄ the store's numpy arrays, bit for bit.

The store carries KV as numpy arrays shaped ``(L, 2, H, T, D)`` in float32, float16 or bfloat16;
numpy has no bfloat16, so bfloat16 travels as its uint16 bit patterns. Every torch-side producer
and consumer of store arrays (the reference engine's runner, the vLLM connector) converts here, so
a bfloat16 model's KV is stored at 2 bytes per element and reads back unchanged.
"""

from __future__ import annotations

import warnings

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
