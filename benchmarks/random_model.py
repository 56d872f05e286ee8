"""Write a random-weight model of a real shape, for timing the reference engine where no weights are.

    python benchmarks/random_model.py --shape llama-3.1-8b --out /tmp/llama-8b-random --device cuda

Prefill FLOPs, KV bytes per token and transfer sizes depend on the shape, not on the weights, so a
seeded random model of Llama-3.1-8B's shape times the engine (cold prefill, store load, decode) as
the real one would; its text is noise. The byte-level tokenizer of ``kvmesh/tiny-random-llama`` comes
with it (one token per byte), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvmesh.core.models import tiny_llama_config, write_random_model

SHAPES: dict[str, dict[str, Any]] = {
    # Published configs (layers, widths, heads); vocab is replaced by the byte-level tokenizer's.
    "llama-3.1-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_theta": 500000.0,
    },
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rope_theta": 500000.0,
    },
    "tiny": {},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--device", default="cpu", help="where to initialise the weights (cuda is faster)")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    config = tiny_llama_config(vocab_size=259)
    for key, value in SHAPES[args.shape].items():
        setattr(config, key, value)
    config.max_position_embeddings = args.max_model_len
    config.initializer_range = 0.02
    start = time.perf_counter()
    files = write_random_model(
        args.out, config, name=f"random/{args.shape}", seed=args.seed, dtype=args.dtype, device=args.device
    )
    report = {
        "shape": args.shape,
        "path": str(files.path),
        "dtype": args.dtype,
        "seconds": round(time.perf_counter() - start, 1),
        "bytes": sum(p.stat().st_size for p in args.out.iterdir() if p.is_file()),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
