"""Replay of a Mooncake-format jsonl trace (hash ids of 512-token blocks) as blocks or tokens."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from kvmesh.errors import ConfigError
from kvmesh.workload.block_replay import block_source, with_token_ids
from kvmesh.workload.spec import RequestSpec
from kvmesh.workload.synthetic import DEFAULT_TOKEN_LOW, DEFAULT_VOCAB_SIZE
from kvmesh.workload.trace_blocks import DEFAULT_CAPACITY_BLOCKS, PromptBlocks


@dataclass(slots=True)
class MooncakeTraceWorkload:
    """Replay of a Mooncake-format trace.

    Each jsonl line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``.
    Hash id ``h`` stands for one block of ``block_tokens`` tokens; its tokens are drawn from a PRNG
    seeded by ``(seed, h)``, so equal ids give equal blocks in every run. A prompt is the concatenation
    of its blocks cut to ``input_length`` (the last block may be partial); each request also carries
    it as ``prompt_blocks``, and :meth:`block_requests` yields the stream with blocks only. Arrival =
    (timestamp − first timestamp) / 1000 / ``speedup``.

    Args:
        max_requests: replay only the first lines of the trace.
        max_input_len: cut longer prompts (and their output) to fit a model's context.
        cached_blocks: token blocks kept between requests (see :class:`BlockTokens`); memory, not
            results, depends on it.
    """

    path: str | Path
    speedup: float = 1.0
    block_tokens: int = 512
    max_requests: int | None = None
    max_input_len: int | None = None
    seed: int = 0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    token_low: int = DEFAULT_TOKEN_LOW
    name: str = "mooncake"
    cached_blocks: int = DEFAULT_CAPACITY_BLOCKS

    def __post_init__(self) -> None:
        if self.speedup <= 0 or self.block_tokens <= 0:
            raise ConfigError(
                f"speedup and block_tokens must be > 0, got {self.speedup}, {self.block_tokens}"
            )

    def _records(self) -> Iterator[tuple[int, dict[str, Any]]]:
        path = Path(self.path)
        try:
            handle: TextIO = (
                gzip.open(path, "rt", encoding="utf-8")  # noqa: SIM115 - closed by the `with` below
                if path.suffix == ".gz"
                else path.open("r", encoding="utf-8")
            )
        except OSError as exc:
            raise ConfigError(f"cannot open trace {path}: {exc}") from exc
        with handle:
            yield from self._parse_lines(path, handle)

    def _parse_lines(self, path: Path, handle: TextIO) -> Iterator[tuple[int, dict[str, Any]]]:
        lineno = 0
        while True:
            try:
                line = handle.readline()
            except (OSError, EOFError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{path}:{lineno + 1}: unreadable trace ({exc})") from exc
            if not line:
                return
            lineno += 1
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ok = (
                    isinstance(rec, dict)
                    and isinstance(rec.get("timestamp"), int | float)
                    and isinstance(rec.get("input_length"), int)
                    and isinstance(rec.get("output_length"), int)
                    and isinstance(rec.get("hash_ids"), list)
                    and all(isinstance(h, int) for h in rec["hash_ids"])
                )
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
            if not ok:
                raise ConfigError(
                    f"{path}:{lineno}: expected timestamp, input_length, output_length (numbers) and hash_ids (ints)"
                )
            if rec["input_length"] > len(rec["hash_ids"]) * self.block_tokens:
                raise ConfigError(
                    f"{path}:{lineno}: input_length {rec['input_length']} exceeds "
                    f"{len(rec['hash_ids'])} blocks of {self.block_tokens} tokens"
                )
            yield lineno, rec

    def requests(self) -> Iterator[RequestSpec]:
        return with_token_ids(self.block_requests())

    def block_requests(self) -> Iterator[RequestSpec]:
        source = block_source(self)
        seen_len: dict[int, int] = {}
        t0: float | None = None
        size = self.block_tokens
        for i, (_lineno, rec) in enumerate(self._records()):
            if self.max_requests is not None and i >= self.max_requests:
                return
            if t0 is None:
                t0 = float(rec["timestamp"])
            n = rec["input_length"]
            if self.max_input_len is not None:
                n = min(n, self.max_input_len)
            hash_ids = tuple(rec["hash_ids"][: -(-n // size)])
            reusable = 0
            reusing = True
            for j, h in enumerate(hash_ids):
                take = min(size, n - j * size)
                if reusing:
                    reused = min(take, seen_len.get(h, 0))
                    reusable += reused
                    reusing = reused == take
                seen_len[h] = max(seen_len.get(h, 0), take)
            yield RequestSpec(
                request_id=f"{self.name}-{i}",
                arrival_s=(float(rec["timestamp"]) - t0) / 1000.0 / self.speedup,
                prompt_token_ids=[],
                output_len=max(1, rec["output_length"]),
                reusable_prefix_len=reusable,
                prompt_blocks=PromptBlocks(hash_ids, n, source),
            )
