"""Rows that leave a batch before the call ends.

At batch > 1 a row that finished (its EOS, a stopping criterion, its token limit) would otherwise stay in every
later forward until the last row ends, as plain generate keeps it. Between rounds the loop drops finished rows
from the target's cache, the drafter's and the strategy's state (`keep_rows` of each), and `RetiredRows` keeps
what the output needs of them: their tokens, and their cache when the output carries the cache. At the end
both are put back in the original row order, so the output is laid out exactly as without retirement.
"""

from __future__ import annotations

import torch

__all__ = ["RetiredRows"]


class RetiredRows:
    """What the output needs of the rows that left the batch.

    Args:
        batch_size (`int`): rows of the call.
        keep_cache (`bool`): also keep each retired row's cache (the output returns the target's cache).
    """

    # finished rows leave once they are this share of the batch: each exit copies the remaining rows' cache once
    LEAVE_AT = 0.25

    def __init__(self, batch_size: int, keep_cache: bool):
        self.batch_size = batch_size
        self.keep_cache = keep_cache
        self.groups = []  # (original rows (R,), ids (R, C), lengths (R,), cache or None)

    def add(self, original_rows: torch.Tensor, rows: torch.Tensor, buffer, target) -> None:
        """Keep rows `rows` (indices into the current batch; `original_rows` their rows in the call) of the
        sequence `buffer` and, if `keep_cache`, of `target`'s committed cache."""
        cache = target.rows_state(rows) if self.keep_cache else None
        self.groups.append((original_rows, buffer.ids[rows], buffer.lengths[rows], cache))

    def restore_buffer(self, buffer, live_rows: torch.Tensor) -> None:
        """`buffer` (the rows still in the batch, originally `live_rows`) holds every row again, in order."""
        ids = buffer.ids.new_empty((self.batch_size, buffer.ids.shape[1]))
        lengths = buffer.lengths.new_empty((self.batch_size,))
        ids[live_rows], lengths[live_rows] = buffer.ids, buffer.lengths
        for rows, group_ids, group_lengths, _ in self.groups:
            ids[rows], lengths[rows] = group_ids, group_lengths
        buffer.ids, buffer.lengths = ids, lengths

    def restore_cache(self, target, live_rows: torch.Tensor) -> None:
        """`target`'s cache and slot layouts (committed slots only) hold every row again, in order; a retired row's
        slots past its own committed ones are invalid holes (zeros)."""
        target.restore_rows(live_rows, self.batch_size, [(rows, cache) for rows, _, _, cache in self.groups])
