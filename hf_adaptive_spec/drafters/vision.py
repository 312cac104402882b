"""Visual token selection for the LaSpec drafter (docs/algorithms.md section 2, "Seeing what matters").

Three model-agnostic pieces:

* [`VisualKeyStore`]: after the target's prefill, int8 copies (one scale per
  token per head) of its cached keys at the visual-token positions, for a few
  layers, padded per row to the largest visual count.
* [`QueryCapture`]: records the post-RoPE queries of chosen target layers by
  routing the text sub-model's attention through a registered attention
  function that stores the query and then runs sdpa.
* [`select_visual_tokens`]: per layer, the head-averaged attention of the
  last accepted position's query over the stored keys
  (`ops.visual_scores`); a cross-layer vote (`ops.visual_vote`) keeps the M
  most voted visual tokens.

Typical use (the decoding loop wires this; shapes in the docstrings):

    with QueryCapture(target, layer_ids=[4, 12, 20]) as capture:
        out = target(**prompt, cache=cache)  # past_key_values= before transformers 5.24
        store = VisualKeyStore.from_cache(cache, [4, 12, 20], prompt["input_ids"] == image_token_id)
        indices, cost = select_visual_tokens(capture.query_at(last_index), store, m_per_layer=16, keep=8)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .. import clock
from .. import ops
from ..adapters.attention import CAPTURE_ATTENTION, recording_queries, switched_attention

__all__ = [
    "CAPTURE_ATTENTION",
    "VisualKeyStore",
    "select_visual_tokens",
    "QueryCapture",
]


# --------------------------------------------------------------------------- key store


@dataclass
class VisualKeyStore:
    """int8 keys of the target at the visual-token positions, for a few layers.

    Attributes:
        quantized (`dict[int, torch.CharTensor]`): layer -> `(B, H_kv, T, D)` int8 keys (zeros on padding).
        scales (`dict[int, torch.FloatTensor]`): layer -> `(B, H_kv, T, 1)` per-token-per-head scales.
        positions (`torch.LongTensor` of shape `(B, T)`): sequence index (cache slot) of each stored token,
            -1 on padding.
        valid (`torch.BoolTensor` of shape `(B, T)`): False on padding.
        counts (`tuple[int, ...]`): visual tokens per row (host copy; T = max(counts)).
    """

    quantized: dict[int, torch.Tensor]
    scales: dict[int, torch.Tensor]
    positions: torch.Tensor
    valid: torch.Tensor
    counts: tuple[int, ...]

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(self.quantized)

    @property
    def has_padding(self) -> bool:
        """True when rows hold different numbers of visual tokens."""
        return len(set(self.counts)) > 1

    @classmethod
    def from_cache(cls, cache, layer_ids, visual_mask: torch.Tensor) -> VisualKeyStore:
        """Quantize the cached keys at the visual positions (once, after the prefill).

        Args:
            cache (`DynamicCache`): the target's cache; `cache.layers[l].keys` has shape `(B, H_kv, S, D)`.
            layer_ids (iterable of `int`): target decoder layers to keep.
            visual_mask (`torch.BoolTensor` of shape `(B, S)`): True at visual-token positions (cache slots).

        Returns:
            [`VisualKeyStore`].
        """
        return cls.from_keys({layer: cache.layers[layer].keys for layer in layer_ids}, visual_mask)

    @classmethod
    def from_keys(cls, keys_by_layer: dict, visual_mask: torch.Tensor) -> VisualKeyStore:
        """`from_cache` from each layer's prompt keys `{layer: (B, H_kv, S, D)}` (as the prefill's attention saw
        them: a sliding-window layer's cache keeps only its window)."""
        layer_ids = list(keys_by_layer)
        visual_mask = visual_mask.bool()
        batch, seq_len = visual_mask.shape
        counts_tensor = visual_mask.sum(1)  # (B,)
        counts = tuple(int(c) for c in counts_tensor.tolist())  # one host sync, at prefill only
        num_tokens = max(counts, default=0)
        # stable descending sort of the 0/1 mask: each row's visual slots first, in sequence order
        order = torch.sort(visual_mask.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :num_tokens]
        valid = torch.arange(num_tokens, device=visual_mask.device) < counts_tensor[:, None]  # (B, T)
        positions = order.masked_fill(~valid, -1)
        quantized, scales = {}, {}
        for layer in layer_ids:
            keys = keys_by_layer[layer]  # (B, H_kv, S, D)
            if keys.shape[0] != batch or keys.shape[2] != seq_len:
                raise ValueError(
                    f"visual_mask has shape {(batch, seq_len)} but layer {layer}'s cached keys have batch "
                    f"{keys.shape[0]} and length {keys.shape[2]}; build the store right after the prefill."
                )
            kv_heads, dim = keys.shape[1], keys.shape[3]
            index = order[:, None, :, None].expand(batch, kv_heads, num_tokens, dim)  # (B, H_kv, T, D)
            layer_quantized, layer_scale = ops.quantize_int8(keys.gather(2, index))
            pad = ~valid[:, None, :, None]
            quantized[layer] = layer_quantized.masked_fill(pad, 0)
            scales[layer] = layer_scale.masked_fill(pad, 0.0)
        return cls(quantized, scales, positions, valid, counts)

    def keep_rows(self, rows: torch.Tensor) -> VisualKeyStore:
        """The store of rows `rows` `(B',)` only, in that order, cut to their longest row's visual tokens."""
        counts = tuple(self.counts[row] for row in rows.tolist())
        width = max(counts, default=0)
        return VisualKeyStore({layer: q[rows][:, :, :width] for layer, q in self.quantized.items()},
                              {layer: s[rows][:, :, :width] for layer, s in self.scales.items()},
                              self.positions[rows][:, :width], self.valid[rows][:, :width], counts)

    def join(self, other: VisualKeyStore) -> VisualKeyStore:
        """The rows of this store, then `other`'s (the same layers), padded to the most visual tokens of any row."""
        if set(other.quantized) != set(self.quantized):
            raise ValueError("visual key stores of different layers cannot join.")
        width = max(self.valid.shape[1], other.valid.shape[1])

        def pad(mine: torch.Tensor, theirs: torch.Tensor, dim: int, value) -> torch.Tensor:
            parts = []
            for tensor in (mine, theirs):
                shape = list(tensor.shape)
                shape[dim] = width - tensor.shape[dim]
                parts.append(torch.cat([tensor, tensor.new_full(shape, value)], dim=dim))
            return torch.cat(parts)

        return VisualKeyStore({layer: pad(q, other.quantized[layer], 2, 0) for layer, q in self.quantized.items()},
                              {layer: pad(s, other.scales[layer], 2, 0.0) for layer, s in self.scales.items()},
                              pad(self.positions, other.positions, 1, -1), pad(self.valid, other.valid, 1, False),
                              self.counts + other.counts)

    def empty(self, batch_size: int) -> VisualKeyStore:
        """A store of `batch_size` rows without visual tokens, with this store's layers and shapes."""
        return VisualKeyStore({layer: q.new_zeros(batch_size, *q.shape[1:]) for layer, q in self.quantized.items()},
                              {layer: s.new_zeros(batch_size, *s.shape[1:]) for layer, s in self.scales.items()},
                              self.positions.new_full((batch_size, self.positions.shape[1]), -1),
                              self.valid.new_zeros(batch_size, self.valid.shape[1]), (0,) * batch_size)

    def dequantize(self, layer: int) -> torch.Tensor:
        """Float keys `(B, H_kv, T, D)` of `layer` (for inspection and tests)."""
        return self.quantized[layer].float() * self.scales[layer]


