"""Scheduling plugins: filters, scorers and pickers, each configured from YAML by type name.

See ``README.md`` in this directory for every plugin's intent and parameters, and
:mod:`kvmesh.router.plugins.registry` for the type names.
"""

from kvmesh.router.plugins.base import Filter, Observer, Params, Picker, PluginContext, PluginKind, Scorer

__all__ = ["Filter", "Observer", "Params", "Picker", "PluginContext", "PluginKind", "Scorer"]
