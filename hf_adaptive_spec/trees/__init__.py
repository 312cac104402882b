"""Draft trees: the `DraftTree` type and its one builder.

`build(root, candidates, selection, branches)` (`trees.build`) makes every tree a round verifies: a drafter
offers candidates (`PerDepth`, `PerNode`), the strategy's selection (`Shape`, `Budget`, `Rule`) chooses among
them, and `branches` (`ContextBranch`, `StoreBranch`) hang chains under the root. One CPU row is built on host
lists (`trees.host`), everything else with tensors (`trees.levels`), the reference.
"""

from .branches import Committed, ContextBranch, StoreBranch, lookup_code, store_code
from .build import PerDepth, PerNode, build
from .selection import Budget, Rule, Shape, ShapeSet
from .tree import DraftTree, compact_true, one_cpu_row

__all__ = ["Budget", "Committed", "ContextBranch", "DraftTree", "PerDepth", "PerNode", "Rule", "Shape", "ShapeSet",
           "StoreBranch", "build", "compact_true", "lookup_code", "one_cpu_row", "store_code"]
