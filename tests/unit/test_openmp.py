"""Releasing a thread's OpenMP workers (kernels/openmp.py): the workers a parallel region left
behind end, and the next region makes new ones."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch

from kernels.openmp import release_thread_pool


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settles_at(count: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while os_threads() != count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def two_threads() -> Iterator[None]:
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counts threads in /proc (Linux)")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def parallel_region() -> None:
    x = torch.ones(1 << 22)
    torch.add(x, x)  # far over torch's grain size: split over the threads


def test_releasing_ends_the_calling_threads_workers_and_a_region_makes_them_again(
    two_threads: None,
) -> None:
    parallel_region()
    with_pool = os_threads()
    assert release_thread_pool()
    assert settles_at(with_pool - 1)  # two threads: the caller and one worker
    parallel_region()
    assert settles_at(with_pool)
