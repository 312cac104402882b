"""Which visual tokens an independent VLM drafter sees: M of the image's tokens, chosen by the target's attention.

The drafter's prompt holds the whole image (its cache has a slot per visual token, at the target's positions);
the view hides every visual slot but the M selected ones from the drafter's attention (its runner's slot mask:
positions do not move). The M tokens are those the target's query attends to most (int8 keys of a few target
layers and a cross-layer vote, `vision.select_visual_tokens`), picked

* ``"prefill"``: once, by the query of the prompt's last position (the drafter's own prefill already sees only
  them), as SAGE-style drafters prune their visual tokens once; or
* ``"round"``: again after every round, by the query of the last accepted position (as Uni-LaSpec selects for
  its drafter), from the queries the verification forward records.

M = 0 hides the image and runs no selection work (no query capture, no key store); M at or above a row's
visual-token count hides nothing.
"""

from __future__ import annotations

import contextlib

import torch

from .. import clock
from ..adapters.attention import text_attention
from ..adapters.compat import text_config
from ..adapters.runner import left_pad
from .vision import QueryCapture, VisualKeyStore, select_visual_tokens

__all__ = ["SELECTIONS", "VisualView", "image_token_mask", "selection_layers"]

SELECTIONS = ("prefill", "round")


def image_token_mask(model, input_ids: torch.Tensor) -> torch.Tensor | None:
    """`(B, S)` True at the prompt's image/video placeholder tokens, or None if the model has none."""
    ids = image_token_ids(model)
    if not ids:
        return None
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for value in ids:
        mask |= input_ids == value
    return mask if bool(mask.any()) else None


