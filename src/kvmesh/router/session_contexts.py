"""Which live sessions each endpoint holds, and how much device KV their contexts will ask of it.

An agent session comes back every few seconds with its whole growing context, to the endpoint that
holds it. An endpoint's device KV is therefore spoken for by the live sessions homed there, not only
by the requests running now: between their turns five idle 100k-token sessions leave a pod looking
as free as an empty one, and a new session placed there makes each of them wait for KV or recompute
on its next turn. :class:`SessionContexts` keeps, per endpoint, the latest prompt of every session
whose last turn went there and that came back within ``idle_s``; their sum is
``EndpointState.session_kv_tokens``, which the KV price reads
(:mod:`kvmesh.router.plugins.kv_admission`).

A session is the ``x-session-id`` header where the client sends one. Otherwise a prompt continues
the earlier prompt whose end it contains: every routed prompt is remembered by its last whole chunk
of ``chunk_tokens`` ids and that chunk's position, and a later prompt is looked up at its chunk
boundaries, from its end back over ``lookback_tokens`` (a turn adds an answer and a tool result to
the previous prompt). A prompt whose ids are only partly known (tokenized up to its first uncached
block) still supersedes the prompt it continues, but cannot be found by the next one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from kvmesh.core.types import PodId
from kvmesh.router.types import EndpointState, RoutingRequest

DEFAULT_IDLE_S = 60.0
"""A session not seen for this long is taken to be over (agents think for seconds, tools run for
tens of seconds)."""
DEFAULT_CHUNK_TOKENS = 256
DEFAULT_LOOKBACK_TOKENS = 65_536


@dataclass(slots=True)
class _Session:
    state: EndpointState
    tokens: int
    seen: float


class SessionContexts:
    """Per endpoint, the live sessions whose latest turn went there (see the module docstring).

    Call :meth:`routed` for every routed request and :meth:`expire` before each decision.

    Raises:
        ValueError: a non-positive ``idle_s`` or ``chunk_tokens``, or a negative ``lookback_tokens``.
    """

    def __init__(
        self,
        idle_s: float = DEFAULT_IDLE_S,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        lookback_tokens: int = DEFAULT_LOOKBACK_TOKENS,
    ) -> None:
        if idle_s <= 0 or chunk_tokens <= 0 or lookback_tokens < 0:
            raise ValueError(
                f"idle_s and chunk_tokens must be positive, lookback_tokens non-negative; got "
                f"{idle_s}, {chunk_tokens}, {lookback_tokens}"
            )
        self.idle_s = idle_s
        self.chunk_tokens = chunk_tokens
        self.lookback_tokens = lookback_tokens
        self._sessions: OrderedDict[Hashable, _Session] = OrderedDict()
        """Oldest sighting first."""
        self._held: dict[PodId, int] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def routed(self, request: RoutingRequest, state: EndpointState, now: float) -> None:
        """``request`` went to ``state``'s endpoint: its prompt replaces the one it continues."""
        if request.session_id:
            key: Hashable | None = ("id", request.namespace, request.session_id)
            self._drop(key)
        else:
            previous = self._continued(request)
            if previous is not None:
                self._drop(previous)
            key = self._end_key(request)
        if key is None:
            return
        tokens = request.num_tokens
        self._sessions[key] = _Session(state, tokens, now)
        self._add(state, tokens)

    def expire(self, now: float) -> None:
        """Forget the sessions not seen for ``idle_s``."""
        sessions = self._sessions
        while sessions:
            key, session = next(iter(sessions.items()))
            if now - session.seen <= self.idle_s:
                break
            self._drop(key)

    def _continued(self, request: RoutingRequest) -> Hashable | None:
        tokens, chunk = request.tokens, self.chunk_tokens
        end = len(tokens) // chunk * chunk
        stop = max(end - self.lookback_tokens, chunk)
        sessions = self._sessions
        for boundary in range(end, stop - 1, -chunk):
            key = ("end", request.namespace, boundary, _ids(tokens, boundary - chunk, boundary))
            if key in sessions:
                return key
        return None

    def _end_key(self, request: RoutingRequest) -> Hashable | None:
        if request.num_prompt_tokens is not None:  # only the leading ids are known
            return None
        tokens, chunk = request.tokens, self.chunk_tokens
        end = len(tokens) // chunk * chunk
        if end == 0:
            return None
        return ("end", request.namespace, end, _ids(tokens, end - chunk, end))

    def _drop(self, key: Hashable) -> None:
        session = self._sessions.pop(key, None)
        if session is not None:
            self._add(session.state, -session.tokens)

    def _add(self, state: EndpointState, tokens: int) -> None:
        held = self._held[state.pod] = max(self._held.get(state.pod, 0) + tokens, 0)
        state.session_kv_tokens = held


def _ids(tokens: object, start: int, end: int) -> Hashable:
    """The ids ``tokens[start:end]`` as a dict key (an array's bytes, else a tuple)."""
    part = tokens[start:end]  # type: ignore[index]
    return part.tobytes() if isinstance(part, np.ndarray) else tuple(part)
