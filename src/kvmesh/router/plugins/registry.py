"""Type names of every scheduling plugin and the one table that registers them.

A YAML config names plugins by these constants (``type:``). Each type is declared a filter, scorer or
picker in :data:`REGISTRY`, and every plugin built is checked against that kind's protocol. Deprecated
names stay registered in :data:`DEPRECATED_ALIASES` and resolve to their replacement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.errors import ConfigError
from kvmesh.router.plugins import filters, lora, pickers, scorers, ttft_estimate
from kvmesh.router.plugins.base import Params, Plugin, PluginContext, PluginFactory, PluginKind, check_plugin
from kvmesh.router.prefill_ledger import PrefillLedger

PREFILL_FILTER = "prefill-filter"
DECODE_FILTER = "decode-filter"
QUEUE_DEPTH_FILTER = "queue-depth-filter"
LORA_AFFINITY_FILTER = "lora-affinity-filter"

PRECISE_PREFIX_SCORER = "precise-prefix-cache-scorer"
APPROXIMATE_PREFIX_SCORER = "prefix-cache-scorer"
QUEUE_SCORER = "queue-scorer"
KV_CACHE_UTILIZATION_SCORER = "kv-cache-utilization-scorer"
ACTIVE_REQUEST_SCORER = "active-request-scorer"
SESSION_AFFINITY_SCORER = "session-affinity-scorer"
RANDOM_SCORER = "random-scorer"
ROUND_ROBIN_SCORER = "round-robin-scorer"
TTFT_ESTIMATE_SCORER = "ttft-estimate-scorer"
LORA_AFFINITY_SCORER = "lora-affinity-scorer"

MAX_SCORE_PICKER = "max-score-picker"
WEIGHTED_RANDOM_PICKER = "weighted-random-picker"
RANDOM_PICKER = "random-picker"

PD_PROFILE_HANDLER = "pd-profile-handler"
"""Not a plugin object: configures the P/D decider (see :mod:`kvmesh.router.scheduler`)."""


@dataclass(frozen=True, slots=True)
class Registration:
    """A plugin type: what it is declared to be and the factory that builds it."""

    kind: PluginKind
    factory: PluginFactory


REGISTRY: dict[str, Registration] = {
    PREFILL_FILTER: Registration(PluginKind.FILTER, filters.make_prefill_filter),
    DECODE_FILTER: Registration(PluginKind.FILTER, filters.make_decode_filter),
    QUEUE_DEPTH_FILTER: Registration(PluginKind.FILTER, filters.make_queue_depth_filter),
    LORA_AFFINITY_FILTER: Registration(PluginKind.FILTER, lora.make_lora_affinity_filter),
    PRECISE_PREFIX_SCORER: Registration(PluginKind.SCORER, scorers.make_precise_prefix_scorer),
    APPROXIMATE_PREFIX_SCORER: Registration(PluginKind.SCORER, scorers.make_approximate_prefix_scorer),
    QUEUE_SCORER: Registration(PluginKind.SCORER, scorers.make_queue_scorer),
    KV_CACHE_UTILIZATION_SCORER: Registration(PluginKind.SCORER, scorers.make_kv_cache_utilization_scorer),
    ACTIVE_REQUEST_SCORER: Registration(PluginKind.SCORER, scorers.make_active_request_scorer),
    SESSION_AFFINITY_SCORER: Registration(PluginKind.SCORER, scorers.make_session_affinity_scorer),
    RANDOM_SCORER: Registration(PluginKind.SCORER, scorers.make_random_scorer),
    ROUND_ROBIN_SCORER: Registration(PluginKind.SCORER, scorers.make_round_robin_scorer),
    TTFT_ESTIMATE_SCORER: Registration(PluginKind.SCORER, ttft_estimate.make_ttft_estimate_scorer),
    LORA_AFFINITY_SCORER: Registration(PluginKind.SCORER, lora.make_lora_affinity_scorer),
    MAX_SCORE_PICKER: Registration(PluginKind.PICKER, pickers.make_max_score_picker),
    WEIGHTED_RANDOM_PICKER: Registration(PluginKind.PICKER, pickers.make_weighted_random_picker),
    RANDOM_PICKER: Registration(PluginKind.PICKER, pickers.make_random_picker),
}

DEPRECATED_ALIASES: dict[str, str] = {
    "kv-cache-scorer": KV_CACHE_UTILIZATION_SCORER,
    "approximate-prefix-cache-scorer": APPROXIMATE_PREFIX_SCORER,
    "load-aware-scorer": QUEUE_SCORER,
    "session-affinity": SESSION_AFFINITY_SCORER,
}


def canonical_type(type_name: str) -> str:
    """Resolve a deprecated alias to its current type name.

    Raises:
        ConfigError: the name is not registered.
    """
    resolved = DEPRECATED_ALIASES.get(type_name, type_name)
    if resolved not in REGISTRY and resolved != PD_PROFILE_HANDLER:
        known = ", ".join(sorted([*REGISTRY, PD_PROFILE_HANDLER]))
        raise ConfigError(f"unknown plugin type {type_name!r}; known types: {known}")
    return resolved


def kind_of(type_name: str) -> PluginKind:
    """What a registered plugin type is declared to be.

    Raises:
        ConfigError: the name is not a registered plugin type.
    """
    resolved = canonical_type(type_name)
    if resolved == PD_PROFILE_HANDLER:
        raise ConfigError(
            f"{PD_PROFILE_HANDLER!r} configures the P/D decider; it is not a filter, scorer or picker"
        )
    return REGISTRY[resolved].kind


def build_plugin(type_name: str, name: str, raw_params: Any, ctx: PluginContext) -> Plugin:
    """Instantiate one plugin from its YAML entry and check it against its declared kind.

    Raises:
        ConfigError: unknown type, parameters the factory rejects, or a plugin that lacks a member
            of its kind's protocol.
    """
    type_name = canonical_type(type_name)
    registration = REGISTRY[type_name]
    params = Params(name, raw_params)
    try:
        plugin = registration.factory(name, params, ctx)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"plugin {name!r}: {exc}") from exc
    params.check_unknown()
    check_plugin(plugin, registration.kind, name, type_name)
    return plugin


def prefill_ledger_of(config: Mapping[str, Any]) -> PrefillLedger:
    """A prefill ledger that weighs outstanding work as the config's first ``ttft-estimate-scorer``
    weighs a prompt (``attentionContextTokens``, the prior of the attention context the ledger learns
    unless ``learnAttentionContext`` is false, within ``maxLearnedContextRatio`` of it) and, where it
    prices live sessions (``sessionKVWeight``), keeps them for ``sessionIdleSeconds``; plain tokens where no such scorer is configured.

    Raises:
        ConfigError: the scorer's parameters are malformed.
    """
    for plugin in config.get("plugins") or []:
        if isinstance(plugin, Mapping) and canonical_type(str(plugin.get("type"))) == TTFT_ESTIMATE_SCORER:
            name = str(plugin.get("name") or TTFT_ESTIMATE_SCORER)
            scorer = ttft_estimate.make_ttft_estimate_scorer(
                name, Params(name, plugin.get("parameters")), PluginContext()
            )
            return PrefillLedger(
                attention_context=scorer.attention_context,
                learn_context=scorer.learn_context,
                max_context_ratio=scorer.max_context_ratio,
                session_idle_s=scorer.session_idle_s if scorer.kv_price.session_weight > 0 else None,
            )
    return PrefillLedger()


def attention_context_of(config: Mapping[str, Any]) -> float:
    """The first ``ttft-estimate-scorer``'s ``attentionContextTokens`` in a scheduler config (0 when
    none sets it): the prefill ledger must weigh outstanding work as that scorer weighs a prompt."""
    for plugin in config.get("plugins") or []:
        if isinstance(plugin, Mapping) and canonical_type(str(plugin.get("type"))) == TTFT_ESTIMATE_SCORER:
            value = (plugin.get("parameters") or {}).get("attentionContextTokens", 0.0)
            return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0
    return 0.0
