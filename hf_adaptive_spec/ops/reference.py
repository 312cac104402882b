"""Plain torch references for the per-round tensor work.

Every function here is the specification of the matching Triton kernel in
`hf_adaptive_spec.ops.triton_kernels`; both take the same arguments and
return the same values. They never touch a model.

Tree layout used throughout: a batch of trees padded to N nodes,
`parents[b, i]` is the index of node i's parent (-1 for a root or a padding
node), parents always come before their children, and `valid[b, i]` is False
for padding nodes.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "ancestor_matrix",
    "tree_attention_mask",
    "compact_kv_",
    "sage_confidence",
    "greedy_accept",
    "quantize_int8",
    "visual_scores",
    "visual_vote",
]


def ancestor_matrix(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor-or-self relation and depth of every node.

    Args:
        parents (`torch.LongTensor` of shape `(B, N)`): parent index, -1 for roots.

    Returns:
        `(ancestors, depths)`: `ancestors[b, i, j]` is True iff j is i or an
        ancestor of i, shape `(B, N, N)`; `depths[b, i]` counts the ancestors
        of i (a root has depth 0), shape `(B, N)`.
    """
    batch, num_nodes = parents.shape
    eye = torch.eye(num_nodes, dtype=torch.bool, device=parents.device).expand(batch, -1, -1)
    has_parent = parents >= 0
    # one step up: reach[b, i, parent(i)] = True
    step = torch.zeros(batch, num_nodes, num_nodes + 1, dtype=torch.bool, device=parents.device)
    step.scatter_(2, torch.where(has_parent, parents, num_nodes).unsqueeze(-1), True)
    reach = eye | step[..., :num_nodes]
    # pointer doubling: after t squarings reach covers paths of length 2^t
    hops = 1
    while hops < num_nodes:
        reach_f = reach.to(torch.float32)
        reach = torch.bmm(reach_f, reach_f) > 0
        hops *= 2
    depths = reach.sum(-1) - 1
    return reach, depths


