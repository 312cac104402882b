"""One model, its KV cache, and the bookkeeping to run tree blocks against that cache.

The cache stays rectangular across the batch: each row keeps its own set of
valid slots (`slot_valid`), so rows that accept different numbers of tokens
leave masked holes instead of being shifted. Every forward gets an explicit
4D additive mask and explicit position ids (mRoPE rows included), which is
how a stock HF model verifies a whole tree in one pass.

Cache layout during a round: `[committed slots (S) | uncommitted tail]`. The
tail is a tree (see `DraftTree`'s layout rules) described by `parents`; a
forward appends a block of new tail nodes, `commit` keeps a chosen subset of
the tail (gathered into place) and drops the rest. Sliding-window and chunked
layers hold fewer committed slots, with their own layout (`windows.WindowedSlots`):
what plain generate keeps, plus the round in flight.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .. import clock
from .. import ops
from .compat import cache_argument
from .lean import lean_forward
from .target_states import StateCapture
from .windows import attention_layout, to_plain_layers, windowed_slots


def left_pad(tensor: torch.Tensor, width: int, dim: int, value=0) -> torch.Tensor:
    """`tensor` widened to `width` along `dim` by filling `value` before its entries (rows that join a batch are
    right-aligned to its slots: the columns before a row's own are invalid holes)."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_full(shape, value), tensor], dim=dim)


class InPlaceAppend:
    """`update` of one `DynamicLayer` that writes new keys and values into spare slots of a larger buffer.

    `DynamicLayer.update` concatenates: every forward copies the layer's whole cache to append a few slots. At
    batch 32 with 400-slot prompts on a CPU that is ~45% of a verification forward of SmolLM2-135M (profiled:
    `aten::cat` 180 ms of 400 ms). With this, the layer's `keys` / `values` are the first L slots of a buffer
    with spare capacity (views), a forward copies only its new slots, and `commit`'s cuts (views of the same
    storage) keep the buffer. Whenever the layer's tensors are not such views any more (rows dropped, a cache
    replaced), the next update starts a new buffer from them: one copy, as the concatenation would make.
    The values are the same as concatenation's, slot for slot.
    """

    SPARE = 64  # slots of spare capacity at least; 1/64 of the length beyond that (a long prompt's cache grows
    # by 1.6%, and a forward copies the whole cache once every length / 64 appended slots)

    def __init__(self, layer: DynamicLayer):
        self.layer = layer
        self.keys = self.values = None  # the buffers (B, H, capacity, D)

    @staticmethod
    def _holds(buffer, tensor: torch.Tensor) -> bool:
        return (buffer is not None and tensor.dtype == buffer.dtype and tensor.device == buffer.device
                and tensor.data_ptr() == buffer.data_ptr() and tensor.stride() == buffer.stride()
                and tensor.shape[:2] == buffer.shape[:2] and tensor.shape[3] == buffer.shape[3])

    def __call__(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        layer = self.layer
        if (not layer.is_initialized or layer.keys.dim() != 4 or key_states.dtype != layer.keys.dtype
                or value_states.dtype != layer.values.dtype or key_states.shape[:2] != layer.keys.shape[:2]):
            self.keys = self.values = None
            return DynamicLayer.update(layer, key_states, value_states, *args, **kwargs)
        length, new = layer.keys.shape[2], key_states.shape[2]
        end = length + new
        if not (self._holds(self.keys, layer.keys) and self._holds(self.values, layer.values)
                and end <= self.keys.shape[2] and end <= self.values.shape[2]):
            self.keys, self.values = self._grow(layer.keys, end), self._grow(layer.values, end)
        self.keys[:, :, length:end].copy_(key_states)
        self.values[:, :, length:end].copy_(value_states)
        layer.keys, layer.values = self.keys[:, :, :end], self.values[:, :, :end]
        return layer.keys, layer.values

    def _grow(self, tensor: torch.Tensor, end: int) -> torch.Tensor:
        batch, heads, length, dim = tensor.shape
        buffer = tensor.new_empty(batch, heads, end + max(self.SPARE, end // 64), dim)
        buffer[:, :, :length].copy_(tensor)
        return buffer


def append_in_place(cache) -> list:
    """Give every plain `DynamicLayer` of `cache` an `InPlaceAppend` update (an instance attribute; sliding,
    static, quantized or offloaded layers keep theirs). Returns the layers changed (`restore_append`)."""
    if getattr(cache, "offloading", False):
        return []
    changed = []
    for layer in getattr(cache, "layers", ()):
        if type(layer) is DynamicLayer and "update" not in layer.__dict__:
            layer.update = InPlaceAppend(layer)
            changed.append(layer)
    return changed


def restore_append(layers: list) -> None:
    """The stock `update` again on `layers` (their tensors stay as they are: views of the buffers)."""
    for layer in layers:
        if isinstance(layer.__dict__.get("update"), InPlaceAppend):
            del layer.update


class ModelRunner:
    """Runs tree blocks of one model against its own `DynamicCache`.

    Args:
        model: the HF model.
        cache (`DynamicCache`): its cache, already holding the prompt.
        slot_valid (`torch.BoolTensor` of shape `(B, S)`): which cache slots are real tokens.
        position_ids (`torch.LongTensor` of shape `(B, S)` or `(R, B, S)`): the positions the prompt used;
            the last column fixes each row's rope offset per mRoPE row.
    """

    def __init__(self, model, cache: DynamicCache, slot_valid: torch.Tensor, position_ids: torch.Tensor):
        self.model = model
        self.cache = cache
        self.slot_valid = slot_valid
        self.next_position = slot_valid.sum(-1)  # (B,) text position of the next token
        # offset of every position row from the text position, read off the last prompt column
        last = position_ids[..., -1]  # (B,) or (R, B)
        deltas = last - (self.next_position - 1)
        self.rope_deltas = None if (deltas.dim() == 1 and not deltas.any()) else deltas
        self.dtype = model.dtype
        self._accepts_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_argument = cache_argument(model)
        self._lean = lean_forward(model)  # the same operations without transformers' Python, where supported
        self.layout = attention_layout(model)  # sliding-window / chunked layers: their windows go in the mask
        # their cache holds plain generate's window plus the round in flight, with a slot layout of its own
        self.windows = windowed_slots(model, cache, slot_valid)
        windowed = {index for group in self.windows for index in group.layers}
        self.full_layers = [i for i in range(len(cache.layers)) if i not in windowed]
        self.model_time = 0.0  # seconds inside the model's forward, for the time split
        # rounds append a few slots per forward: into spare capacity, not by copying the cache (`InPlaceAppend`)
        self.appending = append_in_place(cache)

    def close(self) -> None:
        """The cache's layers get their stock `update` back (the loop's end: the cache may be returned)."""
        restore_append(self.appending)
        self.appending = []

    @property
    def lean(self) -> bool:
        """Whether this runner's forwards run `lean.LeanForward` (on the CPU; a cost curve of its own)."""
        return self._lean is not None and self._lean.applies(self.slot_valid)

    @property
    def committed_length(self) -> int:
        return self.slot_valid.shape[1]

    @property
    def has_tail(self) -> bool:
        """Whether the cache holds uncommitted slots (a tree of the last forward)."""
        return self._cached_length() > self._committed(self._reference_layer())

    def _reference_layer(self) -> int:
        return self.full_layers[0] if self.full_layers else self.windows[0].layers[0]

    def _committed(self, layer_index: int) -> int:
        """Committed slots of cache layer `layer_index`."""
        for group in self.windows:
            if layer_index in group.layers:
                return group.length
        return self.committed_length

    def _cached_length(self) -> int:
        layer = self.cache.layers[self._reference_layer()]
        return layer.keys.shape[2] if layer.is_initialized and layer.keys.dim() == 4 else 0

    def position_ids(self, offsets: torch.Tensor) -> torch.Tensor:
        """Position ids for tokens at text offsets `(B, M)` past the committed tokens: `(B, M)` or `(R, B, M)`."""
        positions = self.next_position[:, None] + offsets
        if self.rope_deltas is None:
            return positions
        if self.rope_deltas.dim() == 1:
            return positions + self.rope_deltas[:, None]
        return positions.unsqueeze(0) + self.rope_deltas.unsqueeze(-1)

    def forward(
        self,
        input_ids: torch.Tensor,
        parents: torch.Tensor,
        valid: torch.Tensor,
        logits_to_keep: int = 0,
        states=None,
        **model_kwargs,
    ):
        """Run a block of new tail nodes in one forward.

        Args:
            input_ids (`torch.LongTensor` of shape `(B, M)`): tokens of the new block.
            parents (`torch.LongTensor` of shape `(B, T)`): parents over the whole tail (T >= M; the
                block is its last M nodes, the first T - M are already in the cache).
            valid (`torch.BoolTensor` of shape `(B, T)`): False for padding nodes.
            logits_to_keep (`int`): keep logits of the last n block positions only (0 = all).
            states (iterable of `int`, *optional*): hidden-state entries to return (numbered like
                `outputs.hidden_states`), as `output.hidden_states`, a dict by entry; the others are not kept.

        Returns:
            The model output (`logits` of shape `(B, M or n, V)`).
        """
        num_new = input_ids.shape[1]
        tail = parents.shape[1] - num_new
        reference = self._reference_layer()
        if self._cached_length() != self._committed(reference) + tail:
            raise RuntimeError(
                f"cache holds {self._cached_length()} slots, expected {self._committed(reference)} + {tail}"
            )
        mask, depths = ops.tree_attention_mask(parents, valid, self.slot_valid, self.dtype, num_query=num_new)
        position_ids = self.position_ids(depths[:, tail:])
        if self.windows:
            mask = self._windowed_masks(mask, parents, valid, depths, tail)
        start = clock.now()
        lean = (self._lean is not None and self._lean.applies(input_ids) and isinstance(mask, torch.Tensor)
                and set(model_kwargs) <= {"output_hidden_states"})
        if lean:
            # rows of different tree sizes: the per-token work runs on the real tokens only (`LeanForward`)
            block_valid = valid[:, tail:]
            packed = None if logits_to_keep or bool(block_valid.all()) else block_valid
            output = self._lean(input_ids, mask, position_ids, self.cache, logits_to_keep=logits_to_keep,
                                output_hidden_states=bool(model_kwargs.get("output_hidden_states")),
                                token_valid=packed, state_indices=states)
        else:
            output = self._model_forward(input_ids, mask, position_ids, logits_to_keep, states, model_kwargs)
        self.model_time += clock.now() - start
        return output

    def _windowed_masks(self, mask: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, depths: torch.Tensor,
                        tail: int):
        """The attention mask with windowed layers: each windowed layer type's own over its slots, restricted to
        the window by text positions; one mask per layer type (`full_attention` gets `mask`) when the layout
        takes one, else the single windowed type's."""
        num_new = parents.shape[1] - tail
        node_positions = self.next_position[:, None] + depths
        masks = {}
        for group in self.windows:
            group_mask, _ = ops.tree_attention_mask(parents, valid, group.valid, self.dtype, num_query=num_new)
            masks[group.layer_type] = self.layout.restrict(
                group_mask, node_positions[:, tail:], torch.cat([group.positions, node_positions], 1),
                group.layer_type)
        if not self.layout.per_type:
            (mask,) = masks.values()
            return mask
        if self.full_layers:
            masks["full_attention"] = mask
        return masks

    def _model_forward(self, input_ids, mask, position_ids, logits_to_keep, states, model_kwargs):
        """The model's own forward over the block (its `hidden_states` the entries `states` asks for)."""
        kwargs = dict(model_kwargs)
        if self._accepts_logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        capture = None
        if states is not None:
            capture = StateCapture.for_model(self.model, states)
            if capture is None:  # layers not located: every entry is asked for (a tuple, indexed alike)
                kwargs["output_hidden_states"] = True
        try:
            with capture if capture is not None else contextlib.nullcontext():
                output = self.model(
                    input_ids=input_ids,
                    attention_mask=mask,  # (B, 1, M, S + T), or one such mask per layer type
                    position_ids=position_ids,
                    use_cache=True,
                    return_dict=True,
                    **{self._cache_argument: self.cache},
                    **kwargs,
                )
        except (AttributeError, TypeError, KeyError) as error:
            if isinstance(mask, torch.Tensor):
                raise
            raise NotImplementedError(
                f"{type(self.model).__name__} mixes full and windowed attention layers, and its forward does "
                f"not take one attention mask per layer type ({type(error).__name__}: {error}); spec_strategy "
                "cannot carry the windows of its layers past the first window's length."
            ) from error
        if capture is not None:
            output.hidden_states = capture.states
        return output

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep rows `rows` `(B',)` of the cache and the bookkeeping only, in that order (between rounds: the
        cache holds committed slots only). Each layer's cache is selected on its own device."""
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, rows.to(layer.keys.device))
            layer.values = layer.values.index_select(0, rows.to(layer.values.device))
        self.slot_valid = self.slot_valid[rows]
        self.next_position = self.next_position[rows]
        for group in self.windows:
            group.keep_rows(rows)
        if self.rope_deltas is not None:  # (B,) or (R, B)
            self.rope_deltas = self.rope_deltas[..., rows]

    def join(self, other: ModelRunner) -> None:
        """`other`'s rows follow this runner's (between rounds: both caches hold committed slots only). Each side is
        right-aligned to the wider one, layer by layer and windowed layout by layout; the columns before a row's
        own slots are invalid holes."""
        if self.has_tail or other.has_tail:
            raise RuntimeError("runners join between rounds only (a cache holds an uncommitted tail).")
        if len(self.windows) != len(other.windows) or len(self.cache.layers) != len(other.cache.layers):
            raise ValueError("runners of different models cannot join.")

        def joined(mine: torch.Tensor, theirs: torch.Tensor, dim: int, value) -> torch.Tensor:
            width = max(mine.shape[dim], theirs.shape[dim])
            return torch.cat([left_pad(mine, width, dim, value), left_pad(theirs.to(mine.device), width, dim, value)])

        for layer, other_layer in zip(self.cache.layers, other.cache.layers):
            layer.keys = joined(layer.keys, other_layer.keys, 2, 0)
            layer.values = joined(layer.values, other_layer.values, 2, 0)
        self.slot_valid = joined(self.slot_valid, other.slot_valid, 1, False)
        for group, other_group in zip(self.windows, other.windows):
            group.valid = joined(group.valid, other_group.valid, 1, False)
            group.positions = joined(group.positions, other_group.positions, 1, 0)
        batch, other_batch = self.next_position.shape[0], other.next_position.shape[0]
        if self.rope_deltas is not None or other.rope_deltas is not None:
            template = self.rope_deltas if self.rope_deltas is not None else other.rope_deltas
            rows = template.shape[:-1]  # () or (R,)
            mine = self.rope_deltas if self.rope_deltas is not None else template.new_zeros(*rows, batch)
            theirs = other.rope_deltas if other.rope_deltas is not None else template.new_zeros(*rows, other_batch)
            self.rope_deltas = torch.cat([mine, theirs.to(mine.device)], dim=-1)
        self.next_position = torch.cat([self.next_position, other.next_position])
        other.close()

    def trim(self) -> None:
        """Drop the leading columns no row holds (between rounds; a serving batch whose oldest rows left): each
        row's slots stay in order, the cache gets narrower."""
        if self.has_tail or not self.full_layers or self.slot_valid.shape[0] == 0:
            return
        lead = int((~self.slot_valid).long().cumprod(-1).sum(-1).min())  # holes before every row's first slot
        if lead == 0:
            return
        for index in self.full_layers:
            layer = self.cache.layers[index]
            layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
        self.slot_valid = self.slot_valid[:, lead:]

    def rows_state(self, rows: torch.Tensor) -> tuple:
        """The committed cache and slot layout of rows `rows` `(R,)` (between rounds), for `restore_rows`."""
        layers = [(layer.keys.index_select(0, rows.to(layer.keys.device)),
                   layer.values.index_select(0, rows.to(layer.values.device))) for layer in self.cache.layers]
        return layers, self.slot_valid[rows], [(group.valid[rows], group.positions[rows]) for group in self.windows]

    def restore_rows(self, live_rows: torch.Tensor, batch_size: int, states: list) -> None:
        """The cache and slot layouts hold `batch_size` rows again: the current rows at `live_rows`, and each
        `(rows, rows_state(...))` of `states` at its rows; a row's slots past its own are invalid holes (zeros)."""
        def widen(current, parts, fill):
            width = max([current.shape[1]] + [part.shape[1] for _, part in parts])
            full = current.new_full((batch_size, width), fill)
            full[live_rows, : current.shape[1]] = current
            for rows, part in parts:
                full[rows, : part.shape[1]] = part
            return full

        self.slot_valid = widen(self.slot_valid, [(rows, state[1]) for rows, state in states], False)
        for g, group in enumerate(self.windows):
            group.valid = widen(group.valid, [(rows, state[2][g][0]) for rows, state in states], False)
            group.positions = widen(group.positions, [(rows, state[2][g][1]) for rows, state in states], 0)
        for index, layer in enumerate(self.cache.layers):
            for kind, name in enumerate(("keys", "values")):
                tensor = getattr(layer, name)
                parts = [(rows, state[0][index][kind]) for rows, state in states]
                width = max([tensor.shape[2]] + [part.shape[2] for _, part in parts])
                full = tensor.new_zeros((batch_size, tensor.shape[1], width, tensor.shape[3]))
                full[live_rows.to(tensor.device), :, : tensor.shape[2]] = tensor
                for rows, part in parts:
                    full[rows.to(tensor.device), :, : part.shape[2]] = part
                setattr(layer, name, full)

    def commit(self, keep_index: torch.Tensor, keep_valid: torch.Tensor) -> None:
        """Keep tail slots `keep_index` `(B, K)` (in order) as committed; `keep_valid` `(B, K)` marks real ones.
        Windowed layers then drop what no later query can see, once they hold more than their slack."""
        layers = self.cache.layers
        kept = keep_index.shape[1]
        starts = [self._committed(i) for i in range(len(layers))]
        if torch.equal(keep_index, torch.arange(kept, device=keep_index.device).expand_as(keep_index)):
            # every row keeps the first K tail slots in order (a chain accepted from its start): nothing moves
            for layer, start in zip(layers, starts):
                layer.keys, layer.values = layer.keys[:, :, : start + kept], layer.values[:, :, : start + kept]
        else:
            # a model split over devices (accelerate's device_map) keeps each layer's cache on its own
            by_place = {}
            for i, layer in enumerate(layers):
                by_place.setdefault((layer.keys.device, starts[i]), []).append(i)
            for (device, start), members in by_place.items():
                tensors = [layers[i].keys for i in members] + [layers[i].values for i in members]
                compacted = ops.compact_kv_(tensors, keep_index.to(device), start)
                for j, i in enumerate(members):
                    layers[i].keys, layers[i].values = compacted[j], compacted[len(members) + j]
        for group in self.windows:
            group.append(keep_valid, self.next_position)
        self.slot_valid = torch.cat([self.slot_valid, keep_valid], dim=1)
        self.next_position = self.next_position + keep_valid.sum(-1)
        for group in self.windows:
            self._compact_window(group)

    def _compact_window(self, group, force: bool = False) -> None:
        """Each row of `group`'s layers keeps only the slots a later query can see (plain's window), in order."""
        compaction = group.compact_index(self.next_position, force=force)
        if compaction is None:
            return
        index, valid = compaction
        for layer_index in group.layers:
            layer = self.cache.layers[layer_index]
            layer.keys, layer.values = (
                t.gather(2, index.to(t.device)[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
                for t in (layer.keys, layer.values))
        group.compacted(index, valid)

    def plain_windowed_layers(self, width: int, pads: torch.Tensor) -> None:
        """Windowed layers laid out as plain generate's `DynamicSlidingWindowLayer`s of a `width`-slot cache whose
        rows start with `pads` `(B,)` padding slots (the end of the call)."""
        if not self.windows:
            return
        slot_text = torch.arange(width, device=pads.device)[None, :] - pads[:, None]
        to_plain_layers(self.cache, self.windows, width, slot_text)
