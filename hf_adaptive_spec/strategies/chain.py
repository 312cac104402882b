"""`chain`: a single linear draft whose length adapts to recent acceptance."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..trees.selection import Shape, ShapeSet
from .base import Strategy, StrategyConfig, check_bool, check_int, check_order, check_visual_selection, on_gpu


@dataclass
class ChainConfig(StrategyConfig):
    """Settings of the `chain` strategy.

    Args:
        num_draft_tokens (`int`, *optional*): starting draft length (CPU 4, GPU 6).
        min_draft_tokens (`int`, *optional*): lower bound of the adaptive length (default 1).
        max_draft_tokens (`int`, *optional*): upper bound (CPU 8, GPU 16).
        adaptive (`bool`, defaults to `True`): grow by 2 after a fully accepted draft, shrink by 1 otherwise
            (per row), like stock assisted generation's "heuristic" schedule.
        verify_cost (`bool`, defaults to `False`): under greedy decoding, cut each chain to the prefix that pays
            for its verification on the target's measured cost curve (`hf_adaptive_spec.cost`).
        visual_tokens (`int`, *optional*), visual_selection (`str`): how many of the image's visual tokens an
            independent VLM drafter sees, and when the target's attention picks them ("prefill" or "round"; see
            `strategies.base.VISUAL_FIELDS_DOC`). None: the whole image.
    """

    num_draft_tokens: int | None = None
    min_draft_tokens: int | None = None
    max_draft_tokens: int | None = None
    adaptive: bool = True
    verify_cost: bool = False
    visual_tokens: int | None = None
    visual_selection: str = "prefill"

    def device_defaults(self, device):
        gpu = on_gpu(device)
        return {"num_draft_tokens": 6 if gpu else 4, "min_draft_tokens": 1, "max_draft_tokens": 16 if gpu else 8}

    def validate(self):
        for name in ("num_draft_tokens", "min_draft_tokens", "max_draft_tokens"):
            check_int(self, name, 1)
        check_bool(self, "adaptive")
        check_bool(self, "verify_cost")
        check_order(self, "min_draft_tokens", "num_draft_tokens")
        check_order(self, "num_draft_tokens", "max_draft_tokens")
        check_order(self, "min_draft_tokens", "max_draft_tokens")
        check_visual_selection(self)


class ChainStrategy(Strategy):
    name = "chain"
    config_class = ChainConfig

    row_state = ("length",)

    def __init__(self, config, batch_size, device, sampling=False):
        super().__init__(config, batch_size, device, sampling)
        self.length = torch.full((batch_size,), config.num_draft_tokens, dtype=torch.long, device=device)
        self._chains = chain_shapes(config.max_draft_tokens)

    @property
    def max_children(self):
        return 1

    def on_root(self, root_logits):
        """Each row's chain of its current length (`chain_shapes`: one per length up to the maximum)."""
        return Shape(self._chains, self.length - 1)

    def observe(self, accept_length, active):
        if not self.config.adaptive:
            return
        grown = torch.where(accept_length >= self.length, self.length + 2, self.length - 1)
        grown = grown.clamp(self.config.min_draft_tokens, self.config.max_draft_tokens)
        self.length = torch.where(active, grown, self.length)


@lru_cache(maxsize=64)
def chain_paths(length: int) -> tuple:
    """The rank paths of a chain of `length` top-1 tokens."""
    return tuple((0,) * depth for depth in range(1, length + 1))


@lru_cache(maxsize=16)
def chain_shapes(max_length: int) -> ShapeSet:
    """The chains of every length 1..`max_length` (shape i: length i + 1), made once per length (read only)."""
    return ShapeSet([chain_paths(length) for length in range(1, max_length + 1)])
