"""Options dataclasses built from parsed command lines, argument by argument of the same name."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

_Options = TypeVar("_Options")


def options_from_args(options_type: type[_Options], args: argparse.Namespace, **converted: Any) -> _Options:
    """``options_type`` (a dataclass) with each init field taken from the parsed argument of its name.

    Args:
        options_type: the options dataclass.
        args: the parsed command line; fields it has no argument for keep their defaults.
        converted: values for fields whose argument needs converting (or is not named after them).
    """
    if not dataclasses.is_dataclass(options_type):
        raise TypeError(f"{options_type.__name__} is not a dataclass")
    parsed = vars(args)
    values = {
        f.name: parsed[f.name]
        for f in dataclasses.fields(options_type)
        if f.init and f.name in parsed and f.name not in converted
    }
    return options_type(**values, **converted)
