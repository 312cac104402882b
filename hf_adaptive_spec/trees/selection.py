"""What a strategy decides each round, as one value the tree builder reads: a `Shape`, a `Budget` or a `Rule`.

* `Shape`: fixed rank paths (`(0, 1)`: the drafter's top candidate at the root, then that node's second
  candidate), one of a set of shapes per row (`chain` of its row's length, `static_tree`, a planned `sage` round).
* `Budget`: level by level, the candidates of highest path probability until `n_max` draft nodes are taken
  (`laspec`).
* `Rule`: any per-level choice (`sage`'s Eq. 10-12), a callable of the tensors.

Each gives the tensor builder its per-level `select(level, frontier, candidate_probs)` -> `(take, expand)`
(`selector`); a shape or a budget at one CPU row is also what the host backend builds from (`trees.host`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .levels import limit_to_budget

__all__ = ["Budget", "Rule", "Shape", "ShapeSet", "shape_tables"]


class ShapeSet:
    """Shapes a strategy selects among, each a tuple of prefix-closed rank paths sorted by depth, then rank, with
    their per-level tables (made once per set of shapes and device: a strategy keeps the set across rounds)."""

    def __init__(self, shapes):
        self.shapes = tuple(tuple(tuple(path) for path in shape) for shape in shapes)
        self.max_ranks = [max(max(path) for path in shape) for shape in self.shapes]
        self.children = max(self.max_ranks) + 1
        self._tables: dict = {}

    def __len__(self) -> int:
        return len(self.shapes)

    def tables(self, device) -> list:
        key = str(device)
        if key not in self._tables:
            self._tables[key] = _level_tables(self.shapes, self.children, key)
        return self._tables[key]


@dataclass(frozen=True)
class Shape:
    """Each row takes exactly the rank paths of its shape, whatever the candidates' probabilities.

    Fields:
        shapes (`ShapeSet`): the shapes.
        choice (`torch.LongTensor` of shape `(B,)`, *optional*): each row's shape; None: the first for every row.
    """

    shapes: ShapeSet
    choice: torch.Tensor | None = None

    def _row(self, row: int) -> int:
        return 0 if self.choice is None else int(self.choice[row])

    def row_shape(self, row: int = 0) -> tuple:
        return self.shapes.shapes[self._row(row)]

    def row_max_rank(self, row: int = 0) -> int:
        return self.shapes.max_ranks[self._row(row)]

    def selector(self, batch: int, device):
        tables = self.shapes.tables(device)
        choice = torch.zeros(batch, dtype=torch.long, device=device) if self.choice is None else self.choice

        def select(level, frontier, candidate_probs):
            width, k = candidate_probs.shape[1:]
            empty = torch.zeros_like(candidate_probs, dtype=torch.bool)
            if level > len(tables):
                return empty, empty
            takes, expands = tables[level - 1]
            rows, ranks = min(width, takes.shape[1]), min(k, takes.shape[2])
            take, expand = takes[choice, :rows, :ranks], expands[choice, :rows, :ranks]
            if (rows, ranks) != (width, k):  # a narrower frontier or fewer ranks in every shape: nothing there
                pad = (0, k - ranks, 0, width - rows)
                take, expand = torch.nn.functional.pad(take, pad), torch.nn.functional.pad(expand, pad)
            valid = frontier.valid[..., None]
            return take & valid, expand & valid

        return select


@dataclass(frozen=True)
class Budget:
    """Level by level, each row's candidates of highest path probability (sampling: of highest parent path
    probability, `limit_to_budget`) until `n_max` draft nodes are taken; every taken node may grow."""

    n_max: int
    sampling: bool = False

    def selector(self, batch: int, device):
        used = torch.zeros(batch, dtype=torch.long, device=device)

        def select(level, frontier, candidate_probs):
            nonlocal used
            take = frontier.valid[..., None].expand_as(candidate_probs)
            take = limit_to_budget(take, frontier, candidate_probs, (self.n_max - used).clamp_min(0), self.sampling)
            used = used + take.flatten(1).sum(-1)
            return take, take

        return select


@dataclass(frozen=True)
class Rule:
    """A per-level choice: `make(batch, device)` gives the round's `select(level, frontier, candidate_probs)`
    -> `(take, expand)` `(B, F, K)` bool."""

    make: object

    def selector(self, batch: int, device):
        return self.make(batch, device)


def shape_tables(paths, max_children: int, device) -> tuple[list, list]:
    """Per level, `(F, max_children)` bool tables of which candidate ranks of each frontier node a shape of rank
    `paths` takes and expands, the frontier in the builder's own order (frontier order, then rank)."""
    paths = set(paths)
    takes, expands = [], []
    frontier = [()]
    for _ in range(max(len(p) for p in paths)):
        take = torch.zeros(len(frontier), max_children, dtype=torch.bool)
        expand = torch.zeros_like(take)
        next_frontier = []
        for f, parent in enumerate(frontier):
            for r in range(max_children):
                child = parent + (r,)
                if child in paths:
                    take[f, r] = True
                    if any(len(p) > len(child) and p[: len(child)] == child for p in paths):
                        expand[f, r] = True
                        next_frontier.append(child)
        takes.append(take.to(device))
        expands.append(expand.to(device))
        frontier = next_frontier
    return takes, expands


@lru_cache(maxsize=64)
def _level_tables(shapes: tuple, children: int, device: str) -> list:
    """Per level, `(takes, expands)` `(C, F, K)` of every shape (made once per set of shapes and device: every
    call of a setting selects with the same ones; read only)."""
    tables = [shape_tables(shape, children, device) for shape in shapes]
    depth = max(len(takes) for takes, _ in tables)
    return [(_stack_level([t[0][level] if level < len(t[0]) else None for t in tables]),
             _stack_level([t[1][level] if level < len(t[1]) else None for t in tables]))
            for level in range(depth)]


def _stack_level(tables: list) -> torch.Tensor:
    """One level's tables of every shape `(F_c, K)` (None: the shape ends above) as `(C, F, K)`."""
    present = [t for t in tables if t is not None]
    width, k = max(t.shape[0] for t in present), present[0].shape[1]
    out = torch.zeros(len(tables), width, k, dtype=torch.bool, device=present[0].device)
    for c, table in enumerate(tables):
        if table is not None:
            out[c, : table.shape[0]] = table
    return out
