"""Which nodes to verify, as pure maths: survival probabilities along the tree (`survival`), and the count of best
nodes that maximises expected tokens minus priced time, shared by the batch (`choose_prefix`, and
`choose_prefix_host` on one row's lists) or per row for a packed block (`choose_nodes`)."""

from __future__ import annotations

import torch

from ..trees.levels import descending_rank
from .profile import between

__all__ = ["choose_nodes", "choose_prefix", "choose_prefix_host", "survival"]


def survival(tree, accept: torch.Tensor) -> torch.Tensor:
    """`(B, N)` pi_i: product of the per-node acceptance `accept` `(B, N)` along each node's path (root = 1),
    multiplied level by level (each node: its parent's pi times its own acceptance, in float32)."""
    accept = torch.where(tree.valid, accept.float(), 0.0)
    pi = accept.clone()
    pi[:, 0] = 1.0
    parents = tree.parents.clamp_min(0)
    for level in range(1, tree.num_levels + 1):  # parents are final once their level is done
        pi = torch.where(tree.valid & (tree.depths == level), pi.gather(1, parents) * accept, pi)
    return pi


def choose_prefix(pi: torch.Tensor, cost_table: torch.Tensor, seconds_per_token) -> tuple[torch.Tensor, torch.Tensor]:
    """Which nodes to verify: the best count n of highest-pi nodes per row, shared by the batch.

    Args:
        pi (`torch.FloatTensor` of shape `(B, N)`): survival probability of each node (root first, pi = 1;
            padding 0). Along any path pi never grows, so the top-n set is closed under ancestors.
        cost_table (`torch.Tensor` of shape `(M,)`): T(m) for m = 0 .. M - 1 tokens in one forward.
        seconds_per_token (`float` or 0-d tensor): t_token, the current cost of one generated token.

    Gains and costs are summed and compared in float64 (`choose_prefix_host` does the same in Python).

    Returns:
        `(keep, n)`: `keep` `(B, N)` bool (root always kept) and n (0-d tensor, no host sync), the number of
        draft nodes kept per row.
    """
    batch, num_nodes = pi.shape
    draft = pi[:, 1:]
    gain = draft.sort(dim=-1, descending=True).values.double().sum(0).cumsum(0)  # (N - 1,) summed pi of the n best
    gain = torch.cat([gain.new_zeros(1), gain])  # n = 0 .. N - 1
    sizes = torch.arange(1, num_nodes + 1, device=pi.device).clamp_max(cost_table.shape[0] - 1)
    seconds_per_token = torch.as_tensor(seconds_per_token, device=pi.device).double()
    value = gain - cost_table.to(pi.device, torch.float64)[sizes] / seconds_per_token.clamp_min(1e-9)
    n = value.argmax()
    kept = (descending_rank(draft) < n) & (draft > 0)
    return torch.cat([torch.ones(batch, 1, dtype=torch.bool, device=pi.device), kept], dim=1), n


def choose_nodes(pi: torch.Tensor, cost_table: torch.Tensor, width_table: torch.Tensor,
                 seconds_per_token) -> tuple[torch.Tensor, torch.Tensor]:
    """Which nodes to verify when the forward runs each row's real tokens only (a packed block): per row.

    A packed block over B rows costs what its real tokens cost plus what its width costs (attention and the
    cache run over the padded block). The chain curve T(n) holds both, at x = n tokens per row and width n; the
    width curve T_w(W) (one real token per row) holds the width's share: A(W) = T_w(W) - T_w(1). So with m the
    draft nodes over all rows, x = 1 + m / B and W the widest row's tokens, C(m, W) = T(x) - A(x) + A(W)
    (T(n) again for a full block, W = x = n). A node is worth its own marginal cost, not B times it: the nodes of
    all rows are taken in one descending order of survival probability pi, and the count m that maximises
    S(m) - C(m, W(m)) / t_token is kept. An easy row then verifies a deep chain or a tree while a hard row of
    the same batch verifies its root alone.

    Args:
        pi (`torch.FloatTensor` of shape `(B, N)`): survival probability of each node (root first; padding 0).
            Along a path pi never grows and ties are taken in index order, so the kept set of each row is
            closed under ancestors.
        cost_table (`torch.Tensor` of shape `(M,)`): T(n) for n = 0 .. M - 1 tokens per row (a chain block).
        width_table (`torch.Tensor` of shape `(M,)`): T_w(W) for W = 0 .. M - 1, one real token per row.
        seconds_per_token (`float` or 0-d tensor): t_token.

    Returns:
        `(keep, counts)`: `keep` `(B, N)` bool (roots kept) and `counts` `(B,)` the draft nodes kept per row.
    """
    batch, num_nodes = pi.shape
    device = pi.device
    draft = pi[:, 1:]
    flat = draft.reshape(-1)
    order = flat.argsort(descending=True, stable=True)  # ties: row-major index order, parents first
    gain = torch.cat([flat.new_zeros(1, dtype=torch.float64), flat[order].double().cumsum(0)])  # m = 0 .. B(N-1)
    row_rank = descending_rank(draft).reshape(-1)[order]  # the node's place in its own row's order
    width = torch.cat([row_rank.new_zeros(1), (row_rank + 1).cummax(0).values]) + 1  # W(m): root + deepest row
    last = cost_table.shape[0] - 1
    tokens = 1.0 + torch.arange(gain.shape[0], device=device, dtype=torch.float64) / batch
    low = tokens.floor().long().clamp_max(last - 1)
    frac = tokens - low
    table, widths = cost_table.to(device, torch.float64), width_table.to(device, torch.float64)
    chain = between(table, low, frac)
    width_share = between(widths, low, frac)  # A(x) + T_w(1)
    cost = chain - width_share + widths[width.clamp_max(last)]
    seconds_per_token = torch.as_tensor(seconds_per_token, device=device).double().clamp_min(1e-9)
    m = (gain - cost / seconds_per_token).argmax()
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen[order] = torch.arange(flat.shape[0], device=device) < m
    kept = chosen.view_as(draft) & (draft > 0)
    return torch.cat([torch.ones(batch, 1, dtype=torch.bool, device=device), kept], dim=1), kept.sum(-1)


def choose_prefix_host(pi: list[float], costs: list[float], seconds_per_token: float) -> tuple[list[bool], int]:
    """`choose_prefix` for one row on the host: `pi` `[N]` (root first), `costs` `[M]` the scaled cost table,
    `seconds_per_token` > 0; the same float64 sums and comparisons, ties to the lower index."""
    draft = pi[1:]
    order = sorted(range(len(draft)), key=lambda i: -draft[i])  # stable: ties keep index order
    best_n, best_value, gain = 0, None, 0.0
    for n in range(len(pi)):
        if n:
            gain += draft[order[n - 1]]
        value = gain - costs[min(n + 1, len(costs) - 1)] / seconds_per_token
        if best_value is None or value > best_value:
            best_n, best_value = n, value
    kept = [False] * len(draft)
    for node in order[:best_n]:
        kept[node] = draft[node] > 0
    return [True] + kept, best_n
