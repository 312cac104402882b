"""sdpa for tree verification forwards of grouped-query-attention models, without `repeat_kv`.

A verification forward has several query tokens and an explicit 4D mask. For such calls transformers' sdpa
path (`sdpa_attention_forward`) copies every key/value head `num_key_value_groups` times (`repeat_kv`): for
SmolLM2-135M at 400 cached tokens that is ~110 MB written per forward, while a one-token decoding step
folds the query heads onto their key/value head instead (`pack_gqa`) and copies nothing. The same fold works
for Q > 1 tokens: the n_rep query heads of one key/value head become n_rep * Q query rows of that head and
the head-shared mask is repeated along those rows. It computes the same dot products and softmaxes as the
stock path (outputs measured bitwise equal on SmolLM2) and saves 4-5 ms per verification forward there.

`TREE_SDPA` is registered with transformers' `AttentionInterface` (and sdpa's mask function, which the model
needs to build the mask for a registered implementation); `tree_attention(model)` switches a model's text
attention from "sdpa" to it inside a `with` block. Every call it cannot fold (one token, no or per-head mask,
no grouped heads, dropout, softcap, sinks, position bias, and for now any device but the CPU, the only one
it has been measured on) is handed to transformers' own sdpa function.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = ["TREE_SDPA", "tree_sdpa_attention", "register_tree_attention", "tree_attention"]

TREE_SDPA = "hf_adaptive_spec_tree_sdpa"
# arguments that change what sdpa_attention_forward computes: calls with any of them set go to it unchanged
_SPECIAL_KWARGS = ("softcap", "s_aux", "sinks", "position_bias", "head_mask", "alibi")


def _foldable(module, query, key, value, attention_mask, dropout, kwargs) -> int:
    """n_rep when the call can run with query heads folded onto their key/value head, else 0."""
    n_rep = getattr(module, "num_key_value_groups", 1)
    if query.device.type != "cpu":  # measured on CPUs only so far
        return 0
    if not isinstance(n_rep, int) or n_rep <= 1 or query.shape[2] <= 1 or dropout:
        return 0
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        return 0
    if key.shape[1] * n_rep != query.shape[1] or value.shape[1] != key.shape[1]:
        return 0
    if kwargs.get("output_attentions") or any(kwargs.get(name) is not None for name in _SPECIAL_KWARGS):
        return 0
    return n_rep


_FOLDED = [None]  # (mask, its version, arguments, folded mask): every layer of one forward folds the same mask


def _folded_mask(attention_mask, batch: int, n_rep: int, q_len: int, kv_len: int) -> torch.Tensor:
    """The head-shared mask repeated for the n_rep folded query heads `(B, 1, n_rep * Q, K)`, made once per
    mask (the same tensor, unmodified: identity and version are checked) and shared by the layers."""
    arguments = (batch, n_rep, q_len, kv_len)
    cached = _FOLDED[0]
    if cached is not None and cached[0] is attention_mask and cached[1] == attention_mask._version \
            and cached[2] == arguments:
        return cached[3]
    mask = attention_mask[..., :kv_len].expand(batch, 1, q_len, kv_len)
    mask = mask.unsqueeze(2).expand(batch, 1, n_rep, q_len, kv_len).reshape(batch, 1, n_rep * q_len, kv_len)
    _FOLDED[0] = (attention_mask, attention_mask._version, arguments, mask)
    return mask


def tree_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention function (transformers' signature): `(attn_output (B, Q, H, D), None)`."""
    n_rep = _foldable(module, query, key, value, attention_mask, dropout, kwargs)
    if not n_rep:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, **kwargs)
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    folded = query.reshape(batch, kv_heads, n_rep * q_len, head_dim)  # head h -> kv head h // n_rep, as repeat_kv
    mask = _folded_mask(attention_mask, batch, n_rep, q_len, kv_len)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, q_len, head_dim).transpose(1, 2).contiguous(), None


def register_tree_attention() -> str:
    """Register `TREE_SDPA` (attention and its sdpa mask); idempotent."""
    AttentionInterface.register(TREE_SDPA, tree_sdpa_attention)
    AttentionMaskInterface.register(TREE_SDPA, sdpa_mask)
    return TREE_SDPA


def tree_attention(model):
    """A context in which `model`'s text attention runs `TREE_SDPA`, when it runs "sdpa" now (else no-op)."""
    from .vision import text_attention_implementation

    if model is None or not getattr(model, "_supports_attention_backend", False):
        return contextlib.nullcontext()
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if config is not None else None
    if getattr(text_config, "_attn_implementation", None) != "sdpa":
        return contextlib.nullcontext()
    register_tree_attention()
    return _releasing_folded_mask(text_attention_implementation(model, TREE_SDPA))


@contextlib.contextmanager
def _releasing_folded_mask(context):
    """`context`, then drop the folded mask kept for the layers of the last forward (no tensor outlives it)."""
    try:
        with context:
            yield
    finally:
        _FOLDED[0] = None
