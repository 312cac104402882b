"""Where a sampling call's random draws come from: `RowRandom`.

`generate` draws from one generator for the whole batch (torch's global one), in batched calls, as before. A
serving batch gives every row its own `torch.Generator` (the request's): each row then draws only for itself,
only what its own tree needs, so a seeded request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

__all__ = ["RowRandom"]


class RowRandom:
    """Random draws for a batch: from one `shared` generator (None: torch's global one), or from `rows`, one
    generator per row."""

    def __init__(self, shared: torch.Generator | None = None, rows: list | None = None):
        if rows is not None and shared is not None:
            raise ValueError("RowRandom draws from one shared generator or from one generator per row, not both.")
        self.shared, self.rows = shared, rows

    @classmethod
    def for_call(cls, generator: torch.Generator | None, batch_size: int) -> "RowRandom":
        """A call's draws: a one-row call with its own generator owns it as its row's; otherwise it is shared."""
        if generator is not None and batch_size == 1:
            return cls(rows=[generator])
        return cls(shared=generator)

    @property
    def per_row(self) -> bool:
        return self.rows is not None

    def uniform(self, rows: torch.Tensor) -> torch.Tensor:
        """`(B,)` uniform draws in [0, 1); per row: drawn for rows where `rows` `(B,)` is True only (others 1.0)."""
        if not self.per_row:
            return torch.rand(rows.shape[0], device=rows.device, generator=self.shared)
        out = torch.ones(rows.shape[0], device=rows.device)
        for row in rows.nonzero().flatten().tolist():
            out[row] = torch.rand(1, device=rows.device, generator=self.rows[row])[0]
        return out

    def categorical(self, probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`(B,)` one token drawn from each row's `probs` `(B, V)`; per row: for rows where `rows` is True only
        (others 0)."""
        if not self.per_row:
            return torch.multinomial(probs, 1, generator=self.shared).squeeze(1)
        out = torch.zeros(probs.shape[0], dtype=torch.long, device=probs.device)
        for row in rows.nonzero().flatten().tolist():
            out[row] = torch.multinomial(probs[row], 1, generator=self.rows[row])[0]
        return out

    def exponential(self, probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Exp(1) draws shaped like `probs` `(B, F, V)`; per row: for its `valid` `(B, F)` nodes only, in node
        order (others 1.0), so a row's draws never depend on how wide another row's frontier is."""
        if not self.per_row:
            return torch.empty_like(probs).exponential_(generator=self.shared)
        out = torch.ones_like(probs)
        for row in valid.any(-1).nonzero().flatten().tolist():
            nodes = valid[row].nonzero().flatten()
            draws = torch.empty((nodes.shape[0], probs.shape[-1]), dtype=probs.dtype, device=probs.device)
            out[row, nodes] = draws.exponential_(generator=self.rows[row])
        return out

    def keep_rows(self, keep: torch.Tensor) -> None:
        if self.per_row:
            self.rows = [self.rows[row] for row in keep.tolist()]

    def join(self, other: "RowRandom") -> None:
        """`other`'s rows follow this batch's, each with its own generator."""
        if self.per_row and other.per_row:
            self.rows = self.rows + other.rows
        elif self.per_row or other.per_row or self.shared is not other.shared:
            raise ValueError("rows drawing from their own generators join only rows with their own generators.")
