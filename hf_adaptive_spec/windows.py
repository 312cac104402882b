"""Sliding-window and chunked attention layers, carried by the tree mask.

A sliding window or an attention chunk is only a mask: a layer of window w lets a query at text position q see
the keys at positions k with q - k < w (transformers' `sliding_window_overlay`), a layer of chunk size c the
keys with k // c == q // c (`chunked_overlay`, positions counted from the first real token). Tree verification
keeps every slot of every layer in the cache (`full_layer_cache`: a sliding layer's cache would drop slots by
count, which holes left by rejected rows make wrong) and intersects the tree mask with each layer type's
window, by the text positions of the cache slots and of the tree nodes.

`AttentionLayout` reads the layer types the way transformers builds a model's cache
(`get_layer_types_and_kwargs` on the decoder config), so an architecture nobody listed is judged by what its
config says its layers are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

__all__ = ["AttentionLayout", "attention_layout", "full_layer_cache", "WINDOWED_LAYER_TYPES"]

# layer type -> how it restricts attention beyond the causal / tree mask
WINDOWED_LAYER_TYPES = {"sliding_attention": "sliding", "chunked_attention": "chunked"}
ATTENTION_LAYER_TYPES = ("full_attention", *WINDOWED_LAYER_TYPES)


def _decoder_config(model):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def layer_types(model) -> list[str]:
    """Each decoder layer's type, as transformers decides it when it builds the model's `DynamicCache`."""
    return list(get_layer_types_and_kwargs(_decoder_config(model))[0])


@dataclass(frozen=True)
class AttentionLayout:
    """The windows of one model's windowed layer types.

    Fields:
        windows: `((layer type, kind, size), ...)` for each windowed layer type the model has; kind is
            "sliding" (size = window) or "chunked" (size = chunk length).
        has_full: whether some layers attend to everything (plain tree mask).
        per_type: the model reads one mask per layer type (a dict keyed by `config.layer_types` names);
            otherwise every layer gets the same mask.
    """

    windows: tuple
    has_full: bool
    per_type: bool

    def span(self) -> int:
        """The smallest window or chunk: no restriction applies while every position is below it."""
        return min(size for _, _, size in self.windows)

    def restrict(self, mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor):
        """The mask each layer needs: a tensor, or a dict by layer type when the types differ.

        Args:
            mask (`torch.Tensor` of shape `(B, 1, Q, K)`): additive tree mask (0 allowed, dtype min blocked).
            query_positions (`torch.LongTensor` of shape `(B, Q)`): text position of each query.
            key_positions (`torch.LongTensor` of shape `(B, K)`): text position of each key slot (any value
                for slots the tree mask already blocks).
        """
        if int(query_positions.max()) < self.span():  # nothing reaches a window edge yet
            return mask
        blocked = torch.finfo(mask.dtype).min
        masks = {}
        for layer_type, kind, size in self.windows:
            distance = query_positions[:, :, None] - key_positions[:, None, :]  # (B, Q, K)
            if kind == "sliding":
                inside = distance < size
            else:
                inside = torch.div(query_positions[:, :, None], size, rounding_mode="floor") == torch.div(
                    key_positions[:, None, :].clamp_min(0), size, rounding_mode="floor")
            masks[layer_type] = mask.masked_fill(~inside[:, None], blocked)
        if not self.per_type:
            (only,) = masks.values()
            return only
        if self.has_full:
            masks["full_attention"] = mask
        return masks


def attention_layout(model) -> AttentionLayout | None:
    """The model's windowed layers, or None when every layer is full attention.

    Raises `ValueError` for a layer type that is neither full, sliding nor chunked attention (recurrent,
    linear-attention, convolutional or shared-KV layers), naming it.
    """
    config = _decoder_config(model)
    types, kwargs = get_layer_types_and_kwargs(config)
    other = sorted({t for t in types if t not in ATTENTION_LAYER_TYPES})
    if other:
        raise ValueError(
            f"{type(model).__name__} has decoder layers of type {other}: spec_strategy verifies trees through "
            "attention masks and supports full, sliding-window and chunked attention layers only (recurrent, "
            "linear-attention, convolutional and shared-KV layers keep state a mask cannot rewind)."
        )
    windows = {}
    for layer_type, layer_kwargs in zip(types, kwargs):
        if layer_type in WINDOWED_LAYER_TYPES:
            size = layer_kwargs.get("sliding_window")
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{type(model).__name__}: a {layer_type} layer has no usable window size ({size!r}).")
            if windows.setdefault(layer_type, size) != size:
                raise ValueError(f"{type(model).__name__}: {layer_type} layers of different window sizes are not "
                                 "supported (one mask per layer type).")
    if not windows:
        return None
    has_full = "full_attention" in types
    per_type = has_full or len(windows) > 1
    if per_type and getattr(config, "layer_types", None) is None:
        raise ValueError(f"{type(model).__name__} mixes attention layer types without config.layer_types naming "
                         "them: spec_strategy cannot address one mask per layer type.")
    return AttentionLayout(tuple((t, WINDOWED_LAYER_TYPES[t], s) for t, s in windows.items()), has_full, per_type)


def full_layer_cache(cache) -> None:
    """Swap every (still empty) sliding-window layer of `cache` for a `DynamicLayer` that keeps all slots.

    The window is then applied by the mask (`AttentionLayout.restrict`); the prefill's own mask functions
    size the window the same way over a full layer.
    """
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:
            if layer.is_initialized:
                raise ValueError("spec_strategy cannot continue from a non-empty cache (past_key_values).")
            cache.layers[index] = DynamicLayer()
