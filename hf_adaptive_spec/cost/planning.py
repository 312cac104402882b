"""Each round's tree chosen among candidates by expected accepted tokens per second of round time.

A candidate is a tree shape: prefix-closed paths of candidate ranks (`(0, 0)`: the drafter's top token, then
that node's top token), as a static tree is written (`strategies.static_tree.candidate_shapes`). Before a round drafts, each row's candidates are priced:

    tokens(c)  = 1 + sum over the paths of c of prod_j a(alpha, depth j, rank r_j)
    seconds(c) = t_round + sum over the levels c expands of t_level(width) + T(nodes(c) + 1)

`a` is what the target accepted, measured per pair online (`DepthAcceptance`: per confidence bin, depth and
rank, a depth with few observations leaning on the depth above it); `t_level(width)` is a drafter level's
measured wall time (nothing for a block drafter, which drafts every depth in one forward); `T` is the
verifier's cost curve; `t_round` is the rest of a round (the root's drafter forward, tree work, acceptance,
commit), measured. The row drafts the candidate of highest tokens / seconds.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..trees.tree import one_cpu_row

__all__ = ["DepthAcceptance", "RoundPlanner", "level_widths", "sibling_ranks"]


def level_widths(paths) -> tuple[int, ...]:
    """Nodes a shape expands at each level below its deepest: the drafter forward widths it needs."""
    present = set(paths)
    depth = max(len(p) for p in paths)
    return tuple(sum(1 for p in present if len(p) == level and any(len(q) > level and q[:level] == p
                                                                       for q in present))
                 for level in range(1, depth))


def sibling_ranks(tree) -> torch.Tensor:
    """`(B, N)` each node's rank among its siblings (valid earlier children of the same parent): the order a
    greedy level adds a node's children in, best first."""
    parents, valid = tree.parents, tree.valid
    same = (parents[:, :, None] == parents[:, None, :]) & valid[:, None, :]
    earlier = torch.ones(parents.shape[1], parents.shape[1], dtype=torch.bool, device=parents.device).tril(-1)
    return (same & earlier).sum(-1)


