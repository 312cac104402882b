"""The acceptance-aware training loss of LaSpec drafters (Uni-LaSpec, docs/algorithms.md section 2,
"Acceptance-aware training"): each block position's cross-entropy weighted by the chance that drafting
reaches it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["accept_probs_from", "acceptance_aware_loss", "acceptance_weighted_mean", "acceptance_weights"]


def acceptance_weights(accept_probs: torch.Tensor) -> torch.Tensor:
    """Chance that draft position k is reached at all: w_k = stopgrad(prod_{j<k} a_j), w_1 = 1.

    Args:
        accept_probs (`torch.FloatTensor` of shape `(B, K)`): a_k, the probability the target accepts position k.

    Returns:
        `torch.FloatTensor` of shape `(B, K)`, detached from the graph.

    Examples:
        >>> acceptance_weights(torch.tensor([[0.5, 0.8, 0.9]]))
        tensor([[1.0000, 0.5000, 0.4000]])
    """
    accept_probs = accept_probs.detach()
    shifted = torch.cat([torch.ones_like(accept_probs[:, :1]), accept_probs[:, :-1]], dim=1)  # (B, K): a_0 = 1
    return shifted.cumprod(dim=1)


def acceptance_aware_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    accept_probs: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Acceptance-weighted cross-entropy L = sum_k w_k CE_k / sum_k w_k (docs/algorithms.md section 2).

    The sums run over the batch and the block together, so a row whose draft survives longer contributes
    more positions. Labels equal to -100 are ignored like a False `mask`.

    Args:
        logits (`torch.FloatTensor` of shape `(B, K, V)`): drafter logits.
        labels (`torch.LongTensor` of shape `(B, K)`): target tokens (-100 = ignore).
        accept_probs (`torch.FloatTensor` of shape `(B, K)`): a_k ([`accept_probs_from`]); no gradient flows
            through them.
        mask (`torch.BoolTensor` of shape `(B, K)`, *optional*): False for positions to ignore.

    Returns:
        Scalar `torch.FloatTensor`.
    """
    keep = labels != -100
    if mask is not None:
        keep = keep & mask.bool()
    cross_entropy = F.cross_entropy(
        logits.float().transpose(1, 2), labels.masked_fill(~keep, 0), reduction="none"
    )  # (B, K)
    return acceptance_weighted_mean(cross_entropy, accept_probs, keep)


def acceptance_weighted_mean(cross_entropy: torch.Tensor, accept_probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """sum_k w_k CE_k / sum_k w_k over the kept `(B, K)` positions, w from [`acceptance_weights`]: the
    acceptance-aware loss from per-position cross-entropies (a trainer that computes them only where there
    is a label scatters them into `(B, K)` first)."""
    weights = acceptance_weights(accept_probs).float() * keep
    return (weights * cross_entropy).sum() / weights.sum().clamp_min(1e-12)


def accept_probs_from(draft_logits: torch.Tensor, target: torch.Tensor, greedy: bool) -> torch.Tensor:
    """Per-position acceptance probability a_k of the drafter's distribution q against the target.

    Greedy: a_k = q_k(t_k), the drafter's probability of the target's greedy token t_k (the chance an argmax /
    sampled draft matches it). Sampling: a_k = sum_v min(p_k(v), q_k(v)) (Leviathan et al. 2023).

    Args:
        draft_logits (`torch.FloatTensor` of shape `(B, K, V)`): drafter logits (processed, if the loop processes).
        target (`torch.Tensor`): greedy: the target's tokens `(B, K)` (-100 = ignore, gives a_k = 0) or its
            probabilities `(B, K, V)` (argmax taken); sampling: the target's probabilities `(B, K, V)`.
        greedy (`bool`): which rule.

    Returns:
        `torch.FloatTensor` of shape `(B, K)` in [0, 1] (differentiable w.r.t. `draft_logits`).
    """
    draft_probs = torch.softmax(draft_logits.float(), dim=-1)  # (B, K, V): q
    if greedy:
        tokens = target.argmax(-1) if target.dim() == 3 else target  # (B, K)
        valid = tokens != -100
        probs = draft_probs.gather(-1, tokens.clamp_min(0)[..., None]).squeeze(-1)  # (B, K)
        return probs * valid
    if target.dim() != 3 or target.shape != draft_logits.shape:
        raise ValueError(
            f"Sampling acceptance needs target probabilities of shape {tuple(draft_logits.shape)}; "
            f"got {tuple(target.shape)}."
        )
    return torch.minimum(target.float(), draft_probs).sum(-1)
