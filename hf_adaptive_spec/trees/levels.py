"""The tensor builder's per-level step: offer each frontier node its top-K candidates, let the round's selection
choose, and gather the chosen children (and those to expand) into padded `(B, W)` tensors; with the frontier
type and the budget cut that selections share.

Drafters differ only in where the next frontier's logits come from (an independent model runs the expanded
children; a block drafter reads its next block position) and in the drafter cache slots they record
(`trees.build`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import compact_true


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


@dataclass
class Level:
    """The children chosen at one level (B = batch, W = widest row, E = widest row of expanded children).

    Fields:
        tokens, parent, valid, probs, cum_probs, expand: `(B, W)`; `parent` is the frontier position of each
            child's parent, `expand` marks the children the drafter goes on to process.
        grow, grow_valid: `(B, E)` positions within the level of the expanded children, padding marked.
        num_grow: E.
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    valid: torch.Tensor
    probs: torch.Tensor
    cum_probs: torch.Tensor
    expand: torch.Tensor
    grow: torch.Tensor
    grow_valid: torch.Tensor
    num_grow: int

    def without_expansion(self) -> "Level":
        """The same children, none of them expanded (the drafter stops at this level)."""
        batch = self.tokens.shape[0]
        empty = torch.zeros(batch, 0, dtype=torch.long, device=self.tokens.device)
        return Level(tokens=self.tokens, parent=self.parent, valid=self.valid, probs=self.probs,
                     cum_probs=self.cum_probs, expand=torch.zeros_like(self.expand), grow=empty,
                     grow_valid=empty.bool(), num_grow=0)

    def next_frontier(self, node_index: torch.Tensor, paths: torch.Tensor, level: int):
        """`(tokens (B, E), parent (B, E), paths (B, E, level), nodes (B, E), Frontier)` of the expanded children.

        Args:
            node_index (`torch.LongTensor` of shape `(W,)`): tree indices this level received.
            paths (`torch.LongTensor` of shape `(B, F, level - 1)`): the current frontier's paths.
        """
        parent = self.parent.gather(1, self.grow)
        tokens = self.tokens.gather(1, self.grow)
        new_paths = torch.cat([paths.gather(1, parent[..., None].expand(-1, -1, level - 1)), tokens[..., None]], dim=2)
        nodes = node_index[None, :].expand(tokens.shape[0], -1).gather(1, self.grow)
        frontier = Frontier(probs=self.probs.gather(1, self.grow), cum_probs=self.cum_probs.gather(1, self.grow),
                            valid=self.grow_valid)
        return tokens, parent, new_paths, nodes, frontier


def choose_level(select, level: int, frontier: Frontier, frontier_nodes: torch.Tensor, logits: torch.Tensor | None,
                 k: int, max_depth: torch.Tensor, builder, sample: bool, generator=None,
                 may_expand: bool = True, candidates: tuple | None = None,
                 stop_tokens: torch.Tensor | None = None) -> Level | None:
    """Children of the frontier at `level`, or None when the selection takes none.

    Args:
        select (callable): the round's per-level choice, `select(level, frontier, candidate_probs (B, F, K))`
            -> `(take, expand)` `(B, F, K)` bool (`trees.selection`).
        logits (`torch.FloatTensor` of shape `(B, F, V)`): processed drafter logits at the frontier (q); None
            when `candidates` are given.
        k (`int`): candidates offered per node.
        max_depth (`torch.LongTensor` of shape `(B,)`): deepest level each row may draft.
        builder (`TreeBuilder`): receives q of each frontier node under sampling.
        sample (`bool`): draw the candidates without replacement from q (exponential race = Gumbel-top-k)
            instead of taking its top-k.
        may_expand (`bool`): False when the drafter cannot go deeper than this level.
        candidates (`(probs, tokens)`, each `(B, F, k)`, *optional*): the frontier's top-k already computed
            (greedy only: a block drafter without logits processors offers every node of a depth the same
            distribution, so its top-k is taken once per depth, not once per node).
        stop_tokens (`torch.LongTensor` of shape `(B, E)`, *optional*): each row's EOS ids (-1 padding): a child
            that is one is never expanded (nothing below it can be of use).
    """
    if candidates is not None:
        if sample:
            raise ValueError("choose_level draws from the logits when sampling; precomputed candidates are greedy.")
        top_probs, top_tokens = candidates
    elif sample:
        probs = torch.softmax(logits, dim=-1)  # (B, F, V)
        builder.draft_probs.append((torch.where(frontier.valid, frontier_nodes, -1), probs))
        # exponential race: the top-k of q / E, E ~ Exp(1), is a draw of k tokens without replacement
        race = probs / _exponential(probs, frontier.valid, generator)
        top_tokens = race.topk(k, dim=-1).indices
        top_probs = probs.gather(-1, top_tokens)
    else:
        top_probs, top_tokens = torch.softmax(logits, dim=-1).topk(k, dim=-1)  # (B, F, K)
    take, expand = select(level, frontier, top_probs)
    take = take & (top_probs > 0) & frontier.valid[..., None] & (level <= max_depth)[:, None, None]
    expand = expand & take & (level < max_depth)[:, None, None] & may_expand
    if stop_tokens is not None:
        expand &= ~(top_tokens[..., None] == stop_tokens[:, None, None, :]).any(-1)
    child, valid, width = compact_true(take.flatten(1))
    if width == 0:
        return None
    parent = child // k  # (B, W) frontier position of each child's parent
    probs = top_probs.flatten(1).gather(1, child)
    expand = expand.flatten(1).gather(1, child) & valid
    grow, grow_valid, num_grow = compact_true(expand)
    return Level(tokens=top_tokens.flatten(1).gather(1, child), parent=parent, valid=valid, probs=probs,
                 cum_probs=frontier.cum_probs.gather(1, parent) * probs, expand=expand, grow=grow,
                 grow_valid=grow_valid, num_grow=num_grow)


def _exponential(probs: torch.Tensor, valid: torch.Tensor, generator) -> torch.Tensor:
    """Exp(1) draws shaped like `probs`: from `generator` (the decoding loop's `RowRandom`: per row, for valid
    nodes only), or from torch's global generator when None."""
    if generator is None:
        return torch.empty_like(probs).exponential_()
    return generator.exponential(probs, valid)
