"""Decode throughput of TorchRunner: one padded batch per step vs one forward per sequence.

For each batch size, ``--batch-sizes`` sequences with prompts of about ``--prompt-tokens`` tokens
(lengths staggered so padding is exercised) are prefilled, then decoded for ``--steps`` steps,
once with batched decodes and once sequentially, in the same process. Reports output tokens per
second for both and their ratio, and checks both modes produce the same greedy tokens.

    .venv/bin/python benchmarks/engine_model_decode.py [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def run_mode(runner: Any, prompts: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    """Prefill every prompt, then time ``steps`` decode steps; return (tokens/s, tokens per sequence)."""
    from kvmesh.engine.runner import PrefillChunk, SamplingParams, Sequence, StepPlan

    seqs = [Sequence(f"s{i}", list(p), len(p), SamplingParams()) for i, p in enumerate(prompts)]
    out = runner.execute_sync(StepPlan(prefills=[PrefillChunk(s, 0, len(s.token_ids)) for s in seqs]))
    tokens = [[out.sampled[s.request_id]] for s in seqs]
    started = time.perf_counter()
    for _ in range(steps):
        for s, t in zip(seqs, tokens, strict=True):
            s.token_ids.append(t[-1])
        out = runner.execute_sync(StepPlan(decodes=seqs))
        for s, t in zip(seqs, tokens, strict=True):
            t.append(out.sampled[s.request_id])
    elapsed = time.perf_counter() - started
    for s in seqs:
        runner.free(s)
    return len(seqs) * steps / elapsed, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch-sizes", default="1,4,8")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of a table")
    parser.add_argument("--out", default=None, help="also write the JSON report to this file")
    args = parser.parse_args(argv)

    import torch
    from rich.console import Console
    from rich.table import Table

    from kvmesh.engine.torch_runner import TorchRunner

    batched = TorchRunner.load(args.model, num_threads=args.threads)
    sequential = TorchRunner(
        batched.model,
        model_name=batched.info.model_name,
        eos_token_ids=batched.info.eos_token_ids,
        batch_decodes=False,
    )
    assert batched.tokenizer is not None
    base = batched.tokenizer.encode(" ".join(f"item {i} costs {i * 7 % 100} euros;" for i in range(400)))
    rows = []
    with Console(stderr=True).status("decoding") as status:
        for size in (int(x) for x in args.batch_sizes.split(",")):
            status.update(f"batch size {size}")
            prompts = [base[i : i + args.prompt_tokens - 8 * i] for i in range(size)]
            run_mode(batched, prompts[:1], 2)  # warm-up
            tps_batched, tok_b = run_mode(batched, prompts, args.steps)
            tps_seq, tok_s = run_mode(sequential, prompts, args.steps)
            rows.append(
                {
                    "batch_size": size,
                    "tokens_per_s_batched": round(tps_batched, 2),
                    "tokens_per_s_sequential": round(tps_seq, 2),
                    "speedup": round(tps_batched / tps_seq, 2),
                    "same_tokens": tok_b == tok_s,
                }
            )
    report = {
        "model": batched.info.model_name,
        "device": batched.info.device,
        "torch_threads": torch.get_num_threads(),
        "prompt_tokens": args.prompt_tokens,
        "steps": args.steps,
        "results": rows,
    }
    batched.close()
    sequential.close()
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    if args.json:
        print(text)
        return 0
    table = Table(title=f"{report['model']} decode, ~{args.prompt_tokens}-token prompts, {args.steps} steps")
    for column in ("batch", "tok/s batched", "tok/s sequential", "speedup", "same tokens"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            str(row["batch_size"]),
            f"{row['tokens_per_s_batched']:.1f}",
            f"{row['tokens_per_s_sequential']:.1f}",
            f"{row['speedup']:.2f}",
            str(row["same_tokens"]),
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
