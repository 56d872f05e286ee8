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

# torch warns on every read-only buffer it wraps; host_tensor wraps them on purpose, from worker
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
    """A CPU tensor of ``dtype`` from a store array (uint16 bit patterns when ``dtype`` is bfloat16).

    The tensor shares the array's memory; a read-only array (e.g. ``np.frombuffer`` of bytes) is
    copied first, since torch cannot wrap read-only memory.

    Raises:
        ValueError: the array's dtype cannot hold ``dtype``'s values bit for bit.
    """
    if not array.flags.writeable:
        array = array.copy()
    if dtype == torch.bfloat16:
        if array.dtype != np.uint16:
            raise ValueError(f"bfloat16 KV must arrive as uint16 bit patterns, got {array.dtype}")
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    name = store_dtype_name(dtype)
    if array.dtype.name != name:
        raise ValueError(f"store array is {array.dtype}, the cache is {name}")
    return torch.from_numpy(array)


def host_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``dtype`` over ``array``'s memory, also when the array is read-only.

    Store chunks are read-only views of the bytes a tier returned; :func:`from_store_array` would
    copy them first. A contiguous read-only array is wrapped as it is instead (the tensor must not
    be written to); anything else goes through :func:`from_store_array`.

    Raises:
        ValueError: the array's dtype cannot hold ``dtype``'s values bit for bit.
    """
    if array.flags.writeable or not array.flags.c_contiguous:
        return from_store_array(array, dtype)
    carried = np.uint16 if dtype == torch.bfloat16 else np.dtype(store_dtype_name(dtype))
    if array.dtype != carried:
        raise ValueError(f"store array is {array.dtype}, the cache is {store_dtype_name(dtype)}")
    raw_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    flat = torch.frombuffer(array.data.cast("B"), dtype=raw_dtype)
    return flat.view(dtype).view(array.shape)
