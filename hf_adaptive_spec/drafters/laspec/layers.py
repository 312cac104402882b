"""The LaSpec drafter's layers: RMSNorm, plain 1D RoPE, block self-attention over `[context ; block]`, the gated
visual cross-attention, the SwiGLU MLP, and the decoder layer that chains them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .configuration import LaSpecDrafterConfig

__all__ = ["LaSpecDecoderLayer", "LaSpecMLP", "LaSpecRMSNorm", "LaSpecSelfAttention", "LaSpecVisualCrossAttention",
           "apply_rope", "rope_cos_sin"]


class LaSpecRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden.to(dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin of shape (B, 1, L, head_dim) for plain 1D RoPE (computed on the fly, no buffer)."""
    exponent = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)  # (D/2,)
    freqs = position_ids.float()[..., None] * inv_freq  # (B, L, D/2)
    angles = torch.cat([freqs, freqs], dim=-1)  # (B, L, D)
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, L, D) rotated by its positions: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LaSpecSelfAttention(nn.Module):
    """Block queries over keys/values `[fused context ; block]`; k/v projections shared by both."""

    def __init__(self, config: LaSpecDrafterConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, num_heads, self.head_dim).transpose(1, 2)  # (B, h, L, D)

    def context_kv(self, context, context_rope):
        """The context's keys (post-RoPE) and values, `(B, H_kv, C, D)` each."""
        keys = apply_rope(self._heads(self.k_proj(context), self.num_kv_heads), *context_rope)
        return keys, self._heads(self.v_proj(context), self.num_kv_heads)

    def forward(self, hidden, context, block_rope, context_rope, allowed):
        # hidden (B, L, hid), context (B, C, hid) or its precomputed (keys, values); allowed (B, 1, L, C + L) bool
        batch, length, _ = hidden.shape
        query = apply_rope(self._heads(self.q_proj(hidden), self.num_heads), *block_rope)  # (B, H, L, D)
        context_keys, context_values = context if isinstance(context, tuple) else self.context_kv(context, context_rope)
        keys = torch.cat([context_keys, apply_rope(self._heads(self.k_proj(hidden), self.num_kv_heads), *block_rope)],
                         dim=2)  # (B, H_kv, C + L, D)
        values = torch.cat([context_values, self._heads(self.v_proj(hidden), self.num_kv_heads)], dim=2)
        groups = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(groups, dim=1)  # (B, H, C + L, D)
        values = values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed)  # (B, H, L, D)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class LaSpecVisualCrossAttention(nn.Module):
    """Block queries over the M selected visual embeddings (no RoPE: visual tokens are a set)."""

    def __init__(self, config: LaSpecDrafterConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        inner = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(config.vision_hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(config.vision_hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=False)

    def forward(self, hidden, visual, visual_mask):
        # hidden (B, L, hid), visual (B, M, vis), visual_mask (B, M) bool; or one visual set per block:
        # visual (B, nb, M, vis), visual_mask (B, nb, M), the L queries split into nb consecutive blocks
        if visual.dim() == 4:
            rows, blocks = visual.shape[:2]
            per_block = hidden.reshape(rows * blocks, hidden.shape[1] // blocks, hidden.shape[2])
            out = self.forward(per_block, visual.flatten(0, 1), visual_mask.flatten(0, 1))
            return out.reshape(rows, hidden.shape[1], -1)
        batch, length, _ = hidden.shape
        num_visual = visual.shape[1]
        query = self.q_proj(hidden).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, D)
        # (B, H, M, D)
        keys = self.k_proj(visual).view(batch, num_visual, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.v_proj(visual).view(batch, num_visual, self.num_heads, self.head_dim).transpose(1, 2)
        any_visual = visual_mask.any(-1)  # (B,)
        # a row without visual tokens attends to slot 0 and is zeroed below (no NaN from an empty softmax)
        allowed = visual_mask.clone()
        allowed[:, 0] |= ~any_visual
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed[:, None, None, :])  # (B, H, L, D)
        out = out * any_visual[:, None, None, None].to(out.dtype)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class LaSpecMLP(nn.Module):
    def __init__(self, config: LaSpecDrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden):
        return self.down_proj(F.silu(self.gate_proj(hidden)) * self.up_proj(hidden))


class LaSpecDecoderLayer(nn.Module):
    """Self-attention over [context ; block], gated visual cross-attention, SwiGLU MLP (pre-norm residuals)."""

    def __init__(self, config: LaSpecDrafterConfig):
        super().__init__()
        self.input_layernorm = LaSpecRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LaSpecSelfAttention(config)
        # num_visual_tokens == 0: a text-only drafter, built without the visual branch
        self.visual_layernorm = self.visual_attn = self.visual_gate = None
        if config.num_visual_tokens > 0:
            self.visual_layernorm = LaSpecRMSNorm(config.hidden_size, config.rms_norm_eps)
            self.visual_attn = LaSpecVisualCrossAttention(config)
            # tanh(0) = 0: the cross-attention branch contributes exactly nothing until trained
            self.visual_gate = nn.Parameter(torch.zeros(1))
        self.post_attention_layernorm = LaSpecRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LaSpecMLP(config)

    def forward(self, hidden, context, block_rope, context_rope, allowed, visual=None, visual_mask=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, block_rope, context_rope, allowed)
        if visual is not None:
            cross = self.visual_attn(self.visual_layernorm(hidden), visual, visual_mask)
            hidden = hidden + torch.tanh(self.visual_gate).to(cross.dtype) * cross
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
