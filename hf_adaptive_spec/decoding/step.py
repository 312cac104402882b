"""What one step of a run did, row by row: `RoundResult` (the prefill's first token, or one speculative round).

Values stay tensors until read: the `generate` loop reads `done` alone, a serving engine reads the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RoundResult"]


@dataclass
class RoundResult:
    """One step of a `Decoding`, for the rows of the batch as the step began.

    Fields:
        tokens (`torch.LongTensor` of shape `(B, K)`): candidate tokens; each row appended its first `counts`.
        counts (`torch.LongTensor` of shape `(B,)`): tokens each row appended (0 for a row that had finished).
        finished (`torch.BoolTensor` of shape `(B,)`): rows that have finished (in this step or before).
        stopped (`torch.BoolTensor` of shape `(B,)`): rows that finished in this step on an EOS token or a stopping
            criterion; the others that finished in it reached their length limit.
        active (`torch.BoolTensor` of shape `(B,)`): rows that were decoding in this step.
        drafted (`torch.LongTensor` of shape `(B,)`): draft nodes verified per row (0: a plain step).
        accepted (`torch.LongTensor` of shape `(B,)`): draft tokens accepted per row.
    """

    tokens: torch.Tensor
    counts: torch.Tensor
    finished: torch.Tensor
    stopped: torch.Tensor
    active: torch.Tensor
    drafted: torch.Tensor
    accepted: torch.Tensor

    @property
    def done(self) -> bool:
        """Every row has finished."""
        return bool(self.finished.all())

    def new_tokens(self) -> list[list[int]]:
        """Each row's tokens appended in this step."""
        tokens, counts = self.tokens.tolist(), self.counts.tolist()
        return [row[:count] for row, count in zip(tokens, counts)]

    def finish_reasons(self) -> list[str | None]:
        """Per row: "stop" or "length" for a row that finished in this step, None otherwise (still decoding, or
        finished before)."""
        ended = (self.finished & self.active).tolist()
        return [("stop" if stop else "length") if end else None for end, stop in zip(ended, self.stopped.tolist())]

    def decoding_rows(self) -> list[tuple[int, int]]:
        """`(drafted, accepted)` of each row that was decoding in this step."""
        active = self.active.tolist()
        pairs = zip(self.drafted.tolist(), self.accepted.tolist())
        return [pair for pair, is_active in zip(pairs, active) if is_active]
