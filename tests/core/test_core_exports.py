import types

import kvmesh
import kvmesh.core as core


def _public(package: types.ModuleType) -> set[str]:
    """Names a package binds that are neither private nor its own submodules."""
    return {
        name
        for name, value in vars(package).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }


def test_all_is_sorted_and_complete():
    assert kvmesh.__all__ == sorted(kvmesh.__all__)
    assert _public(kvmesh) == set(kvmesh.__all__) - {"__version__"}


def test_core_all_is_sorted_and_complete():
    # ruff's __all__ order (RUF022): CONSTANTS, then Classes, then functions
    key = lambda name: (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)  # noqa: E731
    assert core.__all__ == sorted(core.__all__, key=key)
    for name in core.__all__:
        assert getattr(core, name) is not None
    assert _public(core) == set(core.__all__), _public(core) ^ set(core.__all__)
