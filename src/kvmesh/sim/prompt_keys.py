"""Device-tier block keys of the simulated prompts, hashed once per distinct prompt or trace block.

Keys are chained (``h_i = H(h_{i-1} || tokens_i)``), so a prompt made of trace blocks is keyed block
by block, each trace block from the key before it::

    hash ids        7                     8                     12 (partial)
    sim blocks  |k1 k2 ... k32|        |k33 ... k64|         |k65 ... k72| (tail < block_size: no key)
    memo key    (root, 7, 32)          (k32, 8, 32)          (k64, 12, 8)

The keys equal ``BlockHasher.hash_blocks`` over the whole prompt, and a trace block that recurs after
the same prefix costs a dict probe instead of its tokens and digests. Workloads that name their
prompts (``RequestSpec.prompt_id``) are memoised per prompt; other prompts are hashed as they come.
Both memos are bounded, so memory follows the memo sizes, not the length of the workload.
"""

from __future__ import annotations

from collections import OrderedDict

from kvmesh.core.hashing import BlockHasher
from kvmesh.core.types import BlockKey
from kvmesh.workload import BlockTokens, PromptBlocks

DEFAULT_MEMO_PROMPTS = 200_000
DEFAULT_MEMO_BLOCKS = 32_768
"""Most trace blocks whose keys are kept."""
DEFAULT_MEMO_KEYS = 524_288
"""Most keys kept in all (about 40 MB): 16,384 trace blocks of 512 tokens at 16-token blocks, the
whole 32,768 from 64-token blocks up."""

_BlockMemoKey = tuple[BlockKey, int, int]
"""(key before the trace block, hash id, sim blocks keyed in it)."""


class PromptKeys:
    """Block keys of prompts for one hasher (the replicas' device-tier namespace and block size).

    Args:
        hasher: the device tier's key chain.
        memo_prompts: prompts memoised by ``prompt_id``.
        memo_blocks: trace blocks memoised by (previous key, hash id).
        memo_keys: most keys those trace blocks hold together.
    """

    def __init__(
        self,
        hasher: BlockHasher,
        *,
        memo_prompts: int = DEFAULT_MEMO_PROMPTS,
        memo_blocks: int = DEFAULT_MEMO_BLOCKS,
        memo_keys: int = DEFAULT_MEMO_KEYS,
    ) -> None:
        if memo_prompts <= 0 or memo_blocks <= 0 or memo_keys <= 0:
            raise ValueError(f"memo sizes must be positive, got {memo_prompts}, {memo_blocks}, {memo_keys}")
        self.hasher = hasher
        self.block_size = hasher.block_size
        self._prompts: dict[int, list[BlockKey]] = {}
        self._memo_prompts = memo_prompts
        self._blocks: OrderedDict[_BlockMemoKey, list[BlockKey]] = OrderedDict()
        self._memo_blocks = memo_blocks
        self._memo_keys = memo_keys
        self._num_memo_keys = 0
        self._source: BlockTokens | None = None
        self.num_blocks_hashed = 0
        """Trace blocks whose keys had to be computed (memo misses)."""

    def keys(self, tokens: list[int], prompt_id: int | None = None) -> list[BlockKey]:
        """Keys of every full block of ``tokens``; a workload's ``prompt_id`` names them for the memo."""
        if prompt_id is None:
            return self.hasher.hash_blocks(tokens)
        found = self._prompts.get(prompt_id)
        if found is None:
            if len(self._prompts) >= self._memo_prompts:
                self._prompts.clear()
            found = self._prompts[prompt_id] = self.hasher.hash_blocks(tokens)
        return found

    def block_keys(self, prompt: PromptBlocks) -> list[BlockKey]:
        """Keys of every full block of a prompt given as trace blocks (its tokens are not built)."""
        size = prompt.source.block_tokens
        bs = self.block_size
        if size % bs:
            return self.hasher.hash_blocks(prompt.token_ids())
        if prompt.source is not self._source:
            # Hash ids name tokens only within one source (seed, vocabulary, block length).
            self._blocks.clear()
            self._num_memo_keys = 0
            self._source = prompt.source
        memo = self._blocks
        out: list[BlockKey] = []
        parent = self.hasher.root
        left = prompt.num_tokens
        for h in prompt.hash_ids:
            take = min(size, left) // bs
            if take <= 0:
                break
            probe = (parent, h, take)
            found = memo.get(probe)
            if found is None:
                found = self.hasher.hash_blocks(prompt.source.block(h), parent, take)
                self.num_blocks_hashed += 1
                memo[probe] = found
                self._num_memo_keys += len(found)
                while len(memo) > self._memo_blocks or self._num_memo_keys > self._memo_keys:
                    self._num_memo_keys -= len(memo.popitem(last=False)[1])
            else:
                memo.move_to_end(probe)
            out.extend(found)
            parent = found[-1]
            left -= size
        return out
