"""Telling a hot shared prefix from a session's own history by where cached matches end."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.core.hashing import Namespace
from kvmesh.core.types import Medium, PodId
from kvmesh.router.plugins.kv_admission import KVAdmissionPrice
from kvmesh.router.plugins.shared_prefix_ends import SharedPrefixEnds
from kvmesh.router.plugins.ttft_estimate import TTFTEstimateScorer
from kvmesh.router.types import EndpointState, PodMatch, PrefixMatch, RoutingRequest

HOLDER, OTHER = PodId("http://holder:1"), PodId("http://other:1")
BLOCK = 16
NS = Namespace("m")


def request(tokens: list[int], held_blocks: int, rid: str = "r") -> RoutingRequest:
    r = RoutingRequest(rid, tokens, NS)
    pods = {HOLDER: PodMatch(held_blocks, {Medium.GPU: held_blocks})} if held_blocks else {}
    r.prefix = PrefixMatch(len(tokens) // BLOCK, BLOCK, pods)
    return r


def test_a_sessions_turns_are_private_and_chats_on_one_prompt_are_shared():
    ends = SharedPrefixEnds()
    system = list(range(10_000, 10_000 + 8 * BLOCK))
    history = list(system)
    for turn in range(5):  # each turn's cache ends where the previous turn's prompt ended
        held = len(history) // BLOCK
        history += list(range(turn * 1000, turn * 1000 + 3 * BLOCK))
        assert not ends.shared(request(history, held, f"t{turn}"))
    chats = [system + list(range(50_000 + 100 * i, 50_000 + 100 * i + 2 * BLOCK)) for i in range(4)]
    # the session's first turn ended its match at the system prompt as well
    assert all(ends.shared(request(chat, 8)) for chat in chats)
    other_system = [list(range(90_000 + 100 * i, 90_000 + 100 * i + 5 * BLOCK)) for i in range(3)]
    assert not ends.shared(request(other_system[0], 4))
    assert ends.shared(request(other_system[0][: 4 * BLOCK] + other_system[1][:BLOCK], 4))
    # a prompt nothing holds is not shared, however often it comes
    assert not ends.shared(request(chats[0], 0))
    assert not ends.shared(request(chats[0], 0))


def test_token_arrays_and_lists_end_in_the_same_place():
    ends = SharedPrefixEnds()
    tokens = list(range(4 * BLOCK))
    assert not ends.shared(request(tokens, 3))
    r = request(tokens, 3)
    r.tokens = np.asarray(tokens, dtype=np.uint32)
    assert not ends.shared(r)  # bytes and tuples are different keys, each seen once
    assert ends.shared(r)


def test_only_the_last_ends_are_remembered():
    ends = SharedPrefixEnds(capacity=2)
    prompts = [[i] * (2 * BLOCK) for i in range(3)]
    for p in prompts:
        assert not ends.shared(request(p, 2))
    assert len(ends) == 2
    assert not ends.shared(request(prompts[0], 2))  # forgotten
    with pytest.raises(ValueError, match="capacity"):
        SharedPrefixEnds(capacity=0)


def test_the_learned_kv_wait_moves_a_session_but_not_a_shared_prompt():
    # the holder's KV is full of running requests; the other endpoint is empty. A session's turn
    # is priced with the wait at the holder; a chat on a hot shared prompt is not (a copy elsewhere
    # would be a second hot replica)
    scorer = TTFTEstimateScorer(1000.0, 0.0, 0.0, {}, kv_price=KVAdmissionPrice(learned_wait=True))
    holder = EndpointState(HOLDER, kv_capacity_tokens=256, kv_cache_usage=1.0, kv_release_tokens_per_s=10.0)
    other = EndpointState(OTHER, kv_capacity_tokens=256)
    system = list(range(7 * BLOCK))
    first, second = system + [1] * BLOCK, system + [2] * BLOCK
    assert scorer.score(request(first, 7), [holder, other])[0] < 0.1  # not known to be shared: waits
    shared = scorer.score(request(second, 7), [holder, other])
    assert shared == [1.0, pytest.approx(BLOCK / (8 * BLOCK))]  # compute only: the holder wins
