"""One row's greedy block-drafter tree built on the host: the common batch-1 case without tensor bookkeeping.

At batch 1, under greedy decoding with no logits processors, a block drafter offers every node of depth d the
same top-k of the depth-d distribution, and a budget strategy (`laspec`) keeps, level by level, the children
of highest path probability until `n_max` nodes are taken. The generic path (`levels.choose_level`, the
`TreeBuilder`, `lookup.add_chain`) does this with ~40 small tensor ops per level, ~3-4 ms of a CPU round for
a tree of 16 nodes; here it is a few dozen Python comparisons over the `(depth, k)` candidates, and the
context-lookup chain is found and merged on the same lists. The result is the same `DraftTree`, field for
field (path probabilities are rounded to float32 after every product, as the tensors are):
`tests/test_host_tree.py` compares both paths on random, tied and truncated cases. The `DraftTree` keeps
its `HostTree` (`DraftTree.host`), so the cost rule prices and cuts the same lists (`CostModel.prune`,
`HostTree.subset`).
"""

from __future__ import annotations

import struct

import torch

from ..tree import DraftTree

__all__ = ["HostTree", "budget_tree", "float32", "latest_match"]

_FLOAT32 = struct.Struct("f")


def float32(value: float) -> float:
    """`value` rounded to float32 (a product of two float32 values is exact in a double, so rounding it once
    gives the float32 product)."""
    return _FLOAT32.unpack(_FLOAT32.pack(value))[0]


class HostTree:
    """One row's tree as Python lists, in `DraftTree` layout (node 0 the root, levels in order)."""

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
        `lookup.add_chain`): chain nodes get `lookup` = `match` (one code, or a list with one per chain node),
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

    def subset(self, keep: list[bool]) -> "HostTree":
        """The tree of the kept nodes (closed under ancestors, root kept), order preserved (`DraftTree.subset`)."""
        nodes = [node for node, kept in enumerate(keep) if kept]
        position = {node: index for index, node in enumerate(nodes)}
        out = HostTree(self.tokens[0])
        out.tokens = [self.tokens[node] for node in nodes]
        out.parents = [position[self.parents[node]] if self.parents[node] >= 0 else -1 for node in nodes]
        out.probs = [self.probs[node] for node in nodes]
        out.cum_probs = [self.cum_probs[node] for node in nodes]
        out.depths = [self.depths[node] for node in nodes]
        out.lookup = None if self.lookup is None else [self.lookup[node] for node in nodes]
        out.num_levels = max(out.depths, default=0)
        return out

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
            host=self,
        )


def budget_tree(root: int, probs: list[list[float]], tokens: list[list[int]], budget: int) -> HostTree:
    """The tree of a budget strategy over shared per-depth candidates (`laspec`'s `select` with
    `limit_to_budget`, greedy).

    Args:
        root: the pending root token.
        probs / tokens: `[depth][k]` the block's top-k per depth (probabilities > 0, float32 values), one
            level per depth; the tree never goes deeper.
        budget: `n_max`, draft nodes taken over all levels (ranked within a level by path probability, ties
            to the earlier candidate in (parent, rank) order).
    """
    tree = HostTree(root)
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
    return tree


def latest_match(row: list[int], max_ngram: int, num_tokens: int) -> tuple[list[int], int]:
    """`(tokens, n)`: the (up to `num_tokens`) tokens that followed the latest earlier occurrence of `row`'s
    longest matching suffix of length n <= `max_ngram` (`lookup.context_lookup` for one row), or `([], 0)`."""
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