def image_token_ids(model) -> list:
    """The image/video placeholder ids of `model`'s config (empty: a text model)."""
    config = model.config
    ids = []
    for name in ("image_token_id", "image_token_index", "video_token_id", "video_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= 0:
            ids.append(value)
    return ids


def selection_layers(num_layers: int) -> list:
    """The target layers whose queries vote for visual tokens: a low, the middle and a high one (2, L/2, L-3)."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3)})


class VisualView:
    """The visual slots an independent drafter's runner lets its queries see.

    Args:
        target: the verifier (its queries pick the tokens; it must run sdpa attention).
        drafter_model: the drafter (it must read images: an image placeholder id in its config).
        num_visual_tokens (`int`): M.
        selection (`str`): ``"prefill"`` or ``"round"``.
    """

    def __init__(self, target, drafter_model, num_visual_tokens: int, selection: str = "prefill"):
        if selection not in SELECTIONS:
            raise ValueError(f"visual_selection must be one of {SELECTIONS}, got {selection!r}.")
        if not image_token_ids(drafter_model):
            raise ValueError(f"visual_tokens selects the image tokens a drafter sees, but the drafter "
                             f"({type(drafter_model).__name__}) reads no images; leave visual_tokens None.")
        self.target = target
        self.num_visual_tokens = num_visual_tokens
        self.selection = selection
        self.layer_ids = selection_layers(text_config(target).num_hidden_layers)
        self.capture = None
        self.store = None
        self.image_columns = None  # (B, W) True at visual slots, W <= the runner's width (right-padded lazily)
        self.visual_time = 0.0

    # ---- the target's prefill and verification

    def prefill_scope(self, input_ids: torch.Tensor):
        """Around the target's prefill: record its queries (and the prompt's keys) when a selection is needed."""
        mask = image_token_mask(self.target, input_ids)
        self.image_columns = mask
        if mask is None or self.num_visual_tokens <= 0 or self.num_visual_tokens >= int(mask.sum(-1).max()):
            return contextlib.nullcontext()  # nothing to choose: all visual tokens hidden, or all seen
        if text_attention(self.target) != "sdpa":
            raise ValueError(f"visual_tokens={self.num_visual_tokens} picks visual tokens by the target's queries, "
                             f"which are recorded through sdpa; the target runs "
                             f"{text_attention(self.target)!r} (load it with attn_implementation='sdpa').")
        self.capture = QueryCapture(self.target, self.layer_ids)
        self.capture.keep_prompt_keys = True
        return self.capture

    def verify_scope(self):
        return self.capture if self.capture is not None and self.selection == "round" else contextlib.nullcontext()

    @property
    def hides_all(self) -> bool:
        return self.num_visual_tokens <= 0

    # ---- which slots

    def prompt_visibility(self, slot_valid: torch.Tensor) -> torch.Tensor:
        """The drafter prefill's attention mask `(B, S)`: `slot_valid` with the hidden visual slots off (after the
        target's prefill; selects round 1's tokens)."""
        if self.image_columns is None:
            return slot_valid
        if self.capture is not None:
            start = clock.now()
            keys = self.capture.prompt_keys
            self.capture.keep_prompt_keys, self.capture.prompt_keys = False, {}
            self.store = VisualKeyStore.from_keys({layer: keys[layer] for layer in self.layer_ids}, self.image_columns)
            last = torch.full((slot_valid.shape[0],), slot_valid.shape[1] - 1, device=slot_valid.device)
            visible = self._selected_columns(self.capture.query_at(last), slot_valid.shape[1])
            self.capture.clear()
            if self.selection == "prefill":  # chosen once: nothing more to record or score
                self.capture = self.store = None
            self.visual_time += clock.now() - start
        else:
            visible = torch.zeros_like(self.image_columns) if self.hides_all else self.image_columns
        return slot_valid & (~self.image_columns | visible)

    def _columns(self, width: int) -> torch.Tensor:
        """The visual slots at the runner's current `width` (committed slots come after the prompt's)."""
        columns = self.image_columns
        if columns.shape[1] < width:
            columns = torch.cat([columns, columns.new_zeros(columns.shape[0], width - columns.shape[1])], dim=1)
        return columns

    def _selected_columns(self, queries: dict, width: int) -> torch.Tensor:
        """`(B, width)` True at the visual slots of the M tokens `queries` `{layer: (B, H, D)}` pick."""
        store = self.store
        slots, _ = select_visual_tokens(queries, store, m_per_layer=2 * self.num_visual_tokens,
                                        keep=min(self.num_visual_tokens, store.valid.shape[1]), timed=False)
        # the picked tokens' ranks among each row's visual tokens (the store keeps them in prompt order)
        picked = ((store.positions[:, None, :] == slots[:, :, None]) & (slots[:, :, None] >= 0)).any(1)  # (B, T)
        columns = self._columns(width)
        order = torch.sort(columns.to(torch.int8), dim=1, descending=True, stable=True).indices[:, : picked.shape[1]]
        visible = torch.zeros_like(columns)
        visible.scatter_(1, order, picked & store.valid)
        return visible

    def after_round(self, runner, last_index: torch.Tensor) -> None:
        """`"round"` selection: the query at verification position `last_index` `(B,)` picks the next round's
        tokens; the runner's visual slots follow."""
        if self.capture is None or self.selection != "round" or not self.capture.queries:
            return
        start = clock.now()
        width = runner.slot_valid.shape[1]
        columns = self._columns(width)
        visible = self._selected_columns(self.capture.query_at(last_index), width)
        runner.slot_valid = torch.where(columns, visible, runner.slot_valid)
        self.capture.clear()
        self.visual_time += clock.now() - start

    # ---- rows leaving and joining (between rounds)

    def keep_rows(self, rows: torch.Tensor) -> None:
        if self.image_columns is not None:
            self.image_columns = self.image_columns[rows]
        if self.store is not None:
            self.store = self.store.keep_rows(rows)

    def join(self, other: "VisualView", widths: tuple, rows: tuple) -> None:
        """`other`'s rows follow; the two runners were `widths` wide with `rows` rows, and are right-aligned to the
        wider (`ModelRunner.join`)."""
        if (other.num_visual_tokens, other.selection) != (self.num_visual_tokens, self.selection):
            raise ValueError("drafters with different visual selections cannot join.")
        if self.store is not None or other.store is not None:
            raise NotImplementedError("rows with a per-round visual selection cannot join a running batch.")
        if self.image_columns is None and other.image_columns is None:
            return
        joined = max(widths)
        parts = []
        for view, width, count in zip((self, other), widths, rows):
            columns = (view._columns(width) if view.image_columns is not None
                       else torch.zeros(count, width, dtype=torch.bool, device=view.target.device))
            parts.append(left_pad(columns, joined, 1, False))
        self.image_columns = torch.cat(parts)

    def trim(self, lead: int) -> None:
        """The runner dropped its first `lead` columns."""
        if self.image_columns is not None and lead:
            self.image_columns = self.image_columns[:, lead:]
