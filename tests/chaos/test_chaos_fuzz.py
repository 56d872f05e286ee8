"""The fuzz generators: deterministic, hostile, and survivable by the router's intake."""

from __future__ import annotations

import itertools
import json

from kvmesh.chaos.fuzz_events import fuzz_frames
from kvmesh.chaos.fuzz_http import generated, hand_picked
from kvmesh.core.events import BlockStored, encode_batch
from kvmesh.core.hashing import HashAlgo
from kvmesh.core.types import PodId
from kvmesh.router.index import InMemoryIndex
from kvmesh.router.ingest import EventApplier
from kvmesh.router.intake import EventIntake
from kvmesh.router.prefix import match_prefix

POD = PodId("http://127.0.0.1:9")


def test_frames_are_deterministic_per_seed():
    a = list(fuzz_frames(seed=3, count=200, vocab=259))
    assert a == list(fuzz_frames(seed=3, count=200, vocab=259))
    assert a != list(fuzz_frames(seed=4, count=200, vocab=259))


async def test_intake_survives_fuzzed_frames_and_still_applies_a_valid_batch():
    index = InMemoryIndex()
    applier = EventApplier(index, model="m", block_size=16, algo=HashAlgo.XXH3)
    intake = EventIntake(applier)
    intake.add_pod(POD, "tcp://127.0.0.1:9")
    sub = intake.subscriber
    try:
        for frames in fuzz_frames(seed=16, count=3000, vocab=259):
            await sub.handle_frames(POD, frames)
        assert sub.stats.num_malformed > 1000
        assert sub.stats.num_resets > 0, "the generator must also send seqs that go backwards"
        assert applier.stats.num_bad_events > 0
        tokens = list(range(200, 232))
        assert POD not in match_prefix(index, applier.hasher(), tokens).pods
        valid = encode_batch([BlockStored([0xFEED01, 0xFEED02], None, tokens, 16)])
        last = sub.last_seq(POD) or 0
        blocks = applier.num_blocks(POD)
        await sub.handle_frames(POD, [b"kv-events", (last + 1).to_bytes(8, "big"), valid])
        assert sub.last_seq(POD) == last + 1
        assert applier.num_blocks(POD) == blocks + 2
        assert match_prefix(index, applier.hasher(), tokens).pods[POD].num_blocks == 2
    finally:
        await intake.aclose()


def test_http_cases_are_malformed_by_construction():
    fixed = hand_picked("m", 259, 8192, gateway=True)
    assert len({c.label for c in fixed}) == len(fixed)
    assert any("tenant" in c.label for c in fixed)
    assert not any("tenant" in c.label for c in hand_picked("m", 259, 8192, gateway=False))
    for case in itertools.islice(generated("m", 259, 8192, seed=1), 300):
        try:
            body = json.loads(case.body)
        except ValueError:
            assert case.label == "cut at a random byte"
            continue
        assert case.label.startswith("invalid "), case
        field = case.label.removeprefix("invalid ")
        assert body[field] not in ([5, 6, 7, 8], 4, "m", [{"role": "user", "content": "hello"}])
