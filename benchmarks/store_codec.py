"""Chunk codec figures: size against bf16, quantization error, encode/decode GB/s.

KV values are drawn from a standard normal distribution with a few outlier channels (×8), which is
how real K caches look (a handful of large-magnitude channels); error is reported relative to each
row's absmax (the quantization step's reference) and as plain absolute error.

    python -m benchmarks.store_codec [--json] [--shape llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kvmesh.core.types import BlockKey
from kvmesh.store.bench import SHAPES
from kvmesh.store.codec import ChunkCodec, Codec, bf16_to_float32, float32_to_bf16
from kvmesh.store.keys import StoreKey

KEY = StoreKey("00000000000c0dec", BlockKey(bytes(16)))


def _best_seconds(fn: object, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def run(shape_name: str, repeat: int) -> dict[str, object]:
    layers, heads, dim, _ = SHAPES[shape_name]
    shape = (layers, 2, heads, 256, dim)
    rng = np.random.default_rng(0)
    values = rng.standard_normal(shape, dtype=np.float32)
    values[..., rng.choice(dim, size=max(1, dim // 32), replace=False)] *= 8.0
    kv = float32_to_bf16(values)
    reference = bf16_to_float32(kv)
    raw_size = len(ChunkCodec(Codec.RAW).encode(KEY, kv))
    rows = []
    for codec_name in Codec:
        codec = ChunkCodec(codec_name)
        data = codec.encode(KEY, kv)
        restored = bf16_to_float32(codec.decode(data, KEY).kv)
        err = np.abs(restored - reference)
        rel = err / np.max(np.abs(reference), axis=-1, keepdims=True)
        enc_s = _best_seconds(lambda c=codec: c.encode(KEY, kv), repeat)
        dec_s = _best_seconds(lambda c=codec, d=data: c.decode(d, KEY), repeat)
        rows.append(
            {
                "codec": codec_name.value,
                "chunk_bytes": len(data),
                "smaller_than_bf16": round(raw_size / len(data), 3),
                "max_abs_err": float(err.max()),
                "mean_abs_err": float(err.mean()),
                "max_rel_err": float(rel.max()),
                "mean_rel_err": float(rel.mean()),
                "encode_gbps": kv.nbytes / enc_s / 1e9,
                "decode_gbps": kv.nbytes / dec_s / 1e9,
            }
        )
    return {"shape": shape_name, "kv_shape": list(shape), "dtype": "bfloat16", "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run(args.shape, args.repeat)
    if args.json:
        print(json.dumps(report))
        return
    print(f"{report['shape']} {report['kv_shape']} bfloat16, 256-token chunk")
    print(
        f"{'codec':6} {'MiB':>7} {'vs bf16':>8} {'max abs':>9} {'mean abs':>9} {'max rel':>8} {'mean rel':>9} "
        f"{'enc GB/s':>9} {'dec GB/s':>9}"
    )
    for r in report["rows"]:  # type: ignore[attr-defined]
        print(
            f"{r['codec']:6} {r['chunk_bytes'] / 2**20:7.2f} {r['smaller_than_bf16']:7.2f}x {r['max_abs_err']:9.4f} "
            f"{r['mean_abs_err']:9.5f} {r['max_rel_err']:8.4f} {r['mean_rel_err']:9.5f} "
            f"{r['encode_gbps']:9.2f} {r['decode_gbps']:9.2f}"
        )


if __name__ == "__main__":
    main()
