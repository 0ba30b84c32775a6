"""Small host values (indices, slots) onto the device without waiting for the device.

`torch.tensor(values, device=cuda)` copies synchronously: the host waits until every kernel
queued on the stream has run, which is the forward just launched when the engine schedules
ahead (workers/engine/overlap.py). `queued_tensor` stages the values in pinned memory and
queues the copy behind that work instead; the host goes on at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def queued_tensor(
    values: Sequence[Any], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:  # values' shape (a list, or a list of equal lists), on `device`
    """`values` as a tensor on `device`, its copy queued (not waited for) on a GPU."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