class DepthAcceptance:
    """P(target accepts a node | its parent was accepted), per confidence bin of the round (SAGE's alpha), depth
    and sibling rank, learned from every verified node.

    Estimates shrink twice, so that one call's few dozen rounds already price well: a (depth, rank) estimate
    pooled over every bin is its counts plus `depth_weight` pseudo-counts at the pooled estimate of the depth
    above (depth 1: at the prior `prior(alpha, rank)`, averaged over the bins), so a depth the rounds rarely reach
    follows the depths they do reach; a bin's own estimate is its counts plus `weight` pseudo-counts at that
    pooled estimate. The planner prices with an optimistic bound (`table(optimistic=True)`): a cell seen few
    times gets the benefit of the doubt, so a depth the plans stopped short of is tried again until its own
    counts say what it is worth (rounds that never go deeper would otherwise never learn that they should).
    """

    def __init__(self, max_depth: int, max_rank: int, bins: int = 10, weight: float = 2.0,
                 depth_weight: float = 8.0):
        self.bins, self.weight, self.depth_weight = bins, weight, depth_weight
        self.accepted = torch.zeros(bins, max_depth, max_rank, dtype=torch.float64)
        self.total = torch.zeros_like(self.accepted)
        self.rounds = 0  # verified trees learned from, over every call that shares these estimates

    @staticmethod
    def prior(alpha: torch.Tensor, ranks: int) -> torch.Tensor:
        """`(bins, ranks)` the prior of a drafter whose confidence is `alpha`: its top token accepted with
        0.3 + 0.6 alpha, each lower rank a third as often as the one above."""
        top = 0.3 + 0.6 * alpha
        return top[:, None] * (1.0 / 3.0) ** torch.arange(ranks, dtype=torch.float64)[None, :]

    def table(self, optimistic: bool = False) -> torch.Tensor:
        """`(bins, depths, ranks)` the estimates; `optimistic`: each raised by sqrt(a (1 - a)) / (n + 1), n its
        pooled count (at most 1): a cell never seen gets the benefit of the doubt, a well-observed one almost none
        (a standard error, 1 / sqrt(n + 1), would price every deep path high through the product of its cells)."""
        centres = (torch.arange(self.bins, dtype=torch.float64) + 0.5) / self.bins
        above = self.prior(centres, self.accepted.shape[2]).mean(0)  # (ranks,)
        pooled_accepted, pooled_total = self.accepted.sum(0), self.total.sum(0)  # (depths, ranks)
        pooled = torch.empty_like(pooled_total)
        for depth in range(pooled.shape[0]):
            above = (pooled_accepted[depth] + self.depth_weight * above) / (pooled_total[depth] + self.depth_weight)
            pooled[depth] = above
        table = (self.accepted + self.weight * pooled[None]) / (self.total + self.weight)
        if optimistic:
            spread = (table * (1 - table)).sqrt()  # a cell's spread; the bonus fades as 1 / (n + 1), not 1 / sqrt
            table = (table + spread / (pooled_total[None] + 1)).clamp(max=1.0)
        return table

    def bin(self, alpha: torch.Tensor) -> torch.Tensor:
        return (alpha.double() * self.bins).long().clamp(0, self.bins - 1)

    def observe(self, tree, target_choice: torch.Tensor, path_index: torch.Tensor, alpha: torch.Tensor) -> None:
        """Learn from one verified tree: its nodes whose parent the target accepted (on the accepted path
        `path_index` `(B, D + 1)`, root first), right or not, under each row's `alpha` `(B,)`."""
        if one_cpu_row(tree):
            self._observe_row(tree.tokens[0].tolist(), tree.parents[0].tolist(), tree.depths[0].tolist(),
                              target_choice[0].tolist(), set(path_index[0].tolist()), float(alpha[0]))
            return
        nodes = tree.valid.clone()
        nodes[:, 0] = False
        parents = tree.parents.clamp_min(0)
        right = (tree.tokens == target_choice.gather(1, parents)) & nodes
        on_path = torch.zeros_like(nodes).scatter_(1, path_index, True)
        verified = nodes & on_path.gather(1, parents)
        depth, rank = tree.depths - 1, sibling_ranks(tree)
        verified &= (depth < self.accepted.shape[1]) & (rank < self.accepted.shape[2])
        bins = self.bin(alpha)[:, None].expand_as(depth)
        index = ((bins * self.accepted.shape[1] + depth) * self.accepted.shape[2] + rank)[verified].cpu()
        self.total.view(-1).index_add_(0, index, torch.ones(index.shape[0], dtype=torch.float64))
        self.accepted.view(-1).index_add_(0, index, right[verified].double().cpu())
        self.rounds += 1

    def _observe_row(self, tokens: list, parents: list, depths: list, choice: list, path: set, alpha: float) -> None:
        """`observe` for one CPU row with no padding nodes, on host lists (the same cells and counts)."""
        _, max_depth, max_rank = self.accepted.shape
        row = min(max(int(alpha * self.bins), 0), self.bins - 1) * max_depth  # `bin`: float64 product, truncated
        seen: dict = {}  # children met so far per parent: a node's sibling rank
        index, right = [], []
        for node in range(1, len(tokens)):
            parent = parents[node]
            rank = seen.get(parent, 0)
            seen[parent] = rank + 1
            depth = depths[node] - 1
            if parent in path and depth < max_depth and rank < max_rank:
                index.append((row + depth) * max_rank + rank)
                right.append(float(tokens[node] == choice[parent]))
        if index:
            index = torch.tensor(index)
            self.total.view(-1).index_add_(0, index, torch.ones(len(right), dtype=torch.float64))
            self.accepted.view(-1).index_add_(0, index, torch.tensor(right, dtype=torch.float64))
        self.rounds += 1


@lru_cache(maxsize=32)
def _compiled(shapes: tuple, max_depth: int, max_rank: int) -> tuple:
    """What pricing `shapes` needs, made once per set of shapes (every call of a setting plans over the same
    ones): `(ranks (C, P, D), real (C, P, D'), rank_index, depth_index, nodes, widths)`, D' = the depths the
    acceptance table holds."""
    depth = max(len(p) for shape in shapes for p in shape)
    size = max(len(shape) for shape in shapes)
    # (C, P, D) rank of each path's node at each depth; -1 past the path's end (and for padding paths)
    ranks = torch.full((len(shapes), size, depth), -1, dtype=torch.long)
    for c, shape in enumerate(shapes):
        for p, path in enumerate(shape):
            ranks[c, p, : len(path)] = torch.tensor(path)
    depths = min(depth, max_depth)
    kept = ranks[:, :, :depths]
    rank_index = kept.clamp(0, max_rank - 1)  # ranks past the table: its last
    depth_index = torch.arange(depths)[None, None, :].expand_as(kept)
    return (ranks, kept >= 0, rank_index, depth_index, [len(shape) for shape in shapes],
            [level_widths(shape) for shape in shapes])


