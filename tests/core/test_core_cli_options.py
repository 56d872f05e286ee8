"""Options dataclasses built from parsed command lines (``options_from_args``)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import pytest

from kvmesh.cli import build_parser
from kvmesh.core.cli_options import options_from_args
from kvmesh.engine.app import EngineOptions
from kvmesh.fleet.config import FleetConfig
from kvmesh.store.bench import BenchOptions


@dataclass(slots=True)
class _Options:
    name: str
    count: int = 1
    tags: tuple[str, ...] = ()
    extra: dict[str, str] = field(default_factory=dict)
    derived: int = field(init=False, default=0)


def test_fields_taken_by_name_converted_ones_given_missing_ones_default() -> None:
    args = argparse.Namespace(name="a", count=3, tags="x,y", unrelated=True, derived=9)
    options = options_from_args(_Options, args, tags=tuple(args.tags.split(",")))
    assert options == _Options(name="a", count=3, tags=("x", "y"))
    assert options.derived == 0  # not an init field: never taken from the arguments


def test_a_required_field_without_an_argument_is_an_error() -> None:
    with pytest.raises(TypeError):
        options_from_args(_Options, argparse.Namespace(count=2))


def test_not_a_dataclass_is_refused() -> None:
    with pytest.raises(TypeError, match="not a dataclass"):
        options_from_args(argparse.Namespace, argparse.Namespace())


def _init_fields(options_type: type) -> set[str]:
    return {f.name for f in dataclasses.fields(options_type) if f.init}


@pytest.mark.parametrize(
    ("argv", "options_type", "not_flags"),
    [
        (["engine"], EngineOptions, {"extra_info"}),
        (["store", "bench"], BenchOptions, set()),
        (
            ["up"],
            FleetConfig,
            {"start_router", "router_port", "engine_args", "router_args", "events", "stop_grace_s", "env"},
        ),
    ],
)
def test_cli_flags_are_named_after_their_options(
    argv: list[str], options_type: type, not_flags: set[str]
) -> None:
    """Each option the command sets has a flag of its own name, so none falls back to its default."""
    parsed = set(vars(build_parser().parse_args(argv)))
    assert _init_fields(options_type) - not_flags <= parsed
    assert not (not_flags & parsed)


def test_store_bench_flags_become_its_options() -> None:
    args = build_parser().parse_args(
        ["store", "bench", "--chunks", "7", "--dir", "/tmp/x", "--tiers", "cpu, disk,"]
    )
    options = options_from_args(BenchOptions, args, tiers=("cpu", "disk"))
    assert (options.num_chunks, options.workdir, options.tiers) == (7, "/tmp/x", ("cpu", "disk"))
