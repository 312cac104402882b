"""The learning-rate schedule of every training loop here: a linear warm-up, then a cosine decay to 0."""

from __future__ import annotations

import math
from typing import Optional

__all__ = ["warmup_cosine"]


def warmup_cosine(step: int, total: int, warmup: Optional[int] = None) -> float:
    """The rate's scale at `step` (0-based) of `total`: `(step + 1) / warmup` over the first `warmup` steps
    (default: 5% of `total`, at least 1), then a cosine from 1 down to 0 at `total`."""
    if warmup is None:
        warmup = max(1, total // 20)
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