class RoundPlanner:
    """Prices candidate shapes for each row and picks the best (see the module docstring).

    Args:
        shapes (list of shapes): the candidates (`candidate_shapes`).
        acceptance (`DepthAcceptance`): what the target accepts.
        verify_seconds (callable): `nodes -> seconds` of verifying that many tokens per row (root included).
        level_seconds (callable): `width -> seconds` of one drafter level that expands `width` nodes (0 for a
            drafter that drafts every depth in one forward).
    """

    SMOOTHING = 0.3
    REFRESH_EVERY = 8  # observed rounds between two pricings of the candidates' tokens (after the first ones)

    def __init__(self, shapes: list, acceptance: DepthAcceptance, verify_seconds, level_seconds):
        self.shapes, self.acceptance = shapes, acceptance
        self.verify_seconds, self.level_seconds = verify_seconds, level_seconds
        self.round_seconds = 0.0  # t_round: a round's time outside drafter levels and verification (measured)
        self.observed = 0  # rounds learned from
        (self.ranks, self._real, self._rank_index, self._depth_index, self.nodes,
         self.widths) = _compiled(tuple(tuple(shape) for shape in shapes), *acceptance.accepted.shape[1:])
        self.refresh()

    def refresh(self) -> None:
        """Price the candidates' tokens again from what the acceptance has learned (after `observe`)."""
        self._tokens = self._expected(self.acceptance.table(optimistic=True))
        self._host_tokens = self._tokens.tolist()  # (bins, C): a single row's choice reads lists

    def expected_tokens(self, alpha: torch.Tensor) -> torch.Tensor:
        """`(B, C)` expected tokens of each candidate (accepted drafts + the bonus) for rows of confidence
        `alpha` `(B,)`."""
        return self._tokens[self.acceptance.bin(alpha).cpu()]

    def _expected(self, table: torch.Tensor) -> torch.Tensor:
        """`(bins, C)` expected tokens of each candidate at each confidence bin of `table` `(bins, D, R)`."""
        a = table[:, self._depth_index, self._rank_index]  # (bins, C, P, D)
        pi = torch.where(self._real[None], a, 1.0).prod(-1) * self._real[None, :, :, 0]
        return 1.0 + pi.sum(-1)

    def seconds(self) -> torch.Tensor:
        """`(C,)` each candidate's round time."""
        return torch.tensor(self._seconds(), dtype=torch.float64)

    def _seconds(self) -> list:
        return [self.round_seconds + sum(self.level_seconds(w) for w in widths) + self.verify_seconds(nodes + 1)
                for widths, nodes in zip(self.widths, self.nodes)]

    def choose(self, alpha: torch.Tensor) -> torch.Tensor:
        """`(B,)` the candidate of highest expected tokens per second for each row (the first of equals)."""
        if alpha.shape[0] == 1:  # one row: the same float64 quotients on host lists
            tokens = self._host_tokens[min(max(int(float(alpha[0]) * self.acceptance.bins), 0),
                                           self.acceptance.bins - 1)]
            rates = [t / max(s, 1e-9) for t, s in zip(tokens, self._seconds())]
            return torch.tensor([rates.index(max(rates))])
        rate = self.expected_tokens(alpha) / self.seconds().clamp_min(1e-9)[None, :]
        return rate.argmax(-1)

    def observe(self, tree, target_choice: torch.Tensor, path_index: torch.Tensor, alpha: torch.Tensor) -> None:
        """Learn the target's acceptance from a verified round (`DepthAcceptance.observe`); the candidates are
        priced again after each of the first `REFRESH_EVERY` rounds the estimates learn from (counted over every
        call that shares them), then every `REFRESH_EVERY` rounds (a round moves the estimates little, and
        pricing costs more than counting)."""
        self.acceptance.observe(tree, target_choice, path_index, alpha)
        self.observed += 1
        rounds = self.acceptance.rounds
        if rounds <= self.REFRESH_EVERY or rounds % self.REFRESH_EVERY == 0:
            self.refresh()

    def observe_round(self, round_seconds: float, level_seconds: float, verify_seconds: float) -> None:
        """A round's measured time, its drafter levels' and its verification's: t_round follows the rest."""
        rest = max(round_seconds - level_seconds - verify_seconds, 0.0)
        self.round_seconds += self.SMOOTHING * (rest - self.round_seconds)
