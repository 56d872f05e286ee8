"""The three plugin interfaces and what their factories receive.

A scheduling cycle runs ``filters → scorers → picker`` over the healthy endpoints::

    endpoints ─► Filter ─► Filter ─► [Scorer × weight, ...] ─► Σ w·s / Σ w ─► Picker ─► ranked pods

Contracts:

* ``Filter.filter`` returns a sub-list of its input, order kept. Returning an empty list is
  allowed; the scheduler then answers "no endpoint".
* ``Scorer.score`` returns one float per endpoint, same order; values are clamped to [0, 1] by
  the scheduler, and higher is better.
* ``Picker.pick`` returns every candidate ranked best first; the gateway retries down the list.
* Plugins that learn from decisions (session affinity, round-robin, approximate prefix) also
  implement ``Observer.observe``, called once with the endpoint chosen by their profile.

Plugins never do I/O and never read the wall clock; randomness comes from the ``rng`` in
:class:`PluginContext`, so the fleet simulator can drive them in virtual time.
"""

from __future__ import annotations

import enum
import inspect
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import UnionType
from typing import Any, Protocol, runtime_checkable

from kvmesh.core.hashing import DEFAULT_BLOCK_SIZE, HashAlgo
from kvmesh.core.types import Medium, PodId
from kvmesh.errors import ConfigError
from kvmesh.router.types import EndpointState, RoutingRequest


@runtime_checkable
class Filter(Protocol):
    """Drops endpoints that must not serve a request."""

    def filter(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[EndpointState]:
        """Return the endpoints that may serve ``request``, in input order."""
        ...


@runtime_checkable
class Scorer(Protocol):
    """Rates endpoints for a request.

    The scheduler clamps each score to [0, 1] before weighting, unless ``scores_in_unit_range``
    promises that every score the scorer returns already lies there.
    """

    @property
    def scores_in_unit_range(self) -> bool:
        """Whether every score :meth:`score` returns lies in [0, 1] already."""
        ...

    def score(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[float]:
        """One score in [0, 1] per endpoint (higher is better), in input order."""
        ...


@runtime_checkable
class Picker(Protocol):
    """Turns weighted scores into a ranking."""

    def pick(self, endpoints: list[EndpointState], scores: list[float]) -> list[PodId]:
        """Every endpoint's pod, best first."""
        ...


@runtime_checkable
class Observer(Protocol):
    """A plugin that learns which endpoint its profile chose."""

    def observe(self, request: RoutingRequest, pod: PodId) -> None:
        """Record that ``request`` was sent to ``pod``."""
        ...


@dataclass(slots=True)
class PluginContext:
    """What every factory may use.

    Attributes:
        rng: the scheduler's random source (seeded in tests and the simulator).
        block_size: the engines' tokens per block.
        hash_algo: the engines' key digest.
    """

    rng: random.Random = field(default_factory=random.Random)
    block_size: int = DEFAULT_BLOCK_SIZE
    hash_algo: HashAlgo = HashAlgo.SHA256


Plugin = Filter | Scorer | Picker
PluginFactory = Callable[[str, "Params", PluginContext], Plugin]


class PluginKind(enum.Enum):
    """What a plugin type is declared to be in the registry, and the members that makes it need."""

    FILTER = ("filter", Filter, ("filter",))
    SCORER = ("scorer", Scorer, ("score", "scores_in_unit_range"))
    PICKER = ("picker", Picker, ("pick",))

    def __init__(self, label: str, protocol: type, members: tuple[str, ...]) -> None:
        self.label = label
        self.protocol = protocol
        self.members = members


_MISSING = object()


def check_plugin(plugin: object, kind: PluginKind, name: str, type_name: str) -> None:
    """Check that ``plugin`` has every member its declared ``kind`` needs.

    Raises:
        ConfigError: naming the plugin, its type and each missing member.
    """
    missing = [m for m in kind.members if inspect.getattr_static(plugin, m, _MISSING) is _MISSING]
    if missing or not isinstance(plugin, kind.protocol):
        raise ConfigError(
            f"plugin {name!r} (type {type_name!r}) is registered as a {kind.label}, but "
            f"{type(plugin).__name__} lacks {', '.join(missing) or 'a conforming member'}"
        )


class Params:
    """A plugin's ``parameters`` map with typed getters that name the plugin in errors.

    Args:
        plugin: the plugin instance's name, for messages.
        raw: the YAML mapping (``None`` means empty).
    """

    def __init__(self, plugin: str, raw: Mapping[str, Any] | None) -> None:
        if raw is not None and not isinstance(raw, Mapping):
            raise ConfigError(f"plugin {plugin!r}: parameters must be a mapping, got {type(raw).__name__}")
        self.plugin = plugin
        self.raw: dict[str, Any] = dict(raw or {})
        self._used: set[str] = set()

    def number(self, key: str, default: float, *, minimum: float | None = None) -> float:
        """A float parameter."""
        value = self._take(key, default, int | float, "a number")
        self._check_minimum(key, value, minimum)
        return float(value)

    def integer(self, key: str, default: int, *, minimum: int | None = None) -> int:
        """An int parameter."""
        value: int = self._take(key, default, int, "an integer")
        self._check_minimum(key, value, minimum)
        return value

    def boolean(self, key: str, default: bool) -> bool:
        """A true/false parameter."""
        value: bool = self._take(key, default, bool, "true or false")
        return value

    def string(self, key: str, default: str) -> str:
        """A string parameter."""
        value: str = self._take(key, default, str, "a string")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        """A mapping parameter (empty when absent)."""
        return dict(self._take(key, {}, Mapping, "a mapping"))

    def _take(self, key: str, default: Any, kind: type | UnionType, what: str) -> Any:
        """The parameter ``key`` (``default`` when absent), marked used; a ``kind`` instance or an error."""
        value = self.raw.get(key, default)
        self._used.add(key)
        # YAML's true/false are ints to isinstance: only the boolean getter takes them.
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ConfigError(f"plugin {self.plugin!r}: {key} must be {what}, got {value!r}")
        return value

    def _check_minimum(self, key: str, value: float, minimum: float | None) -> None:
        if minimum is not None and value < minimum:
            raise ConfigError(f"plugin {self.plugin!r}: {key} must be >= {minimum}, got {value}")

    def check_unknown(self) -> None:
        """Reject parameters no getter asked for (typos must not pass silently).

        Raises:
            ConfigError: an unknown parameter name.
        """
        unknown = sorted(set(self.raw) - self._used)
        if unknown:
            raise ConfigError(f"plugin {self.plugin!r}: unknown parameters {unknown}")


def tier_map(plugin: str, raw: Mapping[str, object], defaults: Mapping[Medium, float]) -> dict[Medium, float]:
    """A plugin's per-tier numbers (``tierWeights``, ``tierGBps``) over ``defaults``.

    Raises:
        ConfigError: an unknown tier or a value that is not a non-negative number.
    """
    out = dict(defaults)
    for name, value in raw.items():
        try:
            tier = Medium(str(name).upper())
        except ValueError as exc:
            raise ConfigError(f"plugin {plugin!r}: unknown tier {name!r} (GPU, CPU, DISK, SHARED)") from exc
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"plugin {plugin!r}: tier {name} needs a non-negative number, got {value!r}")
        out[tier] = float(value)
    return out