def _layer_scores(query: torch.Tensor, store: VisualKeyStore, layer: int) -> torch.Tensor:
    """A_l(j) over each row's own visual tokens, (B, T); padding slots get -1 (below any real score)."""
    quantized, scale = store.quantized[layer], store.scales[layer]
    if query.dim() != 3 or query.shape[0] != quantized.shape[0] or query.shape[2] != quantized.shape[3]:
        raise ValueError(
            f"queries[{layer}] must have shape (B, H, D) = ({quantized.shape[0]}, H, {quantized.shape[3]}); "
            f"got {tuple(query.shape)}."
        )
    if query.shape[1] % quantized.shape[1]:
        raise ValueError(
            f"queries[{layer}] has {query.shape[1]} heads, not a multiple of the {quantized.shape[1]} key heads."
        )
    if not store.has_padding:
        return ops.visual_scores(query, quantized, scale)
    # rows differ in length: the softmax must run over each row's own tokens only (padding would take mass)
    scores = torch.full(store.valid.shape, -1.0, dtype=torch.float32, device=query.device)  # (B, T)
    for row, count in enumerate(store.counts):
        if count:
            scores[row, :count] = ops.visual_scores(
                query[row : row + 1], quantized[row : row + 1, :, :count], scale[row : row + 1, :, :count]
            )[0]
    return scores


def select_visual_tokens(
    queries: dict[int, torch.Tensor],
    store: VisualKeyStore,
    m_per_layer: int,
    keep: int = 8,
    timed: bool = True,
) -> tuple[torch.Tensor, float | None]:
    """Keep the M visual tokens the verifier's query attends to most, by a cross-layer vote.

    Per layer l: A_l(j) = mean over heads of softmax_j(q . K^_j / sqrt(d)) over the row's visual tokens
    (grouped-query key heads are shared by their query heads). Each layer votes for its top `m_per_layer`
    tokens; the `keep` most voted are kept (ties: larger summed A_l).

    Args:
        queries (`dict[int, torch.Tensor]`): layer -> post-RoPE query `(B, H, D)` of the last accepted
            position ([`QueryCapture.query_at`]); every layer must be in `store`.
        store ([`VisualKeyStore`]): the int8 visual keys.
        m_per_layer (`int`): votes cast per layer (m).
        keep (`int`): tokens kept (M).
        timed (`bool`): measure the selection's wall time (synchronizes a CUDA device once).

    Returns:
        `(indices, cost_seconds)`: `indices` `torch.LongTensor` of shape `(B, min(keep, T))`, sequence indices
        (cache slots) of the kept tokens ranked best first, -1 where a row has fewer visual tokens than kept;
        `cost_seconds` is None when not `timed`.
    """
    start = clock.now() if timed else None
    if not queries:
        raise ValueError("queries is empty: capture at least one layer.")
    missing = [layer for layer in queries if layer not in store.quantized]
    if missing:
        raise ValueError(f"queries has layers {missing} that the VisualKeyStore does not hold ({store.layer_ids}).")
    batch, num_tokens = store.valid.shape
    if num_tokens == 0 or keep <= 0:
        indices = torch.empty(batch, 0, dtype=torch.long, device=store.valid.device)
    else:
        scores = torch.stack([_layer_scores(query, store, layer) for layer, query in queries.items()])  # (L, B, T)
        local = ops.visual_vote(scores, m_per_layer, keep)  # (B, M); real tokens rank above padding
        indices = store.positions.gather(1, local)  # -1 where a padding slot was picked
    cost = None
    if timed:
        if indices.is_cuda:
            torch.cuda.synchronize(indices.device)
        cost = clock.now() - start
    return indices, cost


