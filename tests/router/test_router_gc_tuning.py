"""The serving process's collector settings: startup objects frozen, generation 0 collected less often."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from kvmesh.router.gc_tuning import tune_for_serving


@pytest.fixture
def restore_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restore_gc")
def test_tune_for_serving_freezes_startup_objects_and_raises_gen0_threshold() -> None:
    gc.set_threshold(700, 10, 10)
    startup_object = [object()]
    tune_for_serving(gen0_threshold=5000)
    assert gc.get_threshold() == (5000, 10, 10)
    assert gc.get_freeze_count() > 0
    # a frozen object is in no generation a collection traverses
    assert not any(o is startup_object for o in gc.get_objects())


@pytest.mark.usefixtures("restore_gc")
def test_tune_for_serving_leaves_cyclic_garbage_collectable() -> None:
    tune_for_serving()

    class Node:
        other: Node

    a, b = Node(), Node()
    a.other, b.other = b, a
    del a, b
    assert gc.collect() >= 2
