"""Drafting priced level by level: whether one more drafter forward pays for what it is expected to add."""

from __future__ import annotations

import torch

from .model import CostModel

__all__ = ["DraftPricing"]


class DraftPricing:
    """Prices drafting itself, level by level, for an independent drafter (greedy, with a `CostModel`).

    Before the drafter runs the children a strategy chose to expand (one more drafter forward), it checks that
    what they are expected to add pays for it: the expected accepted tokens of their own children, approximated
    by each expanded node's survival probability pi times its own calibrated acceptance (a drafter sure of a
    node tends to be sure of the next), times the live seconds per token t_token, against the drafter forward
    at that width (measured online, per width) plus the verification time those children add on the target's
    curve. The strategy still shapes each level (SAGE: depth and width from its entropy); this decides how far
    drafting goes. Trimming after drafting (`CostModel.prune`) still applies to what was drafted.

    Args:
        cost (`CostModel`): the calibration, the target's curve and t_token.
        draft_seconds (callable, *optional*): `width -> seconds` of one drafter forward, fixed (tests); by
            default measured from the drafter's own forwards (`observe_draft`), free until the first one.
    """

    SMOOTHING = 0.3

    def __init__(self, cost: "CostModel", draft_seconds=None):
        self.cost = cost
        self._fixed = draft_seconds
        self._measured: dict[int, float] = {}
        self.stopped_levels = 0  # levels not drafted because they would not pay (for statistics)
        self.round_levels = 0.0  # seconds of this round's drafter levels so far (`take_round_levels`)

    def draft_seconds(self, width: int) -> float:
        if self._fixed is not None:
            return float(self._fixed(width))
        if width in self._measured:
            return self._measured[width]
        if not self._measured:
            return 0.0
        nearest = min(self._measured, key=lambda measured: abs(measured - width))
        return self._measured[nearest]

    def forget_timings(self) -> None:
        """Measure the drafter's forwards afresh (the batch changed size)."""
        self._measured = {}

    def observe_draft(self, width: int, seconds: float) -> None:
        """One drafter level over `width` expanded children took `seconds` (its forward and its tree work)."""
        self.round_levels += seconds
        previous = self._measured.get(width)
        self._measured[width] = seconds if previous is None else previous + self.SMOOTHING * (seconds - previous)

    def take_round_levels(self) -> float:
        """Seconds of the drafter levels of the round that just ended; the next round counts from 0."""
        seconds, self.round_levels = self.round_levels, 0.0
        return seconds

    def survival(self, parent_survival: torch.Tensor, level) -> torch.Tensor:
        """`(B, W)` pi of the level's children: their parent's pi times their calibrated acceptance."""
        accept = self.cost.calibrator(level.probs)
        return parent_survival.gather(1, level.parent) * accept * level.valid

    def pays(self, survival: torch.Tensor, level, tree_width: int) -> bool:
        """Whether running the level's `grow` children through the drafter pays (see the class docstring).

        Args:
            survival (`torch.Tensor` of shape `(B, W)`): pi of the level's children (`survival`).
            level (`trees.levels.Level`): the level, with the children to expand.
            tree_width (`int`): nodes the tree holds so far, this level included (the verification width).
        """
        grow_survival = survival.gather(1, level.grow) * level.grow_valid
        grow_accept = self.cost.calibrator(level.probs.gather(1, level.grow))
        gain = float((grow_survival * grow_accept).sum())
        width = level.num_grow
        table = self.cost.host_table
        verify = self.cost.scale * (table[min(tree_width + width, len(table) - 1)]
                                    - table[min(tree_width, len(table) - 1)])
        if self.cost.width_table is not None and level.grow_valid.shape[0] > 1:
            # a packed forward (`choose_nodes`): the children cost their real share of the padded block
            verify *= float(level.grow_valid.sum()) / max(level.grow_valid.numel(), 1)
        paid = gain * float(self.cost.seconds_per_token) >= self.draft_seconds(width) + max(verify, 0.0)
        self.stopped_levels += not paid
        return paid