# --------------------------------------------------------------------------- query capture


def _text_attention_modules(model) -> dict[int, int]:
    """id(attention module) -> layer index, for the decoder layers of the text model."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    mapping = {}
    for module in decoder.modules():
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int) and type(module).__name__.endswith("Attention"):
            mapping[id(module)] = layer
    if not mapping:
        raise ValueError(f"{type(model).__name__}: found no attention modules with a `layer_idx` in its text model.")
    return mapping


class QueryCapture:
    """Record the post-RoPE queries of chosen text decoder layers of `model`, forward after forward.

    Inside the `with` block the text sub-model runs the registered `CAPTURE_ATTENTION` implementation (sdpa
    plus a copy of the query); on exit the previous implementations come back. After each forward,
    `queries[layer]` holds that forward's queries, shape `(B, H, Q, D)` (Q = tokens of the forward).

    Args:
        model (`PreTrainedModel`): the target (LM or VLM) using sdpa-compatible attention.
        layer_ids (iterable of `int`): text decoder layers to capture.

    Examples:
        >>> with QueryCapture(target, layer_ids=[0, 1]) as capture:  # doctest: +SKIP
        ...     target(**inputs)
        ...     last = capture.query_at(-1)  # {layer: (B, H, D)}
    """

    def __init__(self, model, layer_ids):
        self.model = model
        self.layer_ids = tuple(int(layer) for layer in layer_ids)
        self._layer_of_module = _text_attention_modules(model)
        known = set(self._layer_of_module.values())
        unknown = [layer for layer in self.layer_ids if layer not in known]
        if unknown:
            raise ValueError(f"layer_ids {unknown} are not text decoder layers of {type(model).__name__} "
                             f"(it has {len(known)}).")
        self.queries: dict[int, torch.Tensor] = {}
        # the first forward's keys of each captured layer (the prompt's, for `VisualKeyStore.from_keys`)
        self.keep_prompt_keys = False
        self.prompt_keys: dict[int, torch.Tensor] = {}
        self._stack: contextlib.ExitStack | None = None
        self._token = None

    def __enter__(self) -> QueryCapture:
        if self._stack is not None:
            raise RuntimeError("This QueryCapture is already active.")
        stack = contextlib.ExitStack()
        stack.enter_context(switched_attention(self.model))  # raises unless the model runs sdpa
        stack.enter_context(recording_queries(self._record))
        self._stack = stack
        return self

    def __exit__(self, *exc_info) -> None:
        stack, self._stack = self._stack, None
        stack.close()

    def _record(self, module, query, key=None) -> bool:
        """Keep the query of a captured layer of this model (and, for the first forward, the keys it attended
        to: `prompt_keys`); True when `module` is one of this model's."""
        layer = self._layer_of_module.get(id(module))
        if layer is None:
            return False
        if layer in self.layer_ids:
            self.queries[layer] = query.detach()
            if key is not None and self.keep_prompt_keys and len(self.prompt_keys) < len(self.layer_ids):
                self.prompt_keys.setdefault(layer, key.detach())
        return True

    def clear(self) -> None:
        self.queries = {}

    def query_at(self, index) -> dict[int, torch.Tensor]:
        """Each row's query at one position of the last forward.

        Args:
            index (`int` or `torch.LongTensor` of shape `(B,)`): position within the last forward's Q tokens
                (negative ints count from the end), per row when a tensor.

        Returns:
            `dict[int, torch.Tensor]`: layer -> `(B, H, D)`.
        """
        if not self.queries:
            raise RuntimeError("No query captured yet: run a forward inside the `with QueryCapture(...)` block.")
        out = {}
        for layer in self.layer_ids:
            query = self.queries[layer]  # (B, H, Q, D)
            if isinstance(index, int):
                out[layer] = query[:, :, index]
            else:
                batch, heads, _, dim = query.shape
                gather_index = index.to(query.device).view(batch, 1, 1, 1).expand(batch, heads, 1, dim)
                out[layer] = query.gather(2, gather_index).squeeze(2)
        return out
