"""Per-tier put/get GB/s of 256-token chunks next to same-run baselines (memcpy, raw file I/O,
raw redis-py pipelined SET/GET). The same measurement as ``kvmesh store bench``.

    python -m benchmarks.store_tiers [--json] [--shape llama-3.1-8b] [--chunks 4] [--iterations 5]
"""

from __future__ import annotations

import sys

from kvmesh.cli import main

if __name__ == "__main__":
    sys.exit(main(["store", "bench", *sys.argv[1:]]))
