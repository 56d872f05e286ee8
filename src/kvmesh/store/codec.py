# Over 450 lines: one chunk format, its layout, encoder and every check a read makes, kept together so writer and reader cannot drift.
"""Chunk format: a self-describing, checksummed envelope around one chunk's KV.

Layout of an encoded chunk (all integers little-endian)::

    0        4   5   6          10                 10+h              10+h+p     +8       +32
    | "KVMC" | v | f | h (u32)  | header (msgpack) | payload (p bytes) | xxh3_64 | [hmac] |
                 ^   ^                                                 ^          ^
           version   flags (bit 0: HMAC present)          covers every byte   HMAC-SHA256 over
                                                          before it           every byte before it

The checksum covers the header as well as the payload, so a flipped bit anywhere (a dtype, a shape,
a value) is caught. The header names the chunk's group and key, so a chunk read back under another
key (a misplaced file, a swapped Redis value) is rejected too.

Payload by codec (KV arrays are ``(L, 2, H, T, D)``)::

    raw    the array's bytes as given: float32, float16, or bfloat16 carried as uint16 bit patterns
    int8   scales float16 (L, 2, H, T) | codes int8 (L, 2, H, T, D)      x ≈ code * scale
    fp8    scales float16 (L, 2, H, T) | codes fp8-e4m3fn (L, 2, H, T, D) x ≈ e4m3(code) * scale

Quantized codecs use one absmax scale per (layer, K/V, head, token) row, so a chunk is
``D + 2`` bytes per row against ``2 D`` for bf16 (1.94× smaller at D = 64, 1.97× at D = 128).
Decoding restores the dtype recorded in the header.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import overload

import msgspec
import numpy as np
import xxhash

from kvmesh.errors import CorruptChunkError
from kvmesh.store.keys import StoreKey

MAGIC = b"KVMC"
FORMAT_VERSION = 1
FLAG_HMAC = 0x01
_PREFIX = struct.Struct("<4sBBI")
_CHECKSUM = struct.Struct("<Q")
HMAC_BYTES = 32
_COPY_BLOCK = 1 << 20
"""Bytes copied into an encode buffer before they are checksummed: they are still in cache."""
MAX_HEADER_BYTES = 4096

BFLOAT16 = "bfloat16"
KV_DTYPES = ("float32", "float16", BFLOAT16)
_STORAGE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    BFLOAT16: np.dtype("<u2"),
}
_SCALE_DTYPE = np.dtype("<f2")
_SCALE_FLOOR = float(np.finfo(np.float16).tiny)
_INT8_MAX = 127.0
_FP8_MAX = 448.0


class Codec(StrEnum):
    """How a chunk's values are stored."""

    RAW = "raw"
    INT8 = "int8"
    FP8 = "fp8"

    @classmethod
    def parse(cls, value: str) -> Codec:
        """Accept kvmesh names and LMCache's ``remote_serde`` names (naive → raw, cachegen → int8).

        Raises:
            ValueError: an unknown name.
        """
        aliases = {"naive": cls.RAW, "cachegen": cls.INT8, "fp8-e4m3": cls.FP8, "fp8_e4m3": cls.FP8}
        lowered = value.strip().lower()
        if lowered in aliases:
            return aliases[lowered]
        try:
            return cls(lowered)
        except ValueError:
            names = sorted([*(c.value for c in cls), *aliases])
            raise ValueError(f"unknown codec {value!r}; expected one of {names}") from None


class ChunkHeader(msgspec.Struct, array_like=True, frozen=True):
    """Wire header of a chunk (msgpack array; append fields with defaults only)."""

    codec: str
    dtype: str
    """Original KV dtype: "float32", "float16" or "bfloat16"."""
    shape: tuple[int, ...]
    """(L, 2, H, T, D)."""
    num_tokens: int
    group: str
    key: bytes
    payload_len: int


@dataclass(frozen=True, slots=True)
class DecodedChunk:
    """A verified chunk: its header and its KV in the original dtype (bf16 as uint16)."""

    header: ChunkHeader
    kv: np.ndarray

    @property
    def num_tokens(self) -> int:
        return self.header.num_tokens


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(ChunkHeader)


