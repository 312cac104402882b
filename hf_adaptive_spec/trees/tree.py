"""The draft tree type: a batch of token trees padded to one node count, built level by level (`trees.build`).

Node 0 of every row is the root: the last committed token, which the target
has not yet processed. Nodes are stored level by level (parents before
children); each level is padded to the widest row, padding nodes have
`valid = False` and parent -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import ops


@dataclass
class DraftTree:
    """A batch of draft trees.

    Fields (B = batch, N = nodes including the root, V = vocabulary):
        tokens: `(B, N)` token of each node.
        parents: `(B, N)` parent index, -1 for the root and padding nodes.
        valid: `(B, N)` False for padding nodes.
        probs: `(B, N)` drafter probability of the node given its parent (root: 1).
        cum_probs: `(B, N)` product of `probs` along the path (root: 1).
        depths: `(B, N)` depth, root 0.
        drafter_slot: `(B, N)` index of the node in the drafter's uncommitted cache, -1 if the drafter
            never processed it (leaves).
        num_levels: depth of the deepest level present.
        draft_probs: for sampling, `(B, N, V)` the drafter distribution (processors applied) each processed
            node's children were drawn from (zeros for unprocessed nodes); None under greedy decoding.
        lookup: `(B, N)` for nodes on the context-lookup chain (`hf_adaptive_spec.trees.branches`), the suffix length
            that found it, else 0; on the chain, `probs` > 0 marks a node the drafter proposed too. None when
            the tree has no lookup branch.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    valid: torch.Tensor
    probs: torch.Tensor
    cum_probs: torch.Tensor
    depths: torch.Tensor
    drafter_slot: torch.Tensor
    num_levels: int
    draft_probs: torch.Tensor | None = None
    lookup: torch.Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def num_drafted(self) -> torch.Tensor:
        """`(B,)` number of real draft nodes per row (root excluded)."""
        return self.valid[:, 1:].sum(-1)

    def subset(self, keep: torch.Tensor) -> "DraftTree":
        """The tree restricted to nodes `keep` `(B, N)` (closed under ancestors, root kept), order preserved."""
        if keep.shape[0] == 1:  # one row keeping its first m nodes (a trimmed chain, a whole tree): views
            kept = keep[0] & self.valid[0]
            m = int(kept.sum())
            if bool(kept[:m].all()):
                return self if m == kept.shape[0] else self._prefix(m)
        index, valid, width = compact_true(keep & self.valid)
        new_index = (keep & self.valid).long().cumsum(-1) - 1  # (B, N) old -> new position
        parents = self.parents.gather(1, index)
        parents = torch.where(valid & (parents >= 0), new_index.gather(1, parents.clamp_min(0)), -1)
        depths = torch.where(valid, self.depths.gather(1, index), 0)
        draft_probs = None
        if self.draft_probs is not None:
            draft_probs = self.draft_probs.gather(1, index[..., None].expand(-1, -1, self.draft_probs.shape[-1]))
            draft_probs = draft_probs * valid[..., None]
        return DraftTree(
            tokens=torch.where(valid, self.tokens.gather(1, index), 0),
            parents=parents,
            valid=valid,
            probs=torch.where(valid, self.probs.gather(1, index), 0.0),
            cum_probs=torch.where(valid, self.cum_probs.gather(1, index), 0.0),
            depths=depths,
            drafter_slot=torch.where(valid, self.drafter_slot.gather(1, index), -1),
            num_levels=int(depths.max()) if depths.numel() else 0,
            draft_probs=draft_probs,
            lookup=None if self.lookup is None else torch.where(valid, self.lookup.gather(1, index), 0),
        )

    def _prefix(self, m: int) -> "DraftTree":
        """The tree of its first `m` nodes (valid, closed under ancestors: `subset` of that prefix)."""
        return DraftTree(
            tokens=self.tokens[:, :m], parents=self.parents[:, :m], valid=self.valid[:, :m],
            probs=self.probs[:, :m], cum_probs=self.cum_probs[:, :m], depths=self.depths[:, :m],
            drafter_slot=self.drafter_slot[:, :m], num_levels=int(self.depths[:, :m].max()),
            draft_probs=None if self.draft_probs is None else self.draft_probs[:, :m],
            lookup=None if self.lookup is None else self.lookup[:, :m],
        )

    def below_stop(self, stop_tokens: torch.Tensor) -> torch.Tensor | None:
        """`(B, N)` nodes below a drafted stop token (an EOS of the row's `stop_tokens` `(B, E)`, -1 padding), or
        None when no node is: such nodes are never of use (an accepted stop token ends the row; a rejected one
        ends the path)."""
        is_stop = (self.tokens[:, :, None] == stop_tokens[:, None, :]).any(-1) & self.valid
        is_stop[:, 0] = False  # the root is committed, not drafted
        if not bool(is_stop.any()):
            return None
        below = torch.zeros_like(is_stop)
        parents = self.parents.clamp_min(0)
        has_parent = self.parents >= 0
        for _ in range(self.num_levels):  # parents come before children: one pass per level settles a depth
            below = (below | is_stop).gather(1, parents) & has_parent
        below &= self.valid
        return below if bool(below.any()) else None

    def path_tokens(self) -> torch.Tensor:
        """`(B, N, num_levels)` tokens on the path root-exclusive to each node; column d-1 holds depth d."""
        ancestors, depths = ops.ancestor_matrix(self.parents)
        levels = torch.arange(1, self.num_levels + 1, device=self.tokens.device)
        on_level = ancestors.unsqueeze(2) & (depths[:, None, None, :] == levels[None, None, :, None])  # (B,N,D,N)
        index = on_level.to(torch.int8).argmax(-1)  # (B, N, D)
        path = self.tokens.gather(1, index.flatten(1)).view_as(index)
        return torch.where(on_level.any(-1), path, -1)


