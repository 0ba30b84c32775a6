"""One thread runs the model: releasing the OpenMP threads another thread left behind.

Torch's CPU kernels and ours (kernels/csrc) parallelise with OpenMP, in the runtime torch ships
(libgomp on Linux). libgomp keeps a pool of worker threads for each thread that has started a
parallel region, for that thread's whole life. Its workers spin for a while after a region, so
that the next region starts at once, unless the process has more pooled threads than CPUs: then
they sleep almost at once, and every region pays a futex wake-up. So a process that loads the
model in its main thread and then steps it in another (an `EngineLoop`) holds two pools; on two
cores each region of the stepping thread then cost about 60 us more (a one-row projection 73 us
instead of 12), and one served stream decoded at 45 tokens/s where the same engine stepped
from the main thread ran at 120.

`release_thread_pool` hands the calling thread's pool back (OpenMP 5's
`omp_pause_resource_all`, hard), so that the thread which steps the model is the only one with
workers. Any later parallel region in the calling thread makes a new pool: after handing the
model to another thread, the caller must not run the model's kernels itself.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger(__name__)

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the runtime's threads and memory
_RUNTIMES = ("libgomp", "libiomp5", "libomp")


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime loaded in this process (torch's), or None where there is none or it
    lacks OpenMP 5's pause."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        name = os.path.basename(path)
        if name.startswith(_RUNTIMES) and ".so" in name:
            lib = ctypes.CDLL(path)
            if hasattr(lib, "omp_pause_resource_all"):
                lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                lib.omp_pause_resource_all.restype = ctypes.c_int
                return lib
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP workers; whether there was a runtime to ask (they come
    back, a new pool, at this thread's next parallel region)."""
    import torch  # noqa: F401  (its OpenMP runtime is the one to find)

    lib = _runtime()
    if lib is None:
        return False
    if lib.omp_pause_resource_all(OMP_PAUSE_HARD) != 0:
        log.debug("the OpenMP runtime refused to release this thread's workers")
        return False
    return True