def kv_dtype_name(kv: np.ndarray, declared: str | None = None) -> str:
    """The KV dtype name of ``kv``: float32, float16, or bfloat16 for uint16 bit patterns.

    Raises:
        ValueError: an unsupported dtype, or ``declared`` disagrees with the array.
    """
    name = {"float32": "float32", "float16": "float16", "uint16": BFLOAT16}.get(kv.dtype.name)
    if kv.dtype.name == BFLOAT16:
        name = BFLOAT16
    if name is None:
        raise ValueError(f"KV dtype must be float32, float16 or bfloat16 (as uint16), got {kv.dtype}")
    if declared and declared != name:
        raise ValueError(f"KV array has dtype {kv.dtype} but {declared!r} was declared")
    return name


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) → float32 values."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bit patterns (uint16), rounding to nearest even."""
    u32 = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((u32 >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    return ((u32 + rounding) >> np.uint32(16)).astype(np.uint16)


def _as_float32(kv: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == BFLOAT16:
        return bf16_to_float32(kv.view(np.uint16))
    return kv.astype(np.float32, copy=False)


def _from_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == BFLOAT16:
        return float32_to_bf16(values)
    return values.astype(dtype, copy=False)


def _fp8_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn codes (0x7F / 0xFF are NaN and never produced)."""
    codes = np.arange(128)
    exp, man = codes >> 3, codes & 7
    subnormal = man / 8.0 * 2.0**-6
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    pos = np.where(exp == 0, subnormal, normal).astype(np.float32)
    pos[127] = np.nan
    return np.concatenate([pos, -pos]).astype(np.float32)


_FP8_VALUES = _fp8_table()


def _fp8_encode(y: np.ndarray) -> np.ndarray:
    """Round ``y`` (float32, |y| ≤ 448) to the nearest e4m3fn code, ties to even.

    Normal values round the float32 bit pattern at mantissa bit 20 and rebias the exponent
    (127 → 7); values below 2^-6 are e4m3 subnormals, multiples of 2^-9.
    """
    bits = np.ascontiguousarray(y, dtype=np.float32).view(np.uint32)
    sign = (bits >> np.uint32(24)) & np.uint32(0x80)
    mag_bits = bits & np.uint32(0x7FFFFFFF)
    rounded = (mag_bits + np.uint32(0x7FFFF) + ((mag_bits >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)
    normal = rounded.view(np.int32) - np.int32(120 << 3)
    mag = mag_bits.view(np.float32)
    sub = np.rint(mag * np.float32(512.0)).astype(np.int32)
    code = np.where(mag < np.float32(2.0**-6), sub, normal)
    np.clip(code, 0, 126, out=code)
    code |= sign.view(np.int32)
    return code.astype(np.uint8)


def _row_scales(values: np.ndarray, qmax: float) -> np.ndarray:
    absmax = np.max(np.abs(values), axis=-1)
    if not np.all(np.isfinite(absmax)):
        raise ValueError("KV contains non-finite values; only the raw codec can store them")
    return np.maximum(absmax / np.float32(qmax), np.float32(_SCALE_FLOOR)).astype(_SCALE_DTYPE)


def _quantize(kv: np.ndarray, dtype: str, codec: Codec) -> tuple[np.ndarray, np.ndarray]:
    """Scales (L, 2, H, T) and codes (L, 2, H, T, D), one layer at a time (cache-sized blocks)."""
    qmax = _INT8_MAX if codec is Codec.INT8 else _FP8_MAX
    scales = np.empty(kv.shape[:-1], dtype=_SCALE_DTYPE)
    codes = np.empty(kv.shape, dtype=np.int8 if codec is Codec.INT8 else np.uint8)
    for layer in range(kv.shape[0]):
        values = _as_float32(kv[layer], dtype)
        layer_scales = _row_scales(values, qmax)
        scales[layer] = layer_scales
        scaled = values / layer_scales.astype(np.float32)[..., None]
        if codec is Codec.INT8:
            np.rint(scaled, out=scaled)
            np.clip(scaled, -_INT8_MAX, _INT8_MAX, out=scaled)
            codes[layer] = scaled
        else:
            np.clip(scaled, -_FP8_MAX, _FP8_MAX, out=scaled)
            codes[layer] = _fp8_encode(scaled)
    return scales, codes


def _dequantize(payload: memoryview, header: ChunkHeader, codec: Codec) -> np.ndarray:
    shape = header.shape
    n_rows = int(np.prod(shape[:-1]))
    scale_bytes = n_rows * _SCALE_DTYPE.itemsize
    scales = np.frombuffer(payload[:scale_bytes], dtype=_SCALE_DTYPE).reshape(shape[:-1])
    code_dtype = np.int8 if codec is Codec.INT8 else np.uint8
    codes = np.frombuffer(payload[scale_bytes:], dtype=code_dtype).reshape(shape)
    out = np.empty(shape, dtype=_STORAGE_DTYPES[header.dtype])
    values = np.empty(shape[1:], dtype=np.float32)
    for layer in range(shape[0]):
        if codec is Codec.INT8:
            values[...] = codes[layer]
        else:
            np.take(_FP8_VALUES, codes[layer], out=values)
        values *= scales[layer].astype(np.float32)[..., None]
        out[layer] = _from_float32(values, header.dtype)
    return out


def _expected_payload_len(header: ChunkHeader, codec: Codec) -> int:
    n_elems = int(np.prod(header.shape))
    if codec is Codec.RAW:
        return n_elems * _STORAGE_DTYPES[header.dtype].itemsize
    return n_elems + (n_elems // header.shape[-1]) * _SCALE_DTYPE.itemsize


class ChunkCodec:
    """Encodes and verifies chunks.

    Args:
        codec: how values are stored on write; any codec is accepted on read.
        hmac_key: fleet key; when set, every chunk written carries an HMAC-SHA256 tag and every
            chunk read must carry a valid one.
    """

    def __init__(self, codec: Codec | str = Codec.RAW, hmac_key: bytes | None = None) -> None:
        self.codec = Codec.parse(codec) if isinstance(codec, str) else codec
        self.hmac_key = hmac_key or None

    @overload
    def encode(self, key: StoreKey, kv: np.ndarray, dtype: str | None = None) -> bytes: ...

    @overload
    def encode(
        self, key: StoreKey, kv: np.ndarray, dtype: str | None = None, *, into: Callable[[int], bytearray]
    ) -> bytearray: ...

    @overload
    def encode(
        self,
        key: StoreKey,
        kv: np.ndarray,
        dtype: str | None = None,
        *,
        into: Callable[[int], bytearray] | None,
    ) -> bytes | bytearray: ...

    def encode(
        self,
        key: StoreKey,
        kv: np.ndarray,
        dtype: str | None = None,
        *,
        into: Callable[[int], bytearray] | None = None,
    ) -> bytes | bytearray:
        """Encode one chunk.

        Args:
            key: the chunk's store key (recorded in the header).
            kv: KV of the chunk, shape (L, 2, H, T, D).
            dtype: the KV dtype name; required to tell bfloat16 from other uint16 data only when
                the caller wants it checked, otherwise inferred (uint16 means bfloat16).
            into: gives a writable buffer of the encoded size (the RAM tier's recycled buffers,
                :class:`~kvmesh.store.chunk_buffers.ChunkBuffers`); the chunk is written there in
                one pass, each block checksummed while the copy still has it in cache, and that
                buffer is returned. Without it the chunk is a new ``bytes``.

        Raises:
            ValueError: wrong rank or dtype, or non-finite values with a quantized codec.
        """
        if kv.ndim != 5 or kv.shape[1] != 2:
            raise ValueError(f"KV must be shaped (L, 2, H, T, D), got {kv.shape}")
        name = kv_dtype_name(kv, dtype)
        if self.codec is Codec.RAW:
            payload_parts: list[memoryview] = [
                np.ascontiguousarray(
                    kv.view(_STORAGE_DTYPES[name]) if name == BFLOAT16 else kv, dtype=_STORAGE_DTYPES[name]
                ).data.cast("B")
            ]
        else:
            scales, codes = _quantize(kv, name, self.codec)
            payload_parts = [scales.data.cast("B"), codes.data.cast("B")]
        payload_len = sum(len(p) for p in payload_parts)
        header = ChunkHeader(
            codec=self.codec.value,
            dtype=name,
            shape=tuple(int(s) for s in kv.shape),
            num_tokens=int(kv.shape[3]),
            group=key.group,
            key=bytes(key.chunk),
            payload_len=payload_len,
        )
        header_bytes = _header_encoder.encode(header)
        flags = FLAG_HMAC if self.hmac_key else 0
        prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, flags, len(header_bytes))
        parts: list[bytes | memoryview] = [prefix, header_bytes, *payload_parts]
        if into is not None:
            return self._encode_into(into, parts, payload_len)
        digest = xxhash.xxh3_64()
        mac = hmac.new(self.hmac_key, digestmod=hashlib.sha256) if self.hmac_key else None
        for part in parts:
            digest.update(part)
            if mac is not None:
                mac.update(part)
        checksum = _CHECKSUM.pack(digest.intdigest())
        parts.append(checksum)
        if mac is not None:
            mac.update(checksum)
            parts.append(mac.digest())
        return b"".join(parts)

    def _encode_into(
        self, into: Callable[[int], bytearray], parts: list[bytes | memoryview], payload_len: int
    ) -> bytearray:
        body_len = sum(len(p) for p in parts)
        tag_len = HMAC_BYTES if self.hmac_key else 0
        buf = into(body_len + _CHECKSUM.size + tag_len)
        if len(buf) != body_len + _CHECKSUM.size + tag_len:
            raise ValueError(
                f"encode buffer is {len(buf)} bytes, the chunk {body_len + _CHECKSUM.size + tag_len}"
            )
        out = memoryview(buf)
        digest = xxhash.xxh3_64()
        pos = 0
        for part in parts:
            n = len(part)
            for start in range(0, n, _COPY_BLOCK):
                end = min(start + _COPY_BLOCK, n)
                block = out[pos + start : pos + end]
                block[:] = part[start:end]
                digest.update(block)
            pos += n
        _CHECKSUM.pack_into(buf, body_len, digest.intdigest())
        if self.hmac_key:
            mac = hmac.new(self.hmac_key, out[: body_len + _CHECKSUM.size], hashlib.sha256)
            out[body_len + _CHECKSUM.size :] = mac.digest()
        return buf

    def read_header(self, data: bytes | bytearray | memoryview) -> ChunkHeader:
        """Parse the header without verifying the payload (for tools that list chunks).

        Raises:
            CorruptChunkError: not a chunk, or an unreadable header.
        """
        header, _, _ = self._parse(memoryview(data))
        return header

    def decode(self, data: bytes | bytearray | memoryview, expected: StoreKey | None = None) -> DecodedChunk:
        """Verify and decode one chunk.

        For the raw codec the returned array is a read-only view of ``data`` (no copy).

        Args:
            data: the encoded chunk.
            expected: the key it was read under; a header naming another key is corrupt.

        Raises:
            CorruptChunkError: bad magic or version, truncation, checksum or HMAC mismatch,
                a header that contradicts itself, or a key other than ``expected``.
        """
        view = memoryview(data).toreadonly()
        header, payload_start, flags = self._parse(view)
        body_end = payload_start + header.payload_len
        tag_len = HMAC_BYTES if flags & FLAG_HMAC else 0
        if len(view) != body_end + _CHECKSUM.size + tag_len:
            raise CorruptChunkError(
                f"chunk is {len(view)} bytes, header promises {body_end + _CHECKSUM.size + tag_len}"
            )
        (stored_sum,) = _CHECKSUM.unpack(view[body_end : body_end + _CHECKSUM.size])
        if xxhash.xxh3_64_intdigest(view[:body_end]) != stored_sum:
            raise CorruptChunkError("chunk checksum mismatch")
        if self.hmac_key is not None:
            if not tag_len:
                raise CorruptChunkError("chunk carries no HMAC but a fleet key is configured")
            expected_tag = hmac.new(self.hmac_key, view[: body_end + _CHECKSUM.size], hashlib.sha256)
            if not hmac.compare_digest(expected_tag.digest(), bytes(view[body_end + _CHECKSUM.size :])):
                raise CorruptChunkError("chunk HMAC mismatch (wrong fleet key or tampered chunk)")
        if expected is not None and (header.group != expected.group or header.key != expected.chunk):
            raise CorruptChunkError("chunk header names another key than the one it was read under")
        codec = Codec(header.codec)
        payload = view[payload_start:body_end]
        if codec is Codec.RAW:
            kv = np.frombuffer(payload, dtype=_STORAGE_DTYPES[header.dtype]).reshape(header.shape)
        else:
            kv = _dequantize(payload, header, codec)
        return DecodedChunk(header, kv)

    @staticmethod
    def _parse(view: memoryview) -> tuple[ChunkHeader, int, int]:
        if len(view) < _PREFIX.size:
            raise CorruptChunkError(f"chunk truncated to {len(view)} bytes")
        magic, version, flags, header_len = _PREFIX.unpack(view[: _PREFIX.size])
        if magic != MAGIC:
            raise CorruptChunkError(f"bad chunk magic {bytes(magic)!r}")
        if version != FORMAT_VERSION:
            raise CorruptChunkError(f"unsupported chunk format version {version}")
        if flags & ~FLAG_HMAC:
            raise CorruptChunkError(f"unknown chunk flags {flags:#x}")
        if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len > len(view):
            raise CorruptChunkError(f"chunk header length {header_len} out of range")
        try:
            header = _header_decoder.decode(view[_PREFIX.size : _PREFIX.size + header_len])
            codec = Codec(header.codec)
        except (msgspec.DecodeError, ValueError) as exc:
            raise CorruptChunkError(f"unreadable chunk header: {exc}") from exc
        shape = header.shape
        if header.dtype not in _STORAGE_DTYPES or len(shape) != 5 or shape[1] != 2 or min(shape) <= 0:
            raise CorruptChunkError(f"chunk header has dtype {header.dtype!r} and shape {shape}")
        if header.num_tokens != shape[3] or header.payload_len != _expected_payload_len(header, codec):
            raise CorruptChunkError("chunk header sizes contradict each other")
        return header, _PREFIX.size + header_len, flags


def encoded_size(shape: tuple[int, ...], dtype: str, codec: Codec, *, with_hmac: bool = False) -> int:
    """Bytes of an encoded chunk's payload plus fixed framing (header size excluded)."""
    n_elems = int(np.prod(shape))
    if codec is Codec.RAW:
        payload = n_elems * _STORAGE_DTYPES[dtype].itemsize
    else:
        payload = n_elems + (n_elems // shape[-1]) * _SCALE_DTYPE.itemsize
    return _PREFIX.size + payload + _CHECKSUM.size + (HMAC_BYTES if with_hmac else 0)