@dataclass
class TreeBuilder:
    """Accumulates levels into a `DraftTree` (tensors are concatenated once at the end)."""

    tokens: list = field(default_factory=list)
    parents: list = field(default_factory=list)
    valid: list = field(default_factory=list)
    probs: list = field(default_factory=list)
    cum_probs: list = field(default_factory=list)
    drafter_slot: list = field(default_factory=list)
    draft_probs: list = field(default_factory=list)  # (node_index (B, F), probs (B, F, V)) pairs
    num_nodes: int = 0
    num_levels: int = 0

    def add_level(self, tokens, parents, valid, probs, cum_probs, drafter_slot) -> torch.Tensor:
        """Append one level (all `(B, W)`); returns the node indices `(W,)` it received."""
        width = tokens.shape[1]
        index = torch.arange(self.num_nodes, self.num_nodes + width, device=tokens.device)
        self.tokens.append(tokens)
        self.parents.append(torch.where(valid, parents, -1))
        self.valid.append(valid)
        self.probs.append(probs)
        self.cum_probs.append(cum_probs)
        self.drafter_slot.append(torch.where(valid, drafter_slot, -1))
        self.num_levels += self.num_nodes > 0
        self.num_nodes += width
        return index

    def build(self) -> DraftTree:
        tokens = torch.cat(self.tokens, dim=1)
        parents = torch.cat(self.parents, dim=1)
        # levels are stored in order, so a node's depth is its level's index (padding nodes: 0)
        depths = torch.cat([torch.where(valid, level, 0) for level, valid in enumerate(self.valid)], dim=1)
        return DraftTree(
            tokens=tokens,
            parents=parents,
            valid=torch.cat(self.valid, dim=1),
            probs=torch.cat(self.probs, dim=1),
            cum_probs=torch.cat(self.cum_probs, dim=1),
            depths=depths,
            drafter_slot=torch.cat(self.drafter_slot, dim=1),
            num_levels=self.num_levels,
            draft_probs=self._scatter_draft_probs(tokens.shape) if self.draft_probs else None,
        )

    def _scatter_draft_probs(self, shape) -> torch.Tensor:
        batch, num_nodes = shape
        vocab = self.draft_probs[0][1].shape[-1]
        device = self.draft_probs[0][1].device
        out = torch.zeros(batch, num_nodes + 1, vocab, device=device)  # last row: sink for padding
        for node_index, probs in self.draft_probs:
            node_index = torch.where(node_index < 0, num_nodes, node_index)
            out.scatter_(1, node_index[..., None].expand(-1, -1, vocab), probs)
        return out[:, :num_nodes]


def one_cpu_row(tree: DraftTree) -> bool:
    """Whether `tree` is one row on a CPU without padding nodes: the case host lists serve (the tree's builder,
    the cost rule's pruning and calibration, the planner's counts), as `ops` runs one CPU row on the host."""
    tokens = tree.tokens
    return tokens.shape[0] == 1 and tokens.device.type == "cpu" and bool(tree.valid.all())


def compact_true(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per row, the positions of True entries moved to the front, in order.

    Args:
        mask (`torch.BoolTensor` of shape `(B, X)`).

    Returns:
        `(index, valid, width)`: `index` `(B, width)` positions into X, `valid`
        `(B, width)` marks the real ones, `width` = the largest row count (a host sync).
    """
    counts = mask.sum(-1)
    width = int(counts.max()) if mask.numel() else 0
    order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices[:, :width]
    valid = torch.arange(width, device=mask.device)[None, :] < counts[:, None]
    return order, valid, width
