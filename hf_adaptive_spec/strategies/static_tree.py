"""`static_tree`: one fixed tree shape for every round, given as a list of paths of candidate ranks.

A path `(0, 1)` means: the drafter's top-1 candidate at the root, then that
node's second-best candidate. The set must be prefix-closed, as in Medusa's
and SpecInfer's static trees.
"""

from __future__ import annotations

import heapq
import numbers
from dataclasses import dataclass

from ..trees.selection import Shape, ShapeSet
from .base import Strategy, StrategyConfig, check_visual_selection, on_gpu


def default_tree_paths(num_nodes: int, max_depth: int, rank_acceptance=(0.7, 0.15, 0.06, 0.03)) -> list[tuple]:
    """The `num_nodes` paths of highest prior acceptance, assuming rank r is accepted with `rank_acceptance[r]`.

    A path's score is the product over its ranks; extending a path never raises its score, so the
    result is prefix-closed. Ties go to shallower, then lexicographically smaller paths.
    """
    heap = [(-rank_acceptance[r], (r,)) for r in range(len(rank_acceptance))]
    heapq.heapify(heap)
    chosen = []
    while heap and len(chosen) < num_nodes:
        negative_score, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < max_depth:
            for r in range(len(rank_acceptance)):
                heapq.heappush(heap, (negative_score * rank_acceptance[r], path + (r,)))
    return sorted(chosen, key=lambda p: (len(p), p))


def candidate_shapes(max_depth: int, max_nodes: int, extra=()) -> list[tuple]:
    """The shapes a round chooses among: chains of every depth 1..`max_depth` and the `extra` shapes (a static
    tree, SAGE's trees), each sorted by depth then rank, without repeats and within `max_nodes` draft nodes."""
    shapes = [tuple((0,) * depth for depth in range(1, d + 1)) for d in range(1, min(max_depth, max_nodes) + 1)]
    for shape in extra:
        shape = tuple(sorted(set(tuple(p) for p in shape), key=lambda p: (len(p), p)))
        if shape and len(shape) <= max_nodes and shape not in shapes:
            shapes.append(shape)
    return shapes


@dataclass
class StaticTreeConfig(StrategyConfig):
    """Settings of the `static_tree` strategy.

    Args:
        paths (list of tuples of `int`, *optional*): the tree as prefix-closed rank paths. Default: the
            `default_tree_paths` of 6 nodes and depth 5 on a CPU, 24 nodes and depth 6 on a GPU.
        visual_tokens (`int`, *optional*), visual_selection (`str`): how many of the image's visual tokens an
            independent VLM drafter sees, and when the target's attention picks them ("prefill" or "round"; see
            `strategies.base.VISUAL_FIELDS_DOC`). None: the whole image.
    """

    paths: list | None = None
    visual_tokens: int | None = None
    visual_selection: str = "prefill"

    def device_defaults(self, device):
        if on_gpu(device):
            return {"paths": default_tree_paths(24, 6)}
        return {"paths": default_tree_paths(6, 5)}

    def validate(self):
        """`paths` is None or a non-empty list of distinct, non-empty tuples of ranks (ints >= 0), prefix-closed;
        it is stored as tuples sorted by depth, then rank (lists, e.g. from JSON, are accepted)."""
        check_visual_selection(self)
        if self.paths is None:
            return
        shape = "a non-empty list of tuples of ranks (ints >= 0)"
        if not isinstance(self.paths, (list, tuple)):
            raise TypeError(f"StaticTreeConfig.paths must be {shape}, got {self.paths!r}.")
        if not self.paths:
            raise ValueError(f"StaticTreeConfig.paths must be {shape}, got {self.paths!r}.")
        paths = []
        for path in self.paths:
            if not isinstance(path, (list, tuple)) or any(
                isinstance(r, bool) or not isinstance(r, numbers.Integral) for r in path
            ):
                raise TypeError(f"StaticTreeConfig.paths must be {shape}; {path!r} is not a tuple of ints.")
            if not path or min(path) < 0:
                raise ValueError(f"StaticTreeConfig.paths must be {shape}; got the path {path!r}.")
            paths.append(tuple(int(r) for r in path))
        present = set(paths)
        if len(present) != len(paths):
            repeated = next(p for p in paths if paths.count(p) > 1)
            raise ValueError(f"StaticTreeConfig.paths contains duplicates: {repeated} appears more than once.")
        for p in paths:
            if len(p) > 1 and p[:-1] not in present:
                raise ValueError(f"StaticTreeConfig.paths is not prefix-closed: {p} lacks its parent {p[:-1]}.")
        self.paths = sorted(paths, key=lambda p: (len(p), p))

    def check_vocab(self, vocab_size):
        if self.paths is None:
            return
        rank = max(max(p) for p in self.paths)
        if rank >= vocab_size:
            path = next(p for p in self.paths if rank in p)
            raise ValueError(
                f"StaticTreeConfig.paths asks for the candidate of rank {rank} (path {path}), but the drafter has "
                f"{vocab_size} tokens: ranks must be < {vocab_size}."
            )


class StaticTreeStrategy(Strategy):
    name = "static_tree"
    config_class = StaticTreeConfig

    def __init__(self, config, batch_size, device, sampling=False):
        super().__init__(config, batch_size, device, sampling)
        self._shape = Shape(ShapeSet([config.paths]))

    @property
    def max_children(self):
        return self._shape.shapes.children

    def on_root(self, root_logits):
        return self._shape
