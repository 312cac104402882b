"""The one builder of draft trees: `build(root, candidates, selection, branches)`.

A tree grows level by level from the pending root: each frontier node is offered its top-K candidates (the
same per-depth candidates for every node of a depth, `PerDepth`, or each node's own processed drafter logits,
`PerNode`), the round's selection (`trees.selection`) takes some and marks those that grow, and the chains of
`branches` (`trees.branches`) are hung under the root at the end, sharing nodes with the drafter's.

Backends, picked in one place (`_host_rows`), as `ops` picks one: one CPU row under greedy decoding whose
candidates are shared per depth, for a shape or a budget selection, is built on host lists (`trees.host`: a
few dozen Python comparisons instead of ~40 small tensor ops a level); everything else with tensors, level by
level (`trees.levels`), the reference the host backend is tested against (`tests/test_host_tree.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import clock
from . import host
from .branches import add_chain
from .levels import Frontier, choose_level
from .selection import Budget, Shape
from .tree import DraftTree, TreeBuilder

__all__ = ["PerDepth", "PerNode", "build"]


@dataclass
class PerDepth:
    """Candidates shared by every node of a depth (greedy, no logits processors: a block drafter's top-k of each
    depth's distribution): `probs`, `tokens` `(B, L, k)` for depths 1..L."""

    probs: torch.Tensor
    tokens: torch.Tensor

    @property
    def k(self) -> int:
        return self.probs.shape[-1]

    @property
    def depth_limit(self) -> int:
        return self.probs.shape[1]


class PerNode:
    """Candidates from each frontier node's own drafter logits (processed with its own prefix, or sampled from).
    A drafter subclasses it:

        root_logits: `(B, 1, V)` the processed logits at the root.
        k: candidates per node.
        depth_limit: the deepest level it drafts (None: no limit of its own).
        root_slot: the root's index in the drafter's uncommitted cache (-1: none).
        slots(level): `(B, W)` drafter slots of the level's children (-1: not processed), before `grow`.
        grow(level, tokens, parent, paths, valid): the expanded children `(B, E)` (their frontier positions
            `parent`, root-exclusive token paths `(B, E, level)`, padding `valid`) -> their processed logits
            `(B, E, V)`: where a drafter runs its forward.
    """

    root_logits: torch.Tensor
    k: int
    depth_limit: int | None = None
    root_slot: int = -1

    def slots(self, level) -> torch.Tensor:
        return torch.full_like(level.tokens, -1)

    def grow(self, level: int, tokens, parent, paths, valid) -> torch.Tensor:
        raise NotImplementedError


def build(root: torch.Tensor, candidates=None, selection=None, branches=(), *, max_depth: torch.Tensor | None = None,
          sample: bool = False, generator=None, stop_tokens=None, pricing=None, host_rows: bool = True) -> DraftTree:
    """The round's tree; node 0 is the pending root.

    Args:
        root (`torch.LongTensor` of shape `(B,)`): the pending root of each row.
        candidates (`PerDepth` or `PerNode`, *optional*): what each level is offered; None: the root alone.
        selection (`Shape`, `Budget` or `Rule`): the strategy's choice for this round.
        branches (sequence): `ContextBranch` / `StoreBranch` chains merged under the root, in order (greedy
            only; a node two chains propose takes the later one's code).
        max_depth (`torch.LongTensor` of shape `(B,)`): deepest level each row may draft.
        sample (`bool`): draw each node's candidates from its distribution (`PerNode` only).
        generator: the loop's `RowRandom` for those draws.
        stop_tokens (`(B, E)`, *optional*): EOS ids per row (-1 padding); a drafted one is never expanded.
        pricing (`cost.DraftPricing`, *optional*): with `PerNode` under greedy decoding, a level whose drafter
            forward does not pay keeps its children unexpanded.
        host_rows (`bool`): allow the host backend (`RuntimeConfig.host_trees`).
    """
    if candidates is None:
        return _root_only(root)
    if isinstance(candidates, PerDepth) and host_rows:
        plan = _host_rows(root, candidates, selection, max_depth, sample)
        if plan is not None:
            chains = [branch.host() for branch in branches]
            probs, tokens, kind, value = plan
            if kind == "budget":
                return host.budget_tree(int(root[0]), probs, tokens, value, chains, root.device)
            depth = min(candidates.depth_limit, max(int(max_depth[0]), 0))
            return host.shape_tree(int(root[0]), probs, tokens, value, depth, chains, root.device)
    tree = _tensor_tree(root, candidates, selection, max_depth, sample, generator, stop_tokens, pricing)
    for branch in branches:
        tree = add_chain(tree, *branch.tensors())
    return tree


def _host_rows(root, candidates: PerDepth, selection, max_depth, sample) -> tuple | None:
    """`(probs, tokens, "budget" | "shape", n_max | paths)` as host lists where the host backend builds the same
    tree: one CPU row, greedy, a budget without a depth cut below the candidates, or a shape whose ranks the
    candidates hold, every candidate's probability above 0; else None."""
    if root.shape[0] != 1 or root.device.type != "cpu" or sample:
        return None
    if isinstance(selection, Budget) and not selection.sampling and int(max_depth[0]) >= candidates.depth_limit:
        kind, value = "budget", selection.n_max
    elif isinstance(selection, Shape) and selection.row_max_rank(0) < candidates.k:
        kind, value = "shape", selection.row_shape(0)
    else:
        return None
    probs = candidates.probs[0].tolist()
    if min(min(level) for level in probs) <= 0:
        return None
    return probs, candidates.tokens[0].tolist(), kind, value


def _root_only(root: torch.Tensor) -> DraftTree:
    builder = TreeBuilder()
    column = root[:, None]
    ones, none = torch.ones_like(column, dtype=torch.float32), torch.full_like(column, -1)
    builder.add_level(column, none, torch.ones_like(column, dtype=torch.bool), ones, ones, none)
    return builder.build()


def _tensor_tree(root, candidates, selection, max_depth, sample, generator, stop_tokens, pricing) -> DraftTree:
    """The reference backend: level by level with tensors (`choose_level`), a `PerNode` drafter's forward
    between levels."""
    batch, device = root.shape[0], root.device
    shared = isinstance(candidates, PerDepth)
    if shared and sample:
        raise ValueError("build: per-depth candidates are greedy; sampling draws from each node's logits (PerNode).")
    select = selection.selector(batch, device)
    builder = TreeBuilder()
    ones = torch.ones(batch, 1, dtype=torch.bool, device=device)
    unit = torch.ones(batch, 1, device=device)
    root_slot = torch.full((batch, 1), -1 if shared else candidates.root_slot, dtype=torch.long, device=device)
    node_index = builder.add_level(root[:, None], torch.full_like(root_slot, -1), ones, unit, unit, root_slot)
    frontier_nodes = node_index[None, :].expand(batch, 1)  # (B, F) tree indices
    frontier = Frontier(probs=unit, cum_probs=unit, valid=ones)
    frontier_paths = torch.zeros(batch, 1, 0, dtype=torch.long, device=device)  # (B, F, level - 1)
    logits = None if shared else candidates.root_logits  # (B, F, V)
    limit = candidates.depth_limit
    survival, tree_width = unit, 1  # pi of the frontier nodes and the tree's width so far, for `pricing`
    level = 0
    while limit is None or level < limit:
        level += 1
        level_start = clock.now()
        offered = None
        if shared:
            width = frontier.valid.shape[1]
            offered = (candidates.probs[:, level - 1:level].expand(-1, width, -1),
                       candidates.tokens[:, level - 1:level].expand(-1, width, -1))
        chosen = choose_level(select, level, frontier, frontier_nodes, logits, candidates.k, max_depth, builder,
                              sample, generator, may_expand=limit is None or level < limit, candidates=offered,
                              stop_tokens=stop_tokens)
        if chosen is None:
            break
        tree_width += chosen.tokens.shape[1]
        if pricing is not None and not sample and chosen.num_grow:
            children = pricing.survival(survival, chosen)
            if pricing.pays(children, chosen, tree_width):
                survival = children.gather(1, chosen.grow) * chosen.grow_valid
            else:  # keep the children, expand none of them: this level is the last
                chosen = chosen.without_expansion()
        slots = torch.full_like(chosen.tokens, -1) if shared else candidates.slots(chosen)
        node_index = builder.add_level(chosen.tokens, frontier_nodes.gather(1, chosen.parent), chosen.valid,
                                       chosen.probs, chosen.cum_probs, slots)
        if chosen.num_grow == 0:
            break
        tokens, parent, frontier_paths, frontier_nodes, frontier = chosen.next_frontier(
            node_index, frontier_paths, level)
        if not shared:
            logits = candidates.grow(level, tokens, parent, frontier_paths, chosen.grow_valid)
            if pricing is not None:  # the level's whole time: its choice, its tree work and its forward
                pricing.observe_draft(chosen.num_grow, clock.now() - level_start)
    return builder.build()
