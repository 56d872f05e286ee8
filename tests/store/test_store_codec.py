"""Chunk codec: round trips, quantization error and size, and rejection of every corruption."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from store_helpers import make_key

from kvmesh.errors import CorruptChunkError
from kvmesh.store.codec import (
    BFLOAT16,
    ChunkCodec,
    Codec,
    bf16_to_float32,
    float32_to_bf16,
)

SHAPE = (2, 2, 3, 16, 64)
KEY = make_key(5)


def _kv(dtype: str, shape: tuple[int, ...] = SHAPE, seed: int = 0) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if dtype == BFLOAT16:
        return float32_to_bf16(values)
    return values.astype(dtype)


def _as_f32(kv: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_to_float32(kv) if dtype == BFLOAT16 else kv.astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16", BFLOAT16])
def test_raw_roundtrip_is_bit_exact(dtype: str) -> None:
    kv = _kv(dtype)
    codec = ChunkCodec(Codec.RAW)
    decoded = codec.decode(codec.encode(KEY, kv), expected=KEY)
    assert decoded.kv.dtype == kv.dtype
    assert decoded.kv.shape == SHAPE
    assert decoded.header.dtype == dtype
    assert decoded.num_tokens == 16
    np.testing.assert_array_equal(decoded.kv, kv)


@pytest.mark.parametrize("codec_name", [Codec.INT8, Codec.FP8])
@pytest.mark.parametrize("dtype", ["float32", "float16", BFLOAT16])
def test_quantized_roundtrip_error_is_bounded(codec_name: Codec, dtype: str) -> None:
    kv = _kv(dtype)
    codec = ChunkCodec(codec_name)
    decoded = codec.decode(codec.encode(KEY, kv), expected=KEY)
    assert decoded.kv.dtype == kv.dtype
    original = _as_f32(kv, dtype)
    restored = _as_f32(decoded.kv, dtype)
    absmax = np.max(np.abs(original), axis=-1, keepdims=True)
    rel = np.abs(restored - original) / absmax
    # int8 rounds to 1/254 of the row absmax; e4m3 keeps 3 mantissa bits (relative step 1/16).
    bound = 1 / 254 + 1e-3 if codec_name is Codec.INT8 else 1 / 16 + 1e-3
    if dtype != "float32":
        bound += 1 / 128  # re-rounding to the 7/10-bit mantissa of bf16/fp16
    assert float(rel.max()) <= bound


@pytest.mark.parametrize("codec_name", [Codec.INT8, Codec.FP8])
def test_quantized_chunks_are_at_least_1_9x_smaller_than_bf16(codec_name: Codec) -> None:
    kv = _kv(BFLOAT16, (4, 2, 8, 256, 64))
    raw = ChunkCodec(Codec.RAW).encode(KEY, kv)
    quantized = ChunkCodec(codec_name).encode(KEY, kv)
    assert len(raw) / len(quantized) >= 1.9


def test_fp8_encodes_exact_e4m3_values_exactly() -> None:
    values = np.array([0.0, 448.0, -448.0, 1.0, -2.5, 0.001953125, 0.015625, 240.0], dtype=np.float32)
    kv = np.tile(values, (1, 2, 1, 1, 1)).reshape(1, 2, 1, 1, 8)
    kv[..., 1] = 448.0  # make the row absmax 448 so the scale is exactly 1
    codec = ChunkCodec(Codec.FP8)
    out = codec.decode(codec.encode(KEY, kv)).kv
    np.testing.assert_array_equal(out, kv)


def test_quantized_codec_rejects_non_finite_values() -> None:
    kv = _kv("float32")
    kv[0, 0, 0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        ChunkCodec(Codec.INT8).encode(KEY, kv)


def test_bad_shapes_and_dtypes_are_caller_errors() -> None:
    codec = ChunkCodec()
    with pytest.raises(ValueError, match="shaped"):
        codec.encode(KEY, np.zeros((2, 3, 4), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        codec.encode(KEY, np.zeros((1, 2, 1, 1, 4), np.int32))


def test_codec_names_accept_lmcache_serde() -> None:
    assert Codec.parse("naive") is Codec.RAW
    assert Codec.parse("cachegen") is Codec.INT8
    assert Codec.parse("FP8") is Codec.FP8
    with pytest.raises(ValueError, match="unknown codec"):
        Codec.parse("zstd")


def test_key_mismatch_is_corrupt() -> None:
    codec = ChunkCodec()
    data = codec.encode(KEY, _kv("float32"))
    with pytest.raises(CorruptChunkError, match="another key"):
        codec.decode(data, expected=make_key(6))


def test_hmac_verifies_and_rejects_wrong_or_missing_key() -> None:
    kv = _kv("float16")
    signed = ChunkCodec(hmac_key=b"fleet-key").encode(KEY, kv)
    np.testing.assert_array_equal(ChunkCodec(hmac_key=b"fleet-key").decode(signed, KEY).kv, kv)
    with pytest.raises(CorruptChunkError, match="HMAC"):
        ChunkCodec(hmac_key=b"other-key").decode(signed, KEY)
    unsigned = ChunkCodec().encode(KEY, kv)
    with pytest.raises(CorruptChunkError, match="no HMAC"):
        ChunkCodec(hmac_key=b"fleet-key").decode(unsigned, KEY)


def test_forged_chunk_with_recomputed_checksum_fails_hmac() -> None:
    import struct

    import xxhash

    codec = ChunkCodec(hmac_key=b"fleet-key")
    data = bytearray(codec.encode(KEY, _kv("float32")))
    body_end = len(data) - 8 - 32
    data[body_end - 1] ^= 0x01
    data[body_end : body_end + 8] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(data[:body_end])))
    with pytest.raises(CorruptChunkError, match="HMAC"):
        codec.decode(bytes(data), KEY)


@pytest.mark.parametrize("use_hmac", [False, True])
@pytest.mark.parametrize("codec_name", list(Codec))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_single_bit_flip_is_detected(codec_name: Codec, use_hmac: bool, data: st.DataObject) -> None:
    codec = ChunkCodec(codec_name, hmac_key=b"k" if use_hmac else None)
    encoded = bytearray(codec.encode(KEY, _kv("float16", (1, 2, 2, 4, 8))))
    pos = data.draw(st.integers(0, len(encoded) * 8 - 1))
    encoded[pos // 8] ^= 1 << (pos % 8)
    with pytest.raises(CorruptChunkError):
        codec.decode(bytes(encoded), KEY)


@settings(max_examples=40, deadline=None)
@given(cut=st.integers(min_value=0, max_value=10_000))
def test_any_truncation_or_extension_is_detected(cut: int) -> None:
    codec = ChunkCodec()
    encoded = codec.encode(KEY, _kv("float32", (1, 2, 2, 4, 8)))
    truncated = encoded[: cut % len(encoded)]
    with pytest.raises(CorruptChunkError):
        codec.decode(truncated, KEY)
    with pytest.raises(CorruptChunkError):
        codec.decode(encoded + b"\0", KEY)


def test_garbage_is_corrupt_not_a_crash() -> None:
    codec = ChunkCodec()
    for junk in (b"", b"KVMC", b"not a chunk at all", b"KVMC\x01\x00\xff\xff\xff\xff" + b"x" * 20):
        with pytest.raises(CorruptChunkError):
            codec.decode(junk)


def test_raw_decode_is_a_view_of_the_buffer() -> None:
    codec = ChunkCodec()
    data = codec.encode(KEY, _kv("float32"))
    kv = codec.decode(data).kv
    assert not kv.flags.writeable
    assert kv.base is not None