def tree_attention_mask(
    parents: torch.Tensor,
    valid: torch.Tensor,
    slot_valid: torch.Tensor,
    dtype: torch.dtype,
    num_query: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive 4D attention mask for a tree block behind a KV cache, and node depths.

    The key axis is `[committed cache slots (S) | tree nodes (N)]`. A node sees
    every valid committed slot and its own ancestors (itself included); a
    padding node sees the slots and itself, so no softmax row is empty.

    Args:
        parents (`torch.LongTensor` of shape `(B, N)`): parent index per node, -1 for roots.
        valid (`torch.BoolTensor` of shape `(B, N)`): False for padding nodes.
        slot_valid (`torch.BoolTensor` of shape `(B, S)`): False for padding / holes in the cache.
        dtype (`torch.dtype`): the model's dtype; allowed = 0, blocked = `finfo(dtype).min`.
        num_query (`int`, *optional*): only the last `num_query` nodes are queries (default all N).

    Returns:
        `(mask, depths)`: mask of shape `(B, 1, num_query, S + N)` and depths `(B, N)`.
    """
    batch, num_nodes = parents.shape
    num_query = num_nodes if num_query is None else num_query
    ancestors, depths = ancestor_matrix(parents)
    node_visible = ancestors & valid.unsqueeze(1) & valid.unsqueeze(2)  # (B, N, N): real nodes only
    node_visible |= torch.eye(num_nodes, dtype=torch.bool, device=parents.device)
    node_visible = node_visible[:, num_nodes - num_query :, :]  # (B, M, N)
    slot_visible = slot_valid.unsqueeze(1).expand(batch, num_query, -1)  # (B, M, S)
    allowed = torch.cat([slot_visible, node_visible], dim=-1)  # (B, M, S + N)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=parents.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(1), depths


def compact_kv_(tensors: list[torch.Tensor], keep_index: torch.Tensor, start: int) -> list[torch.Tensor]:
    """Gather each row's kept tail slots into place, in place, and drop the rest.

    Args:
        tensors (list of `torch.Tensor` of shape `(B, H, L, D)`): keys and values of every layer.
        keep_index (`torch.LongTensor` of shape `(B, K)`): tail slots (relative to `start`) to keep, in order.
        start (`int`): first slot of the tail; slots before it are untouched.

    Returns:
        The same tensors cut to length `start + K` (views of the input storage).
    """
    kept = keep_index.shape[1]
    out = []
    for tensor in tensors:
        batch, heads, _, dim = tensor.shape
        index = keep_index[:, None, :, None].expand(batch, heads, kept, dim)  # (B, H, K, D)
        selected = tensor[:, :, start:].gather(2, index)
        tensor[:, :, start : start + kept].copy_(selected)
        out.append(tensor[:, :, : start + kept])
    return out


def sage_confidence(logits: torch.Tensor, top_k: int = 10) -> torch.Tensor:
    """SAGE confidence alpha = 1 - H(top-k renormalised) / log k (docs/algorithms.md section 1, Eq. 7-9).

    Args:
        logits (`torch.FloatTensor` of shape `(B, V)`): processed drafter logits.
        top_k (`int`): k of Eq. 7.

    Returns:
        `torch.FloatTensor` of shape `(B,)` in [0, 1]; 1 means fully confident.
    """
    top_k = min(top_k, logits.shape[-1])
    if top_k <= 1:
        return torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
    top_logits = logits.float().topk(top_k, dim=-1).values  # (B, k)
    # Eq. 7: P_i / sum_topk P_j == softmax over the top-k logits
    top_probs = torch.softmax(top_logits, dim=-1)
    entropy = -(top_probs * torch.log(top_probs.clamp_min(1e-30))).sum(-1)  # Eq. 8
    return (1.0 - entropy / math.log(top_k)).clamp(0.0, 1.0)  # Eq. 9


def greedy_accept(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    target_choice: torch.Tensor,
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Longest root-to-node path whose every token equals the target's choice at its parent.

    Node 0 of each row is the root (the last committed token). Siblings are
    expected to carry distinct tokens, so the accepted path is unique; among
    equally deep accepted nodes the lowest index wins.

    Args:
        tokens (`torch.LongTensor` of shape `(B, N)`): node tokens.
        parents (`torch.LongTensor` of shape `(B, N)`): parent index, -1 for the root.
        valid (`torch.BoolTensor` of shape `(B, N)`): False for padding nodes.
        target_choice (`torch.LongTensor` of shape `(B, N)`): the target's token after each node.
        max_depth (`int`): the deepest node depth in the batch.

    Returns:
        `(path_index, accept_length, bonus)`: `path_index` `(B, max_depth + 1)`
        holds the accepted nodes root first (entries past `accept_length` repeat
        the last accepted node); `accept_length` `(B,)` counts accepted draft
        tokens (root excluded); `bonus` `(B,)` is the target's token after the
        last accepted node.
    """
    batch, num_nodes = tokens.shape
    ancestors, depths = ancestor_matrix(parents)
    parent_choice = target_choice.gather(1, parents.clamp_min(0))  # (B, N)
    correct = valid & (tokens == parent_choice)
    correct[:, 0] = True  # the root is already committed
    # a node is reachable iff every ancestor-or-self is correct
    reachable = ~(ancestors & ~correct.unsqueeze(1)).any(-1)  # (B, N)
    node_index = torch.arange(num_nodes, device=tokens.device)
    score = torch.where(reachable, depths * num_nodes + (num_nodes - 1 - node_index), -1)
    best = score.argmax(-1)  # (B,)
    accept_length = depths.gather(1, best[:, None]).squeeze(1)
    best_ancestors = ancestors.gather(1, best[:, None, None].expand(batch, 1, num_nodes)).squeeze(1)  # (B, N)
    levels = torch.arange(max_depth + 1, device=tokens.device)
    on_level = best_ancestors.unsqueeze(1) & (depths.unsqueeze(1) == levels[None, :, None])  # (B, D+1, N)
    path_index = torch.where(on_level.any(-1), on_level.to(torch.int8).argmax(-1), best[:, None])
    bonus = target_choice.gather(1, best[:, None]).squeeze(1)
    return path_index, accept_length, bonus


def quantize_int8(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization with one scale per token per head: s = max|K| / 127.

    Args:
        keys (`torch.Tensor` of shape `(B, H, T, D)`).

    Returns:
        `(quantized, scale)`: int8 `(B, H, T, D)` and float32 `(B, H, T, 1)`;
        `quantized * scale` is within `scale / 2` of `keys` elementwise.
    """
    keys = keys.float()
    amax = keys.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    # IEEE division on every device: on CUDA, `tensor / python_number` multiplies by the rounded reciprocal,
    # which differs in the last bit for some values (seen on an H200); a tensor divisor divides exactly
    scale = amax / torch.full_like(amax, 127.0)
    quantized = torch.round(keys / scale).clamp(-127, 127).to(torch.int8)
    return quantized, scale


def visual_scores(query: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Head-averaged attention of one query over int8 visual keys: A(j) = mean_h softmax_j(q . K^_j / sqrt(d)).

    Args:
        query (`torch.Tensor` of shape `(B, H, D)`): post-RoPE query of the last accepted position.
        quantized (`torch.CharTensor` of shape `(B, H_kv, T, D)`), scale (`(B, H_kv, T, 1)`): int8 keys.
            Grouped-query heads are repeated to H.

    Returns:
        `torch.FloatTensor` of shape `(B, T)` summing to 1 per row.
    """
    batch, heads, dim = query.shape
    kv_heads = quantized.shape[1]
    keys = quantized.float() * scale  # (B, H_kv, T, D)
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # (B, H, T, D)
    logits = torch.einsum("bhd,bhtd->bht", query.float(), keys) / math.sqrt(dim)
    return torch.softmax(logits, dim=-1).mean(1)


def visual_vote(scores: torch.Tensor, per_layer: int, keep: int) -> torch.Tensor:
    """Cross-layer vote: each layer votes for its top `per_layer` tokens; keep the `keep` most voted.

    Ties in votes go to the larger summed score.

    Args:
        scores (`torch.FloatTensor` of shape `(L, B, T)`): per-layer visual scores.
        per_layer (`int`): votes cast by each layer (m).
        keep (`int`): tokens kept (M).

    Returns:
        `torch.LongTensor` of shape `(B, min(keep, T))`, sorted by rank.
    """
    num_layers, batch, num_tokens = scores.shape
    per_layer = min(per_layer, num_tokens)
    keep = min(keep, num_tokens)
    top = scores.topk(per_layer, dim=-1).indices  # (L, B, m)
    ballots = top.permute(1, 0, 2).reshape(batch, -1)  # (B, L * m)
    votes = torch.zeros(batch, num_tokens, dtype=torch.float32, device=scores.device)
    votes.scatter_add_(1, ballots, torch.ones_like(ballots, dtype=torch.float32))
    total = scores.float().sum(0)  # (B, T)
    # votes are integers; the summed score (< num_layers) breaks ties without crossing a vote
    rank_key = votes * (num_layers + 1.0) + total / (total.amax(-1, keepdim=True) + 1e-12)
    return rank_key.topk(keep, dim=-1).indices
