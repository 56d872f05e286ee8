import kvmesh


def test_all_is_sorted_and_complete():
    assert kvmesh.__all__ == sorted(kvmesh.__all__)
    public = {name for name in dir(kvmesh) if not name.startswith("_")} - {
        "cli",
        "core",
        "errors",
        "store",
        "engine",
        "router",
        "fleet",
        "bench",
        "sim",
        "integrations",
    }
    assert public == set(kvmesh.__all__) - {"__version__"}
