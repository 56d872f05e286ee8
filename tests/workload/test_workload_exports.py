"""The workload package's public names stay deliberate."""

import types

import kvmesh.workload as package


def _isort_key(name: str) -> tuple[int, str]:
    # ruff's __all__ order (RUF022): CONSTANTS, then Classes, then functions
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def test_all_is_sorted_and_complete():
    assert package.__all__ == sorted(package.__all__, key=_isort_key)
    for name in package.__all__:
        assert getattr(package, name) is not None
    public = {
        name
        for name, value in vars(package).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(package.__all__), public ^ set(package.__all__)
