"""Scheduler configs: presets and YAML read, plugins built and checked, profiles assembled.

See :mod:`kvmesh.router.scheduler` for the config layout; :func:`parse_config` turns one into the
profiles and the P/D settings :class:`~kvmesh.router.scheduler.Scheduler` runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvmesh.errors import ConfigError
from kvmesh.router.plugins.base import (
    Filter,
    Observer,
    Params,
    Picker,
    Plugin,
    PluginContext,
    PluginKind,
    Scorer,
)
from kvmesh.router.plugins.registry import PD_PROFILE_HANDLER, build_plugin, canonical_type, kind_of

PRESETS_DIR = Path(__file__).parent / "presets"
PRESET_NAMES = ("precise", "llmd-precise", "approximate", "load", "random", "round-robin", "pd")
DEFAULT_PROFILE = "default"


@dataclass(slots=True)
class WeightedScorer:
    """A scorer instance in a profile with its weight."""

    name: str
    scorer: Scorer
    weight: float
    clamp: bool = True
    """Clamp its scores to [0, 1]; off for scorers whose ``scores_in_unit_range`` is true."""


@dataclass(slots=True)
class Profile:
    """One filter → score → pick pipeline."""

    name: str
    filters: list[Filter] = field(default_factory=list)
    scorers: list[WeightedScorer] = field(default_factory=list)
    picker: Picker | None = None
    observers: list[Observer] = field(default_factory=list)


@dataclass(slots=True)
class PDConfig:
    """The P/D decider's settings.

    Attributes:
        threshold: split a request when more than this many prompt tokens are not cached on the
            chosen decode endpoint.
        prefill_profile: profile that picks the prefill endpoint.
        decode_profile: profile that picks the decode endpoint.
    """

    threshold: int
    prefill_profile: str = "prefill"
    decode_profile: str = "decode"


def load_scheduler_config(source: str | Path) -> dict[str, Any]:
    """Read a scheduler config: a preset name or a YAML file path.

    A router config file may hold the scheduler under a ``scheduler:`` key; plain scheduler files
    have ``plugins`` and ``schedulingProfiles`` at the top.

    Raises:
        ConfigError: unknown preset, unreadable file or invalid YAML.
    """
    text_source = str(source)
    path = PRESETS_DIR / f"{text_source}.yaml" if text_source in PRESET_NAMES else Path(text_source)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(
            f"no scheduler config {text_source!r}: not a preset ({', '.join(PRESET_NAMES)}) nor a file"
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    scheduler = raw.get("scheduler", raw)
    if not isinstance(scheduler, dict):
        raise ConfigError(f"{path}: 'scheduler' must be a mapping")
    return scheduler


def parse_config(config: Mapping[str, Any], ctx: PluginContext) -> tuple[dict[str, Profile], PDConfig | None]:
    """The profiles and P/D settings of a parsed scheduler config, every plugin built with ``ctx``.

    Raises:
        ConfigError: unknown keys, plugin types or references, bad parameters or weights.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"scheduler config must be a mapping, got {type(config).__name__}")
    unknown = sorted(set(config) - {"plugins", "schedulingProfiles"})
    if unknown:
        raise ConfigError(f"unknown scheduler config keys {unknown} (expected plugins, schedulingProfiles)")
    plugins: dict[str, tuple[PluginKind, Plugin] | PDConfig] = {}
    pd: PDConfig | None = None
    entries = config.get("plugins") or []
    if not isinstance(entries, list):
        raise ConfigError("'plugins' must be a list")
    for entry in entries:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("type"), str):
            raise ConfigError(f"each plugin needs a string 'type', got {entry!r}")
        type_name = canonical_type(entry["type"])
        name = entry.get("name", entry["type"])
        if not isinstance(name, str) or name in plugins:
            raise ConfigError(f"plugin names must be unique strings, got {name!r}")
        if type_name == PD_PROFILE_HANDLER:
            params = Params(name, entry.get("parameters"))
            pd = PDConfig(
                threshold=params.integer("threshold", 512, minimum=0),
                prefill_profile=params.string("prefillProfile", "prefill"),
                decode_profile=params.string("decodeProfile", "decode"),
            )
            params.check_unknown()
            plugins[name] = pd
            continue
        plugins[name] = (kind_of(type_name), build_plugin(type_name, name, entry.get("parameters"), ctx))
    raw_profiles = config.get("schedulingProfiles") or []
    if not isinstance(raw_profiles, list) or not raw_profiles:
        raise ConfigError("'schedulingProfiles' must be a non-empty list")
    profiles: dict[str, Profile] = {}
    for raw in raw_profiles:
        if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str):
            raise ConfigError(f"each scheduling profile needs a string 'name', got {raw!r}")
        profile = Profile(raw["name"])
        refs = raw.get("plugins") or []
        if not isinstance(refs, list):
            raise ConfigError(f"profile {profile.name!r}: 'plugins' must be a list")
        for ref in refs:
            _add_to_profile(profile, ref, plugins)
        profiles[profile.name] = profile
    return profiles, pd


def _add_to_profile(
    profile: Profile, ref: Any, plugins: Mapping[str, tuple[PluginKind, Plugin] | PDConfig]
) -> None:
    if not isinstance(ref, Mapping) or not isinstance(ref.get("pluginRef"), str):
        raise ConfigError(f"profile {profile.name!r}: each entry needs a string 'pluginRef', got {ref!r}")
    name = ref["pluginRef"]
    entry = plugins.get(name)
    if entry is None or isinstance(entry, PDConfig):
        raise ConfigError(f"profile {profile.name!r}: no filter, scorer or picker named {name!r}")
    kind, plugin = entry
    weight = ref.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
        raise ConfigError(f"profile {profile.name!r}: weight of {name!r} must be a non-negative number")
    # build_plugin checked each plugin against its registered kind's protocol.
    match kind:
        case PluginKind.FILTER:
            assert isinstance(plugin, Filter), f"filter {name!r} passed its load check"
            profile.filters.append(plugin)
        case PluginKind.SCORER:
            assert isinstance(plugin, Scorer), f"scorer {name!r} passed its load check"
            clamp = not plugin.scores_in_unit_range
            profile.scorers.append(WeightedScorer(name, plugin, float(weight), clamp=clamp))
        case PluginKind.PICKER:
            assert isinstance(plugin, Picker), f"picker {name!r} passed its load check"
            if profile.picker is not None:
                raise ConfigError(f"profile {profile.name!r}: more than one picker")
            profile.picker = plugin
    if isinstance(plugin, Observer) and all(o is not plugin for o in profile.observers):
        profile.observers.append(plugin)
