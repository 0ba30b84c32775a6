"""Start-up's heap frozen out of the garbage collector's passes (workers/engine/heap.py)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from workers.engine.heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    """A two-node reference cycle nobody holds: only a collection frees it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def thawed() -> Iterator[None]:
    yield
    gc.unfreeze()  # this process builds and drops engines: let their cycles go again
    gc.collect()


def test_start_ups_objects_are_frozen_and_later_garbage_is_still_collected(thawed: None) -> None:
    kept = Node()  # alive at start-up
    before = cycle()  # garbage before the freeze: collected by it, never frozen
    assert freeze_startup_heap() >= 1
    assert before() is None
    assert any(obj is kept for obj in _frozen())
    after = cycle()  # a request's garbage
    gc.collect()
    assert after() is None


def _frozen() -> list[object]:
    """The frozen objects: what `gc.get_objects` no longer lists but a thaw brings back."""
    live = {id(obj) for obj in gc.get_objects()}
    gc.unfreeze()
    frozen = [obj for obj in gc.get_objects() if id(obj) not in live]
    gc.freeze()
    return frozen
