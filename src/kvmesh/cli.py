"""The ``kvmesh`` command.

Each package registers its own subcommands from ``kvmesh.<package>.cli`` through a ``register``
function; handlers import their heavy dependencies (torch, transformers) only when they run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

_COMMAND_MODULES = (
    "kvmesh.core.cli",
    "kvmesh.store.cli",
    "kvmesh.engine.cli",
    "kvmesh.router.cli",
    "kvmesh.fleet.cli",
    "kvmesh.demo.cli",
    "kvmesh.bench.cli",
    "kvmesh.sim.cli",
    "kvmesh.chaos.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh",
        description="One cluster-wide KV cache for a fleet of LLM replicas.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
