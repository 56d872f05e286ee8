"""kvmesh as a vLLM secondary tier, against vLLM's own classes (run in ``.venv-vllm``).

Each check of ``vllm_tier_checks.py`` runs in vLLM's interpreter; the router side runs here.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvmesh.core.events import BlockStored, decode_batch
from kvmesh.core.hashing import BlockHasher, Namespace
from kvmesh.core.types import PodId
from kvmesh.fleet.vllm import vllm_python
from kvmesh.router.index import InMemoryIndex
from kvmesh.router.ingest import EventApplier
from kvmesh.router.prefix import match_prefix
from kvmesh.store.local_server import LocalServer

CHECKS = Path(__file__).with_name("vllm_tier_checks.py")


CHECKS_RUN = [
    "manager_valkey",
    "manager_shared_dir",
    "share_valkey",
    "share_shared_dir",
    "store_yaml",
    "corrupt_and_missing",
    "dead_server",
    "slow_server",
    "backpressure",
]


@pytest.fixture(scope="module")
def tier_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every check, and the events the tier publishes, run once in vLLM's interpreter."""
    run = tmp_path_factory.mktemp("tier")
    shared, dead, slow = (LocalServer("valkey").start() for _ in range(3))
    try:
        dead.stop()  # its URL names a Valkey that is gone
        assert slow.proc is not None
        own = {"dead_server": (dead.url, 0), "slow_server": (slow.url, slow.proc.pid)}
        spec = [
            {"check": name, "workdir": str(run / name), "url": own.get(name, (shared.url, 0))[0],
             "pid": own.get(name, ("", 0))[1]}
            for name in [*CHECKS_RUN, "events_wire"]
        ]  # fmt: skip
        (run / "spec.json").write_text(json.dumps(spec))
        results = run / "results.json"
        proc = subprocess.run(
            [vllm_python(), str(CHECKS), str(run / "spec.json"), str(results)],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            check=False,
        )
    finally:
        for server in (shared, dead, slow):
            server.stop()
    assert proc.returncode == 0 and results.exists(), f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    answer: dict[str, dict[str, Any]] = json.loads(results.read_text())
    return answer


@pytest.mark.parametrize("check", CHECKS_RUN)
def test_tier_check_under_vllm(check: str, tier_results: dict[str, dict[str, Any]]) -> None:
    result = tier_results[check]
    assert result["ok"], f"{check} failed:\n{result['output'][-2000:]}\n{result['error']}"


def test_router_indexes_the_events_vllm_publishes_for_the_tier(
    tier_results: dict[str, dict[str, Any]],
) -> None:
    """The tier's events, as vLLM encodes them for its publisher, land in the router's shared tier
    for the blocks the pod announced: every other endpoint may load them."""
    result = tier_results["events_wire"]
    assert result["ok"], result["error"]
    (line,) = [x for x in result["output"].splitlines() if x.startswith("payload ")]
    batch = decode_batch(base64.b64decode(line.split()[1]))
    hashes = [h for ev in batch.events if isinstance(ev, BlockStored) for h in ev.block_hashes]
    assert len(hashes) == 2
    model, tokens = "m", list(range(3000, 3032))
    idx = InMemoryIndex(10_000)
    applier = EventApplier(idx, model=model, max_blocks_per_pod=10_000)
    pod, other = PodId("http://a:1"), PodId("http://b:1")
    applier.apply(pod, BlockStored(hashes, None, tokens, 16))  # the pod computed the blocks
    hasher = BlockHasher(Namespace(model), 16)
    assert match_prefix(idx, hasher, tokens).hit_tokens(other) == 0
    applier.apply_batch(pod, batch)  # and its tier stored them in the shared store
    m = match_prefix(idx, hasher, tokens)
    assert m.shared is not None and m.shared.num_blocks == 2 and m.hit_tokens(other) == 32


def test_router_indexes_tier_events_as_shared() -> None:
    """vLLM publishes a secondary tier's chunks as medium STORAGE with locality REMOTE: the router
    credits them to the shared tier (every endpoint), not to the publishing pod's disk."""
    model, tokens = "m", list(range(1000, 1064))
    idx = InMemoryIndex(10_000)
    applier = EventApplier(idx, model=model, max_blocks_per_pod=10_000)
    pod, other = PodId("http://a:1"), PodId("http://b:1")
    stored = BlockStored(
        [1, 2, 3, 4], None, tokens, 16, medium="STORAGE", locality="REMOTE", ownership="KVMeshSecondaryTier"
    )
    applier.apply(pod, stored)
    m = match_prefix(idx, BlockHasher(Namespace(model), 16), tokens)
    assert m.shared is not None and m.shared.num_blocks == 4
    assert m.hit_tokens(other) == 64
    local = BlockStored([1, 2], None, tokens[:32], 16, medium="STORAGE")
    idx2 = InMemoryIndex(10_000)
    EventApplier(idx2, model=model, max_blocks_per_pod=10_000).apply(pod, local)
    assert match_prefix(idx2, BlockHasher(Namespace(model), 16), tokens).shared is None


def test_a_publisher_restart_drops_the_tier_blocks_only_it_announced() -> None:
    """A vLLM restart (its event seq resets) forgets what was on that pod and the tier's chunks no
    other publisher announced: the router cannot tell which of them the tier still holds (Valkey
    evicts without events). Chunks another live publisher announced stay; a prefix-cache reset
    (AllBlocksCleared) leaves the tier's chunks alone."""
    model, tokens = "m", list(range(2000, 2064))
    idx = InMemoryIndex(10_000)
    applier = EventApplier(idx, model=model, max_blocks_per_pod=10_000)
    pod, peer, other = PodId("http://a:1"), PodId("http://b:1"), PodId("http://c:1")
    hasher = BlockHasher(Namespace(model), 16)
    applier.apply(pod, BlockStored([1, 2, 3, 4], None, tokens, 16))
    applier.apply(pod, BlockStored([1, 2, 3], None, tokens[:48], 16, medium="STORAGE", locality="REMOTE"))
    applier.apply(peer, BlockStored([1], None, tokens[:16], 16, medium="STORAGE", locality="REMOTE"))
    before = match_prefix(idx, hasher, tokens)
    assert before.hit_tokens(pod) == 64 and before.hit_tokens(other) == 48

    applier.drop_pod(pod)  # the pod's prefix cache was reset: the tier still vouches for its chunks
    cleared = match_prefix(idx, hasher, tokens)
    assert pod not in cleared.pods and cleared.hit_tokens(other) == 48

    applier.publisher_restarted(pod)
    after = match_prefix(idx, hasher, tokens)
    assert pod not in after.pods
    assert after.shared is not None and after.hit_tokens(other) == 16  # only the peer's chunk is left

    applier.forget_pod(peer)  # the peer left the fleet: what it wrote stays in the store for the others
    assert match_prefix(idx, hasher, tokens).hit_tokens(other) == 16
    applier.publisher_restarted(pod)  # nobody vouches for that chunk any longer; nothing is dropped twice
    assert match_prefix(idx, hasher, tokens).hit_tokens(other) == 16
