import types

import kvmesh


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
