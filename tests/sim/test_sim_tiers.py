"""The simulated tiers below a replica: write-through of a growing prompt."""

from __future__ import annotations

from sim_helpers import tokens

from kvmesh.core.events import BlockStored
from kvmesh.core.hashing import BlockHasher
from kvmesh.core.types import Medium
from kvmesh.engine.cost_model import CostModel, get_preset
from kvmesh.engine.prefix_cache import engine_block_hash
from kvmesh.sim.routing import SIM_HASH_ALGO
from kvmesh.sim.tiers import SharedStore, TierStack

BLOCK, CHUNK = 16, 64


def _stack() -> tuple[TierStack, SharedStore]:
    shared = SharedStore(capacity_tokens=1 << 20, chunk_size=CHUNK)
    cost = CostModel(get_preset("qwen3-32b-h100-tp2"))
    stack = TierStack(cost, BLOCK, CHUNK, cpu_capacity_tokens=1 << 20, shared=shared, name="r0")
    return stack, shared


def test_a_growing_prompt_writes_and_announces_only_its_new_chunks():
    stack, shared = _stack()
    hasher = BlockHasher("ns", BLOCK, SIM_HASH_ALGO)
    turn2 = tokens(7, 6 * CHUNK)
    turn1 = turn2[: 2 * CHUNK]  # the session's first prompt; the second extends it by four chunks
    kv = stack.kv_bytes_per_token

    assert stack.write_prefix(hasher.hash_blocks(turn1), turn1, now=0.0) == 2 * CHUNK
    stack.take_events()
    keys = hasher.hash_blocks(turn2)
    assert stack.write_prefix(keys, turn2, now=1.0) == 6 * CHUNK

    assert stack.stats.shared_write_chunks == 6
    assert stack.stats.shared_write_bytes == 6 * CHUNK * kv
    assert stack.tx.num_bytes == 6 * CHUNK * kv  # the write-through loads the replica's NIC
    assert stack.stats.cpu_write_chunks == 6
    stored = [ev for ev in stack.take_events() if isinstance(ev, BlockStored)]
    assert len(stored) == 1 and stored[0].medium == Medium.CPU.value
    # the CPU tier announces the four new chunks' device blocks, none of the first turn's
    assert stored[0].block_hashes == [engine_block_hash(k) for k in keys[2 * CHUNK // BLOCK :]]
    assert shared.cache.match(stack.chunk_keys(keys)) == 6
