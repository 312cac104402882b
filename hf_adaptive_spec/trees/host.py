"""The builder's host backend (`trees.build`): one CPU row's greedy tree over per-depth candidates, the same
`DraftTree`, built with Python lists; and the row's context lookup (`latest_match`).

At batch 1, under greedy decoding with no logits processors, a block drafter offers every node of depth d the
same top-k of the depth-d distribution; a budget selection (`laspec`) keeps, level by level, the children of
highest path probability until `n_max` nodes are taken, a shape selection exactly its rank paths. The tensor
path (`levels.choose_level`, the `TreeBuilder`, `branches.add_chain`) does this with ~40 small tensor ops per
level; here it is a few dozen Python comparisons over the `(depth, k)` candidates, and the context-lookup and
datastore chains are found and merged on the same lists, converted to one `DraftTree` at the end. It is a backend of the same operations, as
`ops.host` is for the per-round tree ops: the result equals the generic path's tree field for field (path
probabilities are rounded to float32 after every product, as the tensors are), which `tests/test_host_tree.py`
checks on random, tied and truncated cases.
"""

from __future__ import annotations

import torch

from ..ops.host import float32
from .tree import DraftTree

__all__ = ["budget_tree", "float32", "latest_match", "shape_tree"]



class _RowBuilder:
    """One row's tree being built, as Python lists in `DraftTree` layout (node 0 the root, levels in order)."""

    def __init__(self, root: int):
        self.tokens = [root]
        self.parents = [-1]
        self.probs = [1.0]
        self.cum_probs = [1.0]
        self.depths = [0]
        self.lookup: list[int] | None = None
        self.num_levels = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int, parent: int, prob: float, cum_prob: float, depth: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.probs.append(prob)
        self.cum_probs.append(cum_prob)
        self.depths.append(depth)
        return len(self.tokens) - 1

    def add_chain(self, chain: list[int], match) -> None:
        """Hang `chain` under the root, sharing nodes where its next token is already a child (as
        `branches.add_chain`): chain nodes get `lookup` = `match` (one code, or a list with one per chain node),
        appended ones drafter probability 0. A second chain (the context's after a datastore's) merges the same
        way; a shared node takes the later code."""
        if self.lookup is None:
            self.lookup = [0] * len(self.tokens)
        codes = list(match) if isinstance(match, (list, tuple)) else [match] * len(chain)
        current = 0
        for depth, (token, match) in enumerate(zip(chain, codes), start=1):
            child = next((i for i in range(current + 1, len(self.tokens))
                          if self.parents[i] == current and self.tokens[i] == token), None)
            if child is None:
                child = self.append(token, current, 0.0, 0.0, depth)
                self.lookup.append(match)
                self.num_levels = max(self.num_levels, depth)
            else:
                self.lookup[child] = match
            current = child

    def to_draft_tree(self, device) -> DraftTree:
        def column(values, dtype):
            return torch.tensor([values], dtype=dtype, device=device)

        count = len(self.tokens)
        return DraftTree(
            tokens=column(self.tokens, torch.long),
            parents=column(self.parents, torch.long),
            valid=torch.ones(1, count, dtype=torch.bool, device=device),
            probs=column(self.probs, torch.float32),
            cum_probs=column(self.cum_probs, torch.float32),
            depths=column(self.depths, torch.long),
            drafter_slot=torch.full((1, count), -1, dtype=torch.long, device=device),
            num_levels=self.num_levels,
            lookup=None if self.lookup is None else column(self.lookup, torch.long),
        )


def budget_tree(root: int, probs: list[list[float]], tokens: list[list[int]], budget: int, chains=(),
                device=None) -> DraftTree:
    """The tree of a budget strategy over shared per-depth candidates (`laspec`'s `select` with
    `limit_to_budget`, greedy), with `chains` hung under the root (`branches.add_chain`).

    Args:
        root: the pending root token.
        probs / tokens: `[depth][k]` the block's top-k per depth (probabilities > 0, float32 values), one
            level per depth; the tree never goes deeper.
        budget: `n_max`, draft nodes taken over all levels (ranked within a level by path probability, ties
            to the earlier candidate in (parent, rank) order).
        chains: `(tokens, codes)` pairs merged in order (`codes`: one lookup code, or one per token); a node
            two chains propose takes the later one's code.
        device: of the returned tree.
    """
    tree = _RowBuilder(root)
    frontier = [0]  # node indices of the previous level, in order
    left = budget
    for level, (level_probs, level_tokens) in enumerate(zip(probs, tokens), start=1):
        candidates = [(tree.cum_probs[parent], parent, prob, token)
                      for parent in frontier for prob, token in zip(level_probs, level_tokens)]
        if left <= 0 or not candidates:
            break
        if len(candidates) > left:
            cum = [float32(parent_cum * prob) for parent_cum, _, prob, _ in candidates]
            best = sorted(range(len(candidates)), key=lambda i: -cum[i])[:left]  # stable: ties keep order
            keep = sorted(best)
        else:
            keep = range(len(candidates))
        frontier = []
        for i in keep:
            parent_cum, parent, prob, token = candidates[i]
            frontier.append(tree.append(token, parent, prob, float32(parent_cum * prob), level))
        tree.num_levels = level
        left -= len(frontier)
    for chain, codes in chains:
        tree.add_chain(chain, codes)
    return tree.to_draft_tree(device)


def shape_tree(root: int, probs: list[list[float]], tokens: list[list[int]], paths, max_depth: int, chains=(),
               device=None) -> DraftTree:
    """The tree of a shape strategy (`chain`, `static_tree`, a planned `sage` round: `select` takes exactly the
    rank paths `paths`) over shared per-depth candidates, greedy, with `chains` hung under the root as in
    `budget_tree`.

    Args:
        probs / tokens: `[depth][k]` the block's top-k per depth (probabilities > 0); every rank of `paths` is
            below k and no path is deeper than the block.
        paths: prefix-closed rank paths sorted by depth, then rank (`candidate_shapes`' order: also the order
            the tensor path adds each level's children in, parents in frontier order, then rank).
        max_depth: deepest level drafted (paths below it are left out).
    """
    tree = _RowBuilder(root)
    index = {(): 0}
    for path in paths:
        depth = len(path)
        if depth > max_depth:
            continue
        parent = index[path[:-1]]
        rank = path[-1]
        prob = probs[depth - 1][rank]
        index[path] = tree.append(tokens[depth - 1][rank], parent, prob, float32(tree.cum_probs[parent] * prob), depth)
        tree.num_levels = max(tree.num_levels, depth)
    for chain, codes in chains:
        tree.add_chain(chain, codes)
    return tree.to_draft_tree(device)


def latest_match(row: list[int], max_ngram: int, num_tokens: int) -> tuple[list[int], int]:
    """`(tokens, n)`: the (up to `num_tokens`) tokens that followed the latest earlier occurrence of `row`'s
    longest matching suffix of length n <= `max_ngram` (`branches.context_lookup` for one row), or `([], 0)`."""
    length = len(row)
    if length < 2:
        return [], 0
    best_end = [-1] * (max_ngram + 1)  # latest end position of a match of each length
    longest = 0
    last = row[-1]
    for end in range(length - 2, -1, -1):
        if row[end] != last:
            continue
        n = 1
        while n < max_ngram and n <= end and row[end - n] == row[length - 1 - n]:
            n += 1
        for m in range(longest + 1, n + 1):  # the first (latest) end found for each length
            best_end[m] = end
        longest = max(longest, n)
        if longest == max_ngram:
            break
    if longest == 0:
        return [], 0
    start = best_end[longest] + 1
    return row[start:start + num_tokens], longest
