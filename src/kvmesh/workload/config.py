"""Workloads from YAML: inference-perf's ``load``/``data`` layout or a flat one."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kvmesh.errors import ConfigError
from kvmesh.workload.agentic import AgenticWorkload
from kvmesh.workload.mooncake import MooncakeTraceWorkload
from kvmesh.workload.multi_turn import MultiTurnWorkload
from kvmesh.workload.shared_prefix import SharedPrefixWorkload
from kvmesh.workload.spec import Stage, Workload


def _parse_stages(raw: Any) -> list[Stage] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"stages must be a non-empty list of {{rate, duration[, warmup]}}, got {raw!r}")
    stages = []
    for item in raw:
        if not isinstance(item, Mapping) or not {"rate", "duration"} <= set(item) <= {
            "rate",
            "duration",
            "warmup",
        }:
            raise ConfigError(f"each stage must be {{rate, duration[, warmup]}}, got {item!r}")
        warmup = item.get("warmup", False)
        if not isinstance(warmup, bool):
            raise ConfigError(f"a stage's warmup must be true or false, got {warmup!r}")
        stages.append(Stage(rate=float(item["rate"]), duration=float(item["duration"]), warmup=warmup))
    return stages


_KINDS = {
    "shared_prefix": SharedPrefixWorkload,
    "multi_turn": MultiTurnWorkload,
    "mooncake": MooncakeTraceWorkload,
    "mooncake_trace": MooncakeTraceWorkload,
    "agentic": AgenticWorkload,
}


def load_workload(source: str | Path | Mapping[str, Any]) -> Workload:
    """Build a workload from a YAML file, a YAML string or a mapping.

    Two layouts are accepted. inference-perf's::

        load: {type: poisson, stages: [{rate: 15, duration: 50}]}
        data: {type: shared_prefix, shared_prefix: {num_groups: 150, ...}}

    and a flat one::

        type: shared_prefix          # or multi_turn, mooncake, agentic
        num_groups: 150
        stages: [{rate: 15, duration: 50}]
        arrival: poisson

    Raises:
        ConfigError: unknown type, missing or unknown fields, bad values.
    """
    cfg = _read_config(source)
    if "data" in cfg:
        data = cfg["data"]
        load = cfg.get("load") or {}
        if not isinstance(data, Mapping) or not isinstance(load, Mapping):
            raise ConfigError("'data' and 'load' must be mappings")
        kind = str(data.get("type", ""))
        params = dict(data.get(kind) or {})
        if "stages" in load:
            params["stages"] = load["stages"]
        if "type" in load:
            params["arrival"] = load["type"]
        for key in ("seed", "num_requests"):
            if key in cfg:
                params[key] = cfg[key]
    else:
        params = dict(cfg)
        kind = str(params.pop("type", ""))
    factory = _KINDS.get(kind)
    if factory is None:
        raise ConfigError(f"unknown workload type {kind!r}; choose one of {sorted(_KINDS)}")
    if "stages" in params:
        params["stages"] = _parse_stages(params["stages"])
    if factory is MooncakeTraceWorkload:
        params.pop("stages", None)
        params.pop("arrival", None)
    try:
        workload: Workload = factory(**params)
    except TypeError as exc:
        raise ConfigError(f"{kind} workload: {exc}") from exc
    return workload


def _read_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    text: str
    if isinstance(source, Path) or (
        isinstance(source, str) and "\n" not in source and Path(source).is_file()
    ):
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read workload file {source}: {exc}") from exc
    else:
        text = str(source)
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"workload is not valid YAML: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ConfigError(f"workload must be a mapping, got {type(cfg).__name__}")
    return cfg
