"""What a strategy decides: which drafter candidates enter the tree, and which of them grow further.

The decoding loop asks the strategy level by level. At level l the frontier
holds the nodes of depth l-1 the drafter has just processed; for each, the
loop offers its top-K drafter candidates and the strategy answers with two
`(B, F, K)` masks: `take` (the candidate becomes a node) and `expand` (the
drafter also processes it, so it may get children at level l+1). Strategies
hold only per-row planning state; they never touch a model or a cache.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class Frontier:
    """Nodes of depth `level - 1` whose children are being chosen.

    Fields (B = batch, F = frontier width):
        probs: `(B, F)` each node's drafter probability given its parent (root: 1).
        cum_probs: `(B, F)` product of probs along the path (root: 1).
        valid: `(B, F)` False for padding.
    """

    probs: torch.Tensor
    cum_probs: torch.Tensor
    valid: torch.Tensor


@dataclass
class StrategyConfig:
    """Base class of strategy settings; `None` fields take a per-device default (see `resolve`)."""

    def resolve(self, device: torch.device) -> "StrategyConfig":
        """A copy with every `None` field replaced by this device type's default."""
        defaults = self.device_defaults(device)
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in values.items():
            if value is None and name in defaults:
                values[name] = defaults[name]
        resolved = type(self)(**values)
        resolved.validate()
        return resolved

    def device_defaults(self, device: torch.device) -> dict:
        return {}

    def validate(self) -> None:
        pass


class Strategy:
    """Base class. Subclasses set `name` and `config_class` and implement `select`."""

    name: str = ""
    config_class: type = StrategyConfig
    requires_block_drafter: bool = False  # True: only a LaSpecDrafterModel can draft for it

    def __init__(self, config: StrategyConfig, batch_size: int, device: torch.device):
        self.config = config
        self.batch_size = batch_size
        self.device = device
        self.sampling = False  # set by the loop: True under do_sample (draws must stay unbiased)

    @property
    def cost_aware(self) -> bool:
        """True if the loop should trim each drafted tree with the verifier cost model (`cost.py`) before
        verifying it. Greedy decoding only: under sampling, dropping a drawn node for its own value would bias
        the draws."""
        return bool(getattr(self.config, "verify_cost", False))

    @property
    def max_children(self) -> int:
        """K: how many top candidates per frontier node the loop offers."""
        raise NotImplementedError

    @property
    def shared_budget(self) -> int | None:
        """n_max when `select` takes, level by level, the candidates of highest path probability until n_max
        draft nodes are taken (greedy `limit_to_budget` over every candidate, nothing else): then a block
        drafter at batch 1 may build the same tree on the host (`drafters.host_tree`). None otherwise."""
        return None

    def on_root(self, root_logits: torch.Tensor) -> None:
        """Called once per round with the drafter's processed logits `(B, V)` at the root."""

    def select(self, level: int, frontier: Frontier, candidate_probs: torch.Tensor):
        """Return `(take, expand)`, both `(B, F, K)` bool, for candidates with probs `(B, F, K)`."""
        raise NotImplementedError

    def round_confidence(self) -> torch.Tensor | None:
        """`(B,)` the confidence that shaped this round's trees, if the strategy has one (for stats)."""
        return None

    def observe(self, accept_length: torch.Tensor, active: torch.Tensor) -> None:
        """Called after verification with accepted draft tokens per row `(B,)` and active rows `(B,)`."""


def descending_rank(scores: torch.Tensor) -> torch.Tensor:
    """`(B, X)` position of each entry in its row's descending order (ties: lower index first)."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(scores.shape[1], device=scores.device).expand_as(order))
    return rank


def limit_to_budget(take: torch.Tensor, frontier: Frontier, candidate_probs: torch.Tensor, left: torch.Tensor,
                    sampling: bool) -> torch.Tensor:
    """`take` `(B, F, K)` cut per row to its `left` `(B,)` best candidates.

    Greedy: the highest path probabilities. Sampling: a drawn child may only be dropped for what came before
    it (its parent's path probability, earlier draws), never for its own drawn value, or the draws would no
    longer follow q.
    """
    cum = frontier.cum_probs[..., None] * candidate_probs  # (B, F, K)
    priority = frontier.cum_probs[..., None].expand_as(cum) if sampling else cum
    rank = descending_rank(torch.where(take, priority, -1.0).flatten(1))
    return take & (rank < left[:, None]).view_as(take)


def on_gpu(device: torch.device) -> bool:
    return torch.device(device).type != "cpu"
