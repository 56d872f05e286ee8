"""Pickers: turn weighted scores into a ranking of endpoints."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvmesh.core.types import PodId
from kvmesh.router.plugins.base import Params, Picker, PluginContext
from kvmesh.router.types import EndpointState


@dataclass(slots=True)
class MaxScorePicker:
    """Highest score first; equal scores are ordered at random (so ties spread load)."""

    rng: random.Random

    def pick(self, endpoints: list[EndpointState], scores: list[float]) -> list[PodId]:
        rand = self.rng.random
        # One random tie-break per endpoint, drawn in endpoint order; the pod only decides exact
        # (score, draw) ties, which 53-bit draws make practically impossible.
        keys = [(-s, rand(), e.pod) for s, e in zip(scores, endpoints, strict=True)]
        keys.sort()
        return [k[2] for k in keys]


@dataclass(slots=True)
class WeightedRandomPicker:
    """Draws the first endpoint among the ``top_k`` best with probability proportional to score.

    The rest follow in max-score order. With all scores zero the draw is uniform over the top k.
    """

    rng: random.Random
    top_k: int

    def pick(self, endpoints: list[EndpointState], scores: list[float]) -> list[PodId]:
        ranked = MaxScorePicker(self.rng).pick(endpoints, scores)
        if len(ranked) <= 1:
            return ranked
        score_of = {e.pod: s for e, s in zip(endpoints, scores, strict=True)}
        top = ranked[: self.top_k]
        weights = [score_of[p] for p in top]
        if sum(weights) <= 0.0:
            weights = [1.0] * len(top)
        first = self.rng.choices(top, weights=weights, k=1)[0]
        return [first, *(p for p in ranked if p != first)]


@dataclass(slots=True)
class RandomPicker:
    """Ignores scores: a uniformly random order."""

    rng: random.Random

    def pick(self, endpoints: list[EndpointState], scores: list[float]) -> list[PodId]:
        pods = [e.pod for e in endpoints]
        self.rng.shuffle(pods)
        return pods


def make_max_score_picker(name: str, params: Params, ctx: PluginContext) -> MaxScorePicker:
    return MaxScorePicker(ctx.rng)


def make_weighted_random_picker(name: str, params: Params, ctx: PluginContext) -> WeightedRandomPicker:
    return WeightedRandomPicker(ctx.rng, params.integer("topK", 2, minimum=1))


def make_random_picker(name: str, params: Params, ctx: PluginContext) -> RandomPicker:
    return RandomPicker(ctx.rng)


def _conforms(a: MaxScorePicker, b: WeightedRandomPicker, c: RandomPicker) -> tuple[Picker, Picker, Picker]:
    return a, b, c
