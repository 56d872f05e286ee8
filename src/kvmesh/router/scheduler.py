"""The scheduler: filters → weighted scorers → picker, in profiles configured from YAML.

``Scheduler.pick(request, endpoints)`` is pure and synchronous: no I/O, no wall clock (an
optional injected ``clock`` times the scorers), randomness from an injected ``rng``. The gateway
calls it per request; the fleet simulator drives the same object in virtual time.

Config (llm-d's EPP layout)::

    plugins:
      - type: precise-prefix-cache-scorer      # a registered type name
        name: prefix                           # optional; defaults to the type
        parameters: {tierWeights: {CPU: 0.8}}
      - type: queue-scorer
      - type: max-score-picker
    schedulingProfiles:
      - name: default
        plugins:
          - {pluginRef: prefix, weight: 3}
          - {pluginRef: queue-scorer, weight: 2}
          - {pluginRef: max-score-picker}

With a ``pd-profile-handler`` plugin (parameters ``threshold``, ``prefillProfile``,
``decodeProfile``) the decode profile picks the endpoint; when the prompt's tokens not cached
there exceed ``threshold``, the prefill profile also picks a prefill endpoint.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.core.hashing import DEFAULT_BLOCK_SIZE, BlockHasher, HashAlgo, Namespace
from kvmesh.core.types import BlockKey, PodId
from kvmesh.errors import ConfigError
from kvmesh.router.index import BlockIndex
from kvmesh.router.keymemo import BlockKeyMemo
from kvmesh.router.plugins.base import PluginContext
from kvmesh.router.plugins.pickers import MaxScorePicker
from kvmesh.router.plugins.ttft_estimate import TTFTEstimateScorer
from kvmesh.router.prefix import match_prefix, match_prefix_keys
from kvmesh.router.scheduler_config import DEFAULT_PROFILE, PDConfig, Profile, parse_config
from kvmesh.router.scheduler_config import PRESET_NAMES as PRESET_NAMES
from kvmesh.router.scheduler_config import PRESETS_DIR as PRESETS_DIR
from kvmesh.router.scheduler_config import WeightedScorer as WeightedScorer
from kvmesh.router.scheduler_config import load_scheduler_config as load_scheduler_config
from kvmesh.router.types import Decision, EndpointState, PrefixMatch, RoutingRequest, ScoreTerms

_POD_OF = operator.attrgetter("pod")
_HEALTHY = operator.attrgetter("healthy")


@dataclass(slots=True)
class _Ranked:
    ranked: list[PodId]
    candidates: list[EndpointState]
    totals: list[float]
    names: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    columns: list[list[float]] = field(default_factory=list)

    def terms_and_scores(self) -> tuple[ScoreTerms, dict[PodId, float]]:
        """The per-scorer terms and the totals by endpoint, from one list of the candidates' ids."""
        pods = list(map(_POD_OF, self.candidates))
        return (
            ScoreTerms(pods, self.names, self.weights, self.columns),
            dict(zip(pods, self.totals, strict=True)),
        )


