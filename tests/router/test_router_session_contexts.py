"""Live sessions per endpoint: a prompt continues the one whose end it contains, or its session id."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.core.hashing import Namespace
from kvmesh.core.types import PodId
from kvmesh.router.session_contexts import SessionContexts
from kvmesh.router.types import EndpointState, RoutingRequest

A, B = EndpointState(PodId("http://a:1")), EndpointState(PodId("http://b:1"))
NS = Namespace("m")


def turn(tokens: list[int], rid: str = "r", session_id: str | None = None) -> RoutingRequest:
    return RoutingRequest(rid, np.asarray(tokens, dtype=np.uint32), NS, session_id=session_id)


def session(seed: int, turns: int, first: int = 1000, step: int = 700) -> list[list[int]]:
    """Growing prompts: each the previous one plus ``step`` new ids."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 50_000, first + step * turns).tolist()
    return [ids[: first + step * n] for n in range(turns)]


def test_a_continued_prompt_replaces_its_previous_turn_where_the_session_now_lives():
    sessions = SessionContexts(chunk_tokens=64)
    one, two = session(1, 3), session(2, 2)
    sessions.routed(turn(one[0]), A, 0.0)
    sessions.routed(turn(two[0]), A, 0.5)
    assert A.session_kv_tokens == len(one[0]) + len(two[0])
    sessions.routed(turn(one[1]), A, 1.0)  # the next turn: counted once, at its new length
    assert A.session_kv_tokens == len(one[1]) + len(two[0])
    sessions.routed(turn(one[2]), B, 2.0)  # the session moves: it leaves A
    assert (A.session_kv_tokens, B.session_kv_tokens) == (len(two[0]), len(one[2]))
    assert len(sessions) == 2


def test_sessions_not_seen_for_the_idle_time_stop_counting():
    sessions = SessionContexts(idle_s=10.0, chunk_tokens=64)
    one, two = session(3, 2), session(4, 1)
    sessions.routed(turn(one[0]), A, 0.0)
    sessions.routed(turn(two[0]), A, 6.0)
    sessions.expire(10.0)
    assert A.session_kv_tokens == len(one[0]) + len(two[0])
    sessions.expire(12.0)
    assert A.session_kv_tokens == len(two[0])
    sessions.routed(turn(one[1]), A, 12.5)  # it came back: a new session again
    sessions.expire(16.5)
    assert A.session_kv_tokens == len(one[1])


def test_the_session_header_names_the_session_whatever_the_prompt():
    sessions = SessionContexts(chunk_tokens=64)
    sessions.routed(turn(list(range(500)), session_id="s1"), A, 0.0)
    sessions.routed(turn(list(range(900, 1200)), session_id="s1"), B, 1.0)  # compacted, moved
    assert (A.session_kv_tokens, B.session_kv_tokens) == (0, 300)


def test_a_turn_beyond_the_lookback_is_a_new_session():
    sessions = SessionContexts(chunk_tokens=64, lookback_tokens=640)
    prompts = session(5, 2, step=2000)  # 2,000 new ids: the previous end is 31 chunks back
    sessions.routed(turn(prompts[0]), A, 0.0)
    sessions.routed(turn(prompts[1]), A, 1.0)
    assert A.session_kv_tokens == len(prompts[0]) + len(prompts[1])


def test_a_partly_tokenized_prompt_supersedes_its_previous_turn_but_is_not_remembered():
    sessions = SessionContexts(chunk_tokens=64)
    prompts = session(6, 2)
    sessions.routed(turn(prompts[0]), A, 0.0)
    partial = turn(prompts[1][:1400])
    partial.num_prompt_tokens = len(prompts[1])
    sessions.routed(partial, A, 1.0)
    assert A.session_kv_tokens == 0 and len(sessions) == 0


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="idle_s"):
        SessionContexts(idle_s=0.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        SessionContexts(chunk_tokens=0)


@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.sampled_from([A, B]), st.floats(0.0, 5.0)), min_size=1, max_size=40
    )
)
def test_each_endpoints_total_is_the_sum_of_the_live_sessions_it_holds(moves):
    a, b = EndpointState(A.pod), EndpointState(B.pod)
    states = {A.pod: a, B.pod: b}
    sessions = SessionContexts(idle_s=20.0, chunk_tokens=16)
    prompts = {s: session(100 + s, 12, first=40, step=30) for s in range(6)}
    turns = dict.fromkeys(prompts, 0)
    latest: dict[int, tuple[PodId, int, float]] = {}
    now = 0.0
    for s, target, gap in moves:
        now += gap
        sessions.expire(now)
        latest = {k: v for k, v in latest.items() if now - v[2] <= 20.0}
        prompt = prompts[s][min(turns[s], 11)]
        turns[s] += 1
        sessions.routed(turn(prompt), states[target.pod], now)
        latest[s] = (target.pod, len(prompt), now)
    for pod, state in states.items():
        assert state.session_kv_tokens == sum(n for p, n, _ in latest.values() if p == pod)
