"""The router package's public names stay deliberate."""

import kvmesh.router as router


def test_all_is_sorted_and_complete():
    assert router.__all__ == sorted(router.__all__)
    unbound = [name for name in router.__all__ if name not in vars(router)]
    assert unbound == [], f"__all__ names what kvmesh.router does not bind: {unbound}"
    public = {n for n in vars(router) if not n.startswith("_") and n[0].isupper()}
    assert public <= set(router.__all__), public - set(router.__all__)