class Scheduler:
    """Picks an endpoint per request.

    Args:
        profiles: the pipelines by name.
        index: the block index the prefix is matched against (``None``: no precise prefix); a
            remote one is read only through :meth:`match`, which the gateway runs off its loop.
        block_size: the engines' tokens per block.
        hash_algo: the engines' key digest.
        pd: the P/D decider's settings, or ``None`` for whole requests.
        rng: random source of the built-in picker.
        clock: seconds counter used only to time scorers (``None``: no timing).
        on_timing: called with ``(scorer name, seconds)`` after each scorer runs when ``clock`` is set.
        memo: block keys already computed from event tokens (speeds up matching; optional).

    Attributes:
        align_match: applied to every index match; the gateway sets it to
            :meth:`~kvmesh.router.ingest.EventApplier.align_match` so pods with engine blocks larger
            than the router's are credited only whole engine blocks (``None``: matches as found).
    """

    def __init__(
        self,
        profiles: Mapping[str, Profile],
        *,
        index: BlockIndex | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        hash_algo: HashAlgo = HashAlgo.SHA256,
        pd: PDConfig | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] | None = None,
        on_timing: Callable[[str, float], None] | None = None,
        memo: BlockKeyMemo | None = None,
    ) -> None:
        if not profiles:
            raise ConfigError("a scheduler needs at least one scheduling profile")
        self.profiles = dict(profiles)
        if pd is not None:
            for needed in (pd.prefill_profile, pd.decode_profile):
                if needed not in self.profiles:
                    raise ConfigError(f"pd-profile-handler names profile {needed!r}, which is not defined")
        elif DEFAULT_PROFILE not in self.profiles and len(self.profiles) > 1:
            raise ConfigError(f"with several profiles and no P/D, one must be named {DEFAULT_PROFILE!r}")
        self.index = index
        self.block_size = block_size
        self.hash_algo = HashAlgo(hash_algo)
        self.pd = pd
        self.rng = rng if rng is not None else random.Random()
        self.clock = clock
        self.on_timing = on_timing
        self.memo = memo
        self._default_picker = MaxScorePicker(self.rng)
        self._hashers: dict[Namespace, BlockHasher] = {}
        self._last_hasher: tuple[Namespace, BlockHasher] | None = None
        """The last namespace object asked for: a request asks several times with one object,
        and hashing a namespace (a dataclass) for the dict costs µs each time."""
        self.align_match: Callable[[PrefixMatch], PrefixMatch] | None = None

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        *,
        index: BlockIndex | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        hash_algo: HashAlgo = HashAlgo.SHA256,
        rng: random.Random | None = None,
        clock: Callable[[], float] | None = None,
        on_timing: Callable[[str, float], None] | None = None,
        memo: BlockKeyMemo | None = None,
    ) -> Scheduler:
        """Build a scheduler from a parsed YAML mapping (see the module docstring).

        Raises:
            ConfigError: unknown plugin types or references, bad parameters or weights.
        """
        rng = rng if rng is not None else random.Random()
        ctx = PluginContext(rng=rng, block_size=block_size, hash_algo=HashAlgo(hash_algo))
        profiles, pd = parse_config(config, ctx)
        return cls(
            profiles,
            index=index,
            block_size=block_size,
            hash_algo=hash_algo,
            pd=pd,
            rng=rng,
            clock=clock,
            on_timing=on_timing,
            memo=memo,
        )

    def hasher(self, namespace: Namespace) -> BlockHasher:
        """The block hasher for one namespace (cached)."""
        last = self._last_hasher
        if last is not None and last[0] is namespace:
            return last[1]
        hasher = self._hashers.get(namespace)
        if hasher is None:
            hasher = self._hashers[namespace] = BlockHasher(namespace, self.block_size, self.hash_algo)
        self._last_hasher = (namespace, hasher)
        return hasher

    def match(
        self,
        request: RoutingRequest,
        block_keys: Sequence[BlockKey] | None = None,
        *,
        aligned: bool = True,
    ) -> PrefixMatch:
        """Match ``request``'s prefix against the index (empty without an index).

        Every index match goes through here: :meth:`pick` calls it when ``request.prefix`` is
        ``None``; with an index that does network I/O the gateway calls it on a worker thread
        first and passes the result in ``request.prefix``; the simulator calls it with the keys
        it keeps per prompt.

        Args:
            request: the request.
            block_keys: the prompt's block keys in ``request.namespace``, where the caller holds
                them already (``None``: hashed here from ``request.tokens``).
            aligned: apply :attr:`align_match` (``False``: the index's own block runs).

        Raises:
            TierUnavailableError: a remote index cannot be reached.
        """
        if self.index is None:
            return PrefixMatch(
                self.hasher(request.namespace).num_full_blocks(request.num_tokens), self.block_size
            )
        if block_keys is None:
            hasher = self.hasher(request.namespace)
            match = match_prefix(self.index, hasher, request.tokens, self.memo, request.known_prefix)
            if request.num_prompt_tokens is not None:  # only the prompt's leading ids are known
                match.num_blocks = hasher.num_full_blocks(request.num_tokens)
        else:
            match = match_prefix_keys(self.index, block_keys, len(block_keys), self.block_size)
        return match if self.align_match is None or not aligned else self.align_match(match)

    def rank(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[PodId] | None:
        """The default profile's ranking of the healthy ``endpoints``, best first.

        What :meth:`pick` decides without its packaging (scores, predicted hits), for callers that
        only need the endpoint; a P/D scheduler has no single ranking, so use :meth:`pick` there.

        Raises:
            ValueError: the scheduler has a P/D decider.
        """
        if self.pd is not None:
            raise ValueError("a P/D scheduler decides with pick()")
        healthy = self._prepare(request, endpoints)
        if not healthy:
            return None
        result = self._run(self.profiles[self._default_profile_name()], request, healthy)
        return None if result is None else result.ranked

    def predicted_ttfts(
        self, request: RoutingRequest, endpoints: list[EndpointState], *, work_ahead_only: bool = False
    ) -> dict[PodId, float] | None:
        """The time to first token the deciding profile predicts for ``request`` on each endpoint.

        Flow control's saturation test: the deciding profile (the default one, or the decode
        profile of a P/D scheduler) filters the healthy ``endpoints`` and its first
        ``ttft-estimate-scorer`` estimates each; nothing is picked and no plugin state changes.

        Args:
            request: the request; ``request.prefix`` is filled from the index when ``None``.
            endpoints: current state of every known endpoint; unhealthy ones are skipped.
            work_ahead_only: only the work queued ahead of the request (the estimate's queue
                term), none of its own.

        Returns:
            Seconds per endpoint that passes the profile's filters, or ``None`` when the profile has
            no ``ttft-estimate-scorer``.
        """
        profile = self.profiles[
            self.pd.decode_profile if self.pd is not None else self._default_profile_name()
        ]
        estimator = next(
            (ws.scorer for ws in profile.scorers if isinstance(ws.scorer, TTFTEstimateScorer)), None
        )
        if estimator is None:
            return None
        candidates = self._prepare(request, endpoints)
        for flt in profile.filters:
            if not candidates:
                break
            candidates = flt.filter(request, candidates)
        if work_ahead_only:
            return {e.pod: estimator.work_ahead(e) for e in candidates}
        return {e.pod: estimator.estimate(request, e) for e in candidates}

    def _prepare(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[EndpointState]:
        """Fill ``request.prefix`` from the index if needed; return the healthy endpoints."""
        if request.prefix is None:
            request.prefix = self.match(request)
        return endpoints if all(map(_HEALTHY, endpoints)) else [e for e in endpoints if e.healthy]

    def _default_profile_name(self) -> str:
        return DEFAULT_PROFILE if DEFAULT_PROFILE in self.profiles else next(iter(self.profiles))

    def pick(self, request: RoutingRequest, endpoints: list[EndpointState]) -> Decision | None:
        """Choose where ``request`` goes.

        Args:
            request: the request; ``request.prefix`` is filled from the index when ``None``.
            endpoints: current state of every known endpoint; unhealthy ones are skipped.

        Returns:
            The decision, or ``None`` when no healthy endpoint passes the filters.
        """
        healthy = self._prepare(request, endpoints)
        if not healthy:
            return None
        if self.pd is None:
            name = self._default_profile_name()
            result = self._run(self.profiles[name], request, healthy)
            if result is None:
                return None
            return self._decide(request, result, name, None)
        pd = self.pd
        decode = self._run(self.profiles[pd.decode_profile], request, healthy)
        if decode is None:
            return None
        target = decode.ranked[0]
        assert request.prefix is not None, "_prepare fills request.prefix"
        uncached = request.num_tokens - request.prefix.hit_tokens(target)
        prefill: PodId | None = None
        if uncached > pd.threshold:
            chosen = self._run(self.profiles[pd.prefill_profile], request, healthy)
            if chosen is not None and chosen.ranked[0] != target:
                prefill = chosen.ranked[0]
        return self._decide(request, decode, pd.decode_profile, prefill)

    def _decide(
        self, request: RoutingRequest, result: _Ranked, profile: str, prefill: PodId | None
    ) -> Decision:
        target = result.ranked[0]
        assert request.prefix is not None, "pick() must fill request.prefix before deciding"
        terms, scores = result.terms_and_scores()
        return Decision(
            endpoint=target,
            ranked=result.ranked,
            scores=scores,
            prefill=prefill,
            predicted_hit_tokens=request.prefix.hit_tokens(target),
            profile=profile,
            terms=terms,
        )

    def _run(
        self, profile: Profile, request: RoutingRequest, endpoints: list[EndpointState]
    ) -> _Ranked | None:
        candidates = endpoints
        for flt in profile.filters:
            candidates = flt.filter(request, candidates)
            if not candidates:
                return None
        n = len(candidates)
        columns: list[list[float]] = []
        weights: list[float] = []
        clock = self.clock
        on_timing = self.on_timing
        for ws in profile.scorers:
            if clock is None:
                scores = ws.scorer.score(request, candidates)
            else:
                start = clock()
                scores = ws.scorer.score(request, candidates)
                if on_timing is not None:
                    on_timing(ws.name, clock() - start)
            assert len(scores) == n, f"scorer {ws.name!r} returned {len(scores)} scores for {n} endpoints"
            columns.append(clamp_scores(scores) if ws.clamp else scores)
            weights.append(ws.weight)
        totals = combine_scores(columns, weights, n)
        picker = profile.picker if profile.picker is not None else self._default_picker
        ranked = picker.pick(candidates, totals)
        for observer in profile.observers:
            observer.observe(request, ranked[0])
        return _Ranked(ranked, candidates, totals, [ws.name for ws in profile.scorers], weights, columns)


def clamp_scores(scores: list[float]) -> list[float]:
    """``scores`` with every value outside [0, 1] clamped (NaN counts as 0)."""
    if all(0.0 <= s <= 1.0 for s in scores):
        return scores
    return [0.0 if not s >= 0.0 else 1.0 if s > 1.0 else s for s in scores]


def combine_scores(columns: list[list[float]], weights: list[float], n: int) -> list[float]:
    """Weighted mean of per-scorer scores (already in [0, 1]).

    Args:
        columns: one list of ``n`` scores per scorer.
        weights: each scorer's weight, in the same order.
        n: number of candidates.
    """
    weight_sum = 0.0
    for w in weights:
        weight_sum += w
    div = weight_sum if weight_sum > 0 else 1.0
    # Every total is summed left to right from 0.0 and divided once, whatever the arity; the
    # common arities are spelled out because they run once per routed request.
    if len(columns) == 5:  # the default preset
        (a, b, c, d, e), (wa, wb, wc, wd, we) = columns, weights
        return [
            (0.0 + wa * x + wb * y + wc * z + wd * v + we * u) / div
            for x, y, z, v, u in zip(a, b, c, d, e, strict=True)
        ]
    if len(columns) == 4:
        (a, b, c, d), (wa, wb, wc, wd) = columns, weights
        return [
            (0.0 + wa * x + wb * y + wc * z + wd * v) / div for x, y, z, v in zip(a, b, c, d, strict=True)
        ]
    if len(columns) == 3:
        (a, b, c), (wa, wb, wc) = columns, weights
        return [(0.0 + wa * x + wb * y + wc * z) / div for x, y, z in zip(a, b, c, strict=True)]
    if len(columns) == 2:
        (a, b), (wa, wb) = columns, weights
        return [(0.0 + wa * x + wb * y) / div for x, y in zip(a, b, strict=True)]
    totals = [0.0] * n
    for col, w in zip(columns, weights, strict=True):
        totals = [t + w * s for t, s in zip(totals, col, strict=True)]
    return [t / div for t in totals]
