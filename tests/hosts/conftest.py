"""The multi-host test bed (tests/hosts/bed.py), started once for the module that asks for it;
skipped, with the reason, where network namespaces cannot be made."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.hosts.bed import Bed
from tests.hosts.netns import unavailable


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no multi-host test bed: {reason}")
    with Bed() as running:
        try:
            running.start()
        except BaseException:
            print(running.tail("router", 12000))
            raise
        yield running
