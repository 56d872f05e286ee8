"""Every package's public names stay deliberate: ``__all__`` sorted as ruff sorts it and complete."""

import importlib
import types

import pytest

PACKAGES = [
    "bench",
    "chaos",
    "core",
    "demo",
    "engine",
    "fleet",
    "integrations",
    "router.plugins",
    "sim",
    "store",
    "store.backends",
    "workload",
]


def _isort_key(name: str) -> tuple[int, str]:
    # ruff's __all__ order (RUF022): CONSTANTS, then Classes, then functions
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_complete(name: str) -> None:
    package = importlib.import_module(f"kvmesh.{name}")
    assert package.__all__ == sorted(package.__all__, key=_isort_key)
    for export in package.__all__:
        assert getattr(package, export) is not None
    public = {
        export
        for export, value in vars(package).items()
        if not export.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(package.__all__), public ^ set(package.__all__)
