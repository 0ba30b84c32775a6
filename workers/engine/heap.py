"""The Python heap after start-up, kept out of the cyclic garbage collector's way.

A serving process imports torch, transformers' tokenizer code and our own modules and builds a
model, its drafters and their graphs: some 300k objects that live as long as the process. The
collector's full (oldest-generation) pass walks all of them: 160 ms on the 2-core VM, and on an
H200's host one such pause a run made EAGLE requests at 256 concurrent look 0.6x as fast as
plain ones (a request that drafts keeps more objects alive, so its runs were the ones that
crossed the full pass's threshold). Freezing the heap once start-up is over moves those objects
where no collection looks again (`gc.freeze`, as vLLM's engine core and SGLang's scheduler do),
so a full pass walks only what requests made since.

Only processes that serve call it, once their engine (or drafter, or prefill model) is built:
frozen objects are never collected as cyclic garbage, so a process that builds and drops
engines repeatedly (the test suite) would keep the cycles among them.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect start-up's garbage, then freeze what is left; returns the frozen objects."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d objects of start-up out of the garbage collector's passes", frozen)
    return frozen
