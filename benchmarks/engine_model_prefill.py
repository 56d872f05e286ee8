"""Prefill time with and without a reused prefix, measured side by side with the real model.

Workload: a shared prefix of ``--prefix-tokens`` tokens followed by a ``--question-tokens`` question
(2048 + 64 by default). Three ways to reach the first output token, timed in one process:

- ``cold``: the whole prompt is prefilled.
- ``kv_array``: the prefix KV (exported from an earlier sequence) is injected as an in-memory array;
  only the question is computed.
- ``kv_bytes``: the same KV arrives as raw bytes (what a store tier hands back) and is viewed with
  ``np.frombuffer`` before injection; includes that conversion.

Each figure is the median over ``--repeats`` runs, interleaved so drift hits every mode alike. The
first-token logits of the reuse modes are checked against the cold run (max |diff| is reported).

    .venv/bin/python benchmarks/engine_model_prefill.py [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np


def build_prompt(tokenizer: Any, prefix_tokens: int, question_tokens: int) -> tuple[list[int], list[int]]:
    """Deterministic prefix and question token ids of exactly the requested lengths."""
    lines = [
        f"Record {i}: shipment {i * 37 % 1000:03d} left depot {i % 17} at {8 + i % 10}:{i * 7 % 60:02d} "
        f"carrying {i * 13 % 90 + 10} crates of item {chr(65 + i % 26)}{i % 9}."
        for i in range(400)
    ]
    prefix = tokenizer.encode("\n".join(lines), add_special_tokens=False)
    question = tokenizer.encode(
        " ".join(f"Which depot shipped record {i} and how many crates did it carry?" for i in range(20)),
        add_special_tokens=False,
    )
    if len(prefix) < prefix_tokens or len(question) < question_tokens:
        raise SystemExit("the generated text is too short for the requested token counts")
    return prefix[:prefix_tokens], question[:question_tokens]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of a table")
    parser.add_argument("--out", default=None, help="also write the JSON report to this file")
    args = parser.parse_args(argv)

    import torch
    from rich.console import Console
    from rich.table import Table

    from kvmesh.engine.runner import PrefillChunk, SamplingParams, Sequence, StepPlan
    from kvmesh.engine.torch_runner import TorchRunner

    console = Console(stderr=True)
    started = time.perf_counter()
    runner = TorchRunner.load(args.model, device=args.device, dtype=args.dtype, num_threads=args.threads)
    load_s = time.perf_counter() - started
    assert runner.tokenizer is not None
    prefix, question = build_prompt(runner.tokenizer, args.prefix_tokens, args.question_tokens)
    prompt = prefix + question
    n_prefix = len(prefix)

    def prefill(request_id: str, start: int, kv: np.ndarray | None) -> tuple[float, np.ndarray, Sequence]:
        seq = Sequence(request_id, list(prompt), len(prompt), SamplingParams())
        t0 = time.perf_counter()
        out = runner.execute_sync(StepPlan(prefills=[PrefillChunk(seq, start, len(prompt), cached_kv=kv)]))
        elapsed = time.perf_counter() - t0
        return elapsed, out.last_logits[request_id], seq

    # Warm-up (allocator, kernels) and the donor of the prefix KV.
    _, _, donor = prefill("donor", 0, None)
    t0 = time.perf_counter()
    kv = runner.export_kv(donor, 0, n_prefix)
    export_s = time.perf_counter() - t0
    runner.free(donor)
    assert kv is not None
    payload = kv.tobytes()

    times: dict[str, list[float]] = {"cold": [], "kv_array": [], "kv_bytes": []}
    diffs: dict[str, float] = {"kv_array": 0.0, "kv_bytes": 0.0}
    with console.status("timing prefills") as status:
        for r in range(args.repeats):
            status.update(f"repeat {r + 1}/{args.repeats}")
            cold_s, cold_logits, seq = prefill("cold", 0, None)
            runner.free(seq)
            times["cold"].append(cold_s)
            warm_s, logits, seq = prefill("kv_array", n_prefix, kv)
            runner.free(seq)
            times["kv_array"].append(warm_s)
            diffs["kv_array"] = max(diffs["kv_array"], float(np.abs(logits - cold_logits).max()))
            t0 = time.perf_counter()
            restored = np.frombuffer(payload, dtype=kv.dtype).reshape(kv.shape)
            view_s = time.perf_counter() - t0
            warm_s, logits, seq = prefill("kv_bytes", n_prefix, restored)
            runner.free(seq)
            times["kv_bytes"].append(view_s + warm_s)
            diffs["kv_bytes"] = max(diffs["kv_bytes"], float(np.abs(logits - cold_logits).max()))

    med = {mode: statistics.median(values) for mode, values in times.items()}
    report = {
        "model": runner.info.model_name,
        "device": runner.info.device,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "prefix_tokens": n_prefix,
        "question_tokens": len(question),
        "repeats": args.repeats,
        "load_s": round(load_s, 3),
        "kv_prefix_bytes": kv.nbytes,
        "export_kv_s": round(export_s, 4),
        "median_s": {mode: round(v, 4) for mode, v in med.items()},
        "all_s": {mode: [round(v, 4) for v in values] for mode, values in times.items()},
        "speedup_vs_cold": {mode: round(med["cold"] / med[mode], 2) for mode in ("kv_array", "kv_bytes")},
        "max_abs_logit_diff_vs_cold": diffs,
    }
    runner.close()
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    if args.json:
        print(text)
        return 0
    table = Table(
        title=f"{report['model']} prefill, {n_prefix}-token prefix + {len(question)}-token question"
    )
    for column in ("mode", "median s", "speedup vs cold", "max |Δlogit| vs cold"):
        table.add_column(column)
    for mode in times:
        speedup = "1.00" if mode == "cold" else f"{report['speedup_vs_cold'][mode]:.2f}"
        diff = "-" if mode == "cold" else f"{diffs[mode]:.2e}"
        table.add_row(mode, f"{med[mode]:.4f}", speedup, diff)
    Console().print(table)
    print(f"prefix KV {kv.nbytes / 2**20:.1f} MiB, export {export_s * 1e3:.1f} ms, load {load_s:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
