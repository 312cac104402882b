"""Choosing the accepted path of a verified tree.

Terms (as in vLLM's rejection sampler): *accepted* tokens are draft tokens
kept; the *bonus* token is the target's own token after the last accepted
one (its greedy choice, or under sampling a draw from the target's
distribution, or from the residual distribution after a rejection).

Greedy: `ops.greedy_accept`, the longest path matching the target's argmax.

Sampling: recursive rejection sampling without replacement (Jeon et al.
2024, "Recursive Speculative Decoding"; SpecInfer). The drafter drew each
node's children without replacement from its processed distribution q. At a
node with target distribution p, children are tried in the order drawn:

    accept child x with probability min(1, p(x) / q(x))
    on rejection:  p <- norm(max(p - q, 0)),  q(x) <- 0,  q <- norm(q)
    all rejected:  the bonus token is drawn from the final p

and after an accepted node the walk continues at that node with fresh p and
q. A node without children ends the walk with a bonus drawn from its p. With
one child per node this is Leviathan et al. (2023), Algorithm 1. The output
distribution is exactly the target's.
"""

from __future__ import annotations

import torch

from ..trees import DraftTree
from .randomness import RowRandom


def children_table(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`(B, N, C)` children of every node in tree order (= the order they were drawn), -1 padded."""
    batch, num_nodes = parents.shape
    is_child = valid & (parents >= 0)
    parent = torch.where(is_child, parents, num_nodes)  # padding goes to a dummy parent
    order = torch.sort(parent * num_nodes + torch.arange(num_nodes, device=parents.device), dim=-1).indices
    sorted_parent = parent.gather(1, order)
    # rank among siblings = position minus the first position of that parent in sorted order
    position = torch.arange(num_nodes, device=parents.device).expand(batch, -1)
    first = torch.full((batch, num_nodes + 1), num_nodes, dtype=torch.long, device=parents.device)
    first.scatter_reduce_(1, sorted_parent, position, reduce="amin")
    rank = position - first.gather(1, sorted_parent)
    width = int(rank[sorted_parent < num_nodes].max()) + 1 if bool((sorted_parent < num_nodes).any()) else 1
    table = torch.full((batch, num_nodes + 1, width), -1, dtype=torch.long, device=parents.device)
    keep = sorted_parent < num_nodes
    rows = torch.arange(batch, device=parents.device)[:, None].expand(-1, num_nodes)
    table[rows[keep], sorted_parent[keep], rank[keep]] = order[keep]
    return table[:, :num_nodes]


def _accept_probability(p: torch.Tensor, q: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) per row; `p`, `q` `(B, V)`, `token` `(B,)`."""
    p_x = p.gather(1, token[:, None]).squeeze(1)
    q_x = q.gather(1, token[:, None]).squeeze(1)
    return torch.where(q_x > 0, p_x / q_x.clamp_min(1e-30), torch.ones_like(p_x)).clamp(max=1.0)


def _reject_update(p: torch.Tensor, q: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """After rejecting `token`: p <- norm(max(p - q, 0)), q(x) <- 0, q <- norm(q)."""
    residual = (p - q).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # mass == 0 only when p == q, where the draw above accepts with certainty; guard the division anyway
    p = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)
    q = q.scatter(1, token[:, None], 0.0)
    q = q / q.sum(-1, keepdim=True).clamp_min(1e-30)
    return p, q


def sample_accept(
    tree: DraftTree, target_probs: torch.Tensor, random: RowRandom | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling without replacement over a batch of trees.

    Args:
        tree (`DraftTree`): with `draft_probs` `(B, N, V)`, the drafter distribution each processed node's
            children were drawn from.
        target_probs (`torch.FloatTensor` of shape `(B, N, V)`): the target's processed distribution after
            each node.
        random (`RowRandom`, *optional*): where the draws come from (default: torch's global generator).

    Returns:
        `(path_index, accept_length, bonus)` as `ops.greedy_accept` returns them.
    """
    batch, num_nodes, _ = target_probs.shape
    device = target_probs.device
    random = random if random is not None else RowRandom()
    if tree.num_levels == 0:  # the pending token alone (a plain step): the next token is drawn from p
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        everyone = torch.ones(batch, dtype=torch.bool, device=device)
        return zeros[:, None], zeros, random.categorical(target_probs[:, 0], everyone)
    children = children_table(tree.parents, tree.valid)  # (B, N, C)
    rows = torch.arange(batch, device=device)
    current = torch.zeros(batch, dtype=torch.long, device=device)
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    path_index = torch.zeros(batch, tree.num_levels + 1, dtype=torch.long, device=device)
    accept_length = torch.zeros(batch, dtype=torch.long, device=device)
    bonus = torch.zeros(batch, dtype=torch.long, device=device)
    p = target_probs[:, 0]
    q = tree.draft_probs[:, 0]
    for _ in range(tree.num_levels + 1):
        kids = children[rows, current]  # (B, C)
        moved = torch.zeros(batch, dtype=torch.bool, device=device)
        for j in range(kids.shape[1]):
            child = kids[:, j]
            trying = walking & ~moved & (child >= 0)
            if not bool(trying.any()):
                break
            token = tree.tokens[rows, child.clamp_min(0)]
            draw = random.uniform(trying)
            accepted = trying & (draw < _accept_probability(p, q, token))
            rejected = trying & ~accepted
            new_p, new_q = _reject_update(p, q, token)
            p = torch.where(rejected[:, None], new_p, p)
            q = torch.where(rejected[:, None], new_q, q)
            current = torch.where(accepted, child, current)
            moved |= accepted
        # rows that found no accepted child end here: bonus from the (residual) p
        ending = walking & ~moved
        if bool(ending.any()):
            drawn = random.categorical(p, ending)
            bonus = torch.where(ending, drawn, bonus)
        walking &= moved
        accept_length += walking.long()
        path_index[rows, accept_length] = torch.where(walking, current, path_index[rows, accept_length])
        if not bool(walking.any()):
            break
        p = torch.where(walking[:, None], target_probs[rows, current], p)
        q = torch.where(walking[:, None], tree.draft_probs[rows, current], q)
    # entries past the accepted length repeat the last accepted node, like ops.greedy_accept
    last = path_index.gather(1, accept_length[:, None])
    columns = torch.arange(path_index.shape[1], device=device)[None, :]
    path_index = torch.where(columns <= accept_length[:, None], path_index, last)
    return path_index, accept_length, bonus
