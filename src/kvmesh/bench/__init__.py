"""Benchmark harness: workloads, open/closed-loop runner, vLLM-defined metrics, reports."""
