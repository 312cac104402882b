"""Sliding-window and chunked attention layers, carried by the tree mask.

A sliding window or an attention chunk is only a mask: a layer of window w lets a query at text position q see
the keys at positions k with q - k < w (transformers' `sliding_window_overlay`), a layer of chunk size c the
keys with k // c == q // c (`chunked_overlay`, positions counted from the first real token). Tree verification
intersects the tree mask with each layer type's window, by the text positions of the cache slots and of the
tree nodes.

The cache of a windowed layer holds what plain `generate` holds (transformers' `DynamicSlidingWindowLayer`
keeps the last `size - 1` slots, for sliding and chunked layers alike) plus the slots of the round in flight:
the prefill runs on plain's own sliding layers, then `WindowedSlots` keeps, per windowed layer type, each
row's own slot layout (valid slots and their text positions), appends each round's accepted slots and
compacts the layers (per row: holes left by rejected rows are dropped) once they hold more than
`size - 1 + slack` slots. `to_plain_layers` lays them out at the end as plain generate's layers.

`AttentionLayout` reads the layer types the way transformers builds a model's cache
(`get_layer_types_and_kwargs` on the decoder config), so an architecture nobody listed is judged by what its
config says its layers are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from .model_config import text_config

__all__ = ["AttentionLayout", "WindowedSlots", "attention_layout", "windowed_slots", "WINDOWED_LAYER_TYPES"]

# layer type -> how it restricts attention beyond the causal / tree mask
WINDOWED_LAYER_TYPES = {"sliding_attention": "sliding", "chunked_attention": "chunked"}
ATTENTION_LAYER_TYPES = ("full_attention", *WINDOWED_LAYER_TYPES)


def layer_types(model) -> list[str]:
    """Each decoder layer's type, as transformers decides it when it builds the model's `DynamicCache`."""
    return list(get_layer_types_and_kwargs(text_config(model, decoder=True))[0])


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

    def restrict(self, mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                 layer_type: str) -> torch.Tensor:
        """The mask of `layer_type`'s layers: `mask` with the keys outside each query's window blocked.

        Args:
            mask (`torch.Tensor` of shape `(B, 1, Q, K)`): additive tree mask (0 allowed, dtype min blocked) over
                that layer type's cache slots and the block.
            query_positions (`torch.LongTensor` of shape `(B, Q)`): text position of each query.
            key_positions (`torch.LongTensor` of shape `(B, K)`): text position of each key slot (any value for
                slots the tree mask already blocks).
            layer_type (`str`): one of the layout's windowed layer types.
        """
        if int(query_positions.max()) < self.span():  # nothing reaches a window edge yet
            return mask
        (kind, size), = [(k, s) for t, k, s in self.windows if t == layer_type]
        if kind == "sliding":
            inside = query_positions[:, :, None] - key_positions[:, None, :] < size  # (B, Q, K)
        else:
            inside = torch.div(query_positions[:, :, None], size, rounding_mode="floor") == torch.div(
                key_positions[:, None, :].clamp_min(0), size, rounding_mode="floor")
        return mask.masked_fill(~inside[:, None], torch.finfo(mask.dtype).min)


def attention_layout(model) -> AttentionLayout | None:
    """The model's windowed layers, or None when every layer is full attention.

    Raises `ValueError` for a layer type that is neither full, sliding nor chunked attention (recurrent,
    linear-attention, convolutional or shared-KV layers), naming it.
    """
    config = text_config(model, decoder=True)
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


class WindowedSlots:
    """The cache slots of the layers of one windowed layer type: each row's valid slots and their text positions.

    Args:
        layer_type (`str`): "sliding_attention" or "chunked_attention".
        kind (`str`): "sliding" or "chunked".
        size (`int`): the window (or chunk) length; plain generate's layers keep `size - 1` slots.
        layers (`list[int]`): indices of the cache layers of this type.
        valid (`torch.BoolTensor` of shape `(B, S_w)`): real slots of those layers.
        positions (`torch.LongTensor` of shape `(B, S_w)`): text position of each slot (any value where invalid).
    """

    def __init__(self, layer_type: str, kind: str, size: int, layers: list, valid: torch.Tensor,
                 positions: torch.Tensor):
        self.layer_type, self.kind, self.size, self.layers = layer_type, kind, size, layers
        self.valid, self.positions = valid, positions

    @property
    def keep(self) -> int:
        """Slots plain generate keeps: the last `size - 1`."""
        return self.size - 1

    @property
    def slack(self) -> int:
        """Slots beyond `keep` the layers may hold before they are compacted (a compaction copies the window)."""
        return self.size // 16

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def append(self, keep_valid: torch.Tensor, first_position: torch.Tensor) -> None:
        """Committed slots `(B, K)` join the layout: a row's valid ones at text positions `first_position`,
        `first_position + 1`, ... in order (invalid ones may come anywhere: a drafter's pending tokens are
        right-aligned)."""
        positions = first_position[:, None] + keep_valid.long().cumsum(-1) - 1
        self.valid = torch.cat([self.valid, keep_valid], dim=1)
        self.positions = torch.cat([self.positions, positions], dim=1)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.valid, self.positions = self.valid[rows], self.positions[rows]

    def needed(self, next_position: torch.Tensor) -> torch.Tensor:
        """`(B, S_w)` True at the slots a query at `next_position` or later can still see (and plain keeps)."""
        return self.valid & (self.positions > (next_position - self.size)[:, None])

    def compact_index(self, next_position: torch.Tensor, force: bool = False):
        """`(index (B, n), valid (B, n))`: each row's slots still needed, in order, holes and slots out of the
        window dropped; None when the layers hold at most `keep + slack` slots (unless `force`)."""
        if not force and self.length <= self.keep + self.slack:
            return None
        needed = self.needed(next_position)
        counts = needed.sum(-1)
        width = int(counts.max()) if needed.shape[0] else 0
        order = torch.argsort((~needed).to(torch.int8), dim=1, stable=True)[:, :width]
        valid = torch.arange(width, device=needed.device)[None, :] < counts[:, None]
        return order, valid

    def compacted(self, index: torch.Tensor, valid: torch.Tensor) -> None:
        """The layout after the layers were gathered at `index` (`compact_index`)."""
        self.positions = self.positions.gather(1, index)
        self.valid = valid

    def plain_index(self, plain_positions: torch.Tensor) -> torch.Tensor:
        """`(B, n)` slot holding each text position of `plain_positions` `(B, n)`, -1 where none does (a row's valid
        slots hold increasing positions: a binary search per position)."""
        if self.length == 0:
            return torch.full_like(plain_positions, -1)
        lowest = torch.iinfo(torch.long).min
        ordered = torch.where(self.valid, self.positions, lowest).cummax(-1).values  # invalid: the previous valid
        index = torch.searchsorted(ordered, plain_positions).clamp_max(self.length - 1)
        found = self.valid.gather(1, index) & (self.positions.gather(1, index) == plain_positions)
        return torch.where(found, index, -1)


def windowed_slots(model, cache, slot_valid: torch.Tensor) -> list[WindowedSlots]:
    """The windowed layer types of `model`'s cache right after a plain prefill of `slot_valid` `(B, S)`.

    The prefill ran on plain generate's layers: a `DynamicSlidingWindowLayer` then holds the last `size - 1`
    slots of the prompt (all of them for a shorter prompt). Each such layer becomes a `DynamicLayer` holding the
    same tensors, so that rounds append to it like to any other layer (and compaction is this module's work).
    """
    types = layer_types(model)
    layout = attention_layout(model)
    if layout is None:
        return []
    sizes = {layer_type: size for layer_type, _, size in layout.windows}
    kinds = {layer_type: kind for layer_type, kind, _ in layout.windows}
    positions = slot_valid.long().cumsum(-1) - 1
    groups = []
    for layer_type in sizes:
        indices = [i for i, t in enumerate(types) if t == layer_type and i < len(cache.layers)]
        if not indices:
            continue
        length = None
        for index in indices:
            layer = cache.layers[index]
            if isinstance(layer, DynamicSlidingWindowLayer):
                replacement = DynamicLayer()
                replacement.lazy_initialization(layer.keys, layer.values)
                replacement.keys, replacement.values = layer.keys, layer.values
                cache.layers[index] = replacement
            cached = cache.layers[index].keys.shape[2]
            if length is not None and cached != length:
                raise ValueError(f"{layer_type} layers hold caches of different lengths ({length}, {cached}).")
            length = cached
        groups.append(WindowedSlots(layer_type, kinds[layer_type], sizes[layer_type], indices,
                                    slot_valid[:, slot_valid.shape[1] - length:],
                                    positions[:, positions.shape[1] - length:]))
    return groups


def to_plain_layers(cache, groups: list[WindowedSlots], width: int, slot_text: torch.Tensor) -> None:
    """Lay the windowed layers of `cache` out as plain generate's: a `DynamicSlidingWindowLayer` holding the last
    `min(size - 1, width)` slots of a `width`-slot plain cache, of which slot j holds text position
    `slot_text[:, j]` `(B, width)` (negative: left padding; a position a row never reached: zeros).
    """
    for group in groups:
        count = min(group.keep, width)
        wanted = slot_text[:, width - count:].contiguous()
        index = group.plain_index(wanted)
        found = (index >= 0)[:, None, :, None]
        gather = index.clamp_min(0)[:, None, :, None]
        for layer_index in group.layers:
            layer = cache.layers[layer_index]
            plain = DynamicSlidingWindowLayer(sliding_window=group.size)
            keys, values = (torch.where(found.to(t.device), t.gather(2, gather.to(t.device).expand(
                -1, t.shape[1], -1, t.shape[3])), 0) for t in (layer.keys, layer.values))
            plain.lazy_initialization(keys, values)
            plain.keys, plain.values = keys, values
            plain.cumulative_length = width
            cache.layers[layer_index] = plain
        group.valid = wanted >= 0
        group.positions = wanted
