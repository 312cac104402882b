"""Uni-LaSpec block-parallel drafter (docs/algorithms.md section 2).

One forward proposes a whole block of `block_size` tokens. The query block is
`[last accepted token, MASK, ..., MASK]` at text positions `p, p+1, ...`; the
keys/values are the block itself plus the target's hidden states at the
accepted positions before `p` (a few target layers, low/mid/high, fused by a
linear layer + RMSNorm). Output position k is the distribution of the token
at position `p + k + 1`, so one pass gives `block_size` next-token
distributions.

Design choices:

* MASK: a learned embedding (`mask_embedding`, in the drafter's hidden
  space) when `config.mask_token_id is None` (default); otherwise the
  target's embedding of `mask_token_id` (DFlash-style, no extra parameter).
  Either way, only column 0 of `input_ids` is read: every later block
  position is a MASK, whatever id the caller put there.
* Block attention: causal within the block, full over the (valid) context.
  A block position never sees later positions, so the prediction at depth k
  does not depend on how long the block is: the load-adaptive loop can run
  a shorter block (a truncated "dynamic head") and get exactly the same
  first predictions, and training with any block size matches inference.
  Bidirectional MASK-to-MASK attention would add nothing the context does
  not already give (every MASK carries the same embedding).
* Context visibility: a context slot is visible to the block iff its
  `context_mask` is True and its position is strictly before the block's
  first position. A training batch may therefore share one full-sequence
  context between rows with different block anchors.
* Previous-state fusion (`fuse_previous_state`, EAGLE-style): every block
  position's input also gets `previous_proj(c_{p-1})`, the encoded target
  state at the position just before the block's first token. That state is
  what the target computed last; without fusion the block reaches it only
  through attention, and a 1-layer drafter's query (the root token alone)
  does not know what to look for. Blocks anchored at position 0 get zeros.
* Vision: after each layer's self-attention, a gated cross-attention to the
  selected visual tokens, `h <- h + tanh(g) * CrossAttn(RMSNorm(h), V_sel)`,
  with one scalar gate `g` per layer initialised to 0: an untrained gate
  leaves the drafter's output bit-for-bit unchanged.
* Embedding and LM head: the TARGET's own frozen modules, attached with
  `attach_target` as plain references (never registered as sub-modules), so
  `save_pretrained` does not store them and `from_pretrained` does not
  expect them. Gradients flow through them to the drafter, never into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from .configuration import LaSpecDrafterConfig
from .context import ContextKV
from .layers import LaSpecDecoderLayer, LaSpecRMSNorm, rope_cos_sin
from .target import TargetModules, fixed_head
from .vocabulary import DraftVocabulary

__all__ = ["LaSpecDrafterModel", "LaSpecDrafterOutput", "register_auto_classes"]


@dataclass
class LaSpecDrafterOutput(ModelOutput):
    """Output of [`LaSpecDrafterModel`].

    Args:
        logits (`torch.FloatTensor` of shape `(B, L, V)`): position k is the distribution of the token at
            text position `position_ids[:, 0] + k + 1`.
        hidden_states (tuple of `torch.FloatTensor` of shape `(B, L, hidden_size)`, *optional*): the block
            after the input embedding and after each layer (before the final norm).
        last_hidden_state (`torch.FloatTensor` of shape `(B, L, target_hidden_size)`): what the target's LM head
            reads (after the final norm and the output projection); [`LaSpecDrafterModel.logits_from_hidden`]
            maps any subset of it to logits.
    """

    logits: torch.FloatTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    last_hidden_state: torch.FloatTensor | None = None


class LaSpecDrafterModel(TargetModules, DraftVocabulary, PreTrainedModel):
    r"""Block-parallel LaSpec drafter over the target's hidden states (see the module docstring).

    Its embedding and LM head are the target's, attached with [`attach_target`] after loading.

    Examples:
        >>> config = LaSpecDrafterConfig.for_target(target, block_size=4)  # doctest: +SKIP
        >>> drafter = LaSpecDrafterModel(config).attach_target(target)  # doctest: +SKIP
        >>> out = target(input_ids, output_hidden_states=True)  # doctest: +SKIP
        >>> context = gather_target_hidden(out.hidden_states, config.target_layer_ids)  # doctest: +SKIP
        >>> block, positions = make_block_inputs(input_ids[:, -1], torch.tensor([n - 1]), 4)  # doctest: +SKIP
        >>> logits = drafter(block, context[:, :-1], position_ids=positions).logits  # (1, 4, V)  # doctest: +SKIP
    """

    config_class = LaSpecDrafterConfig
    base_model_prefix = "drafter"
    main_input_name = "input_ids"
    _no_split_modules = ["LaSpecDecoderLayer"]
    supports_gradient_checkpointing = False

    def __init__(self, config: LaSpecDrafterConfig):
        super().__init__(config)
        num_fused = len(config.target_layer_ids)
        self.context_proj = nn.Linear(num_fused * config.target_hidden_size, config.hidden_size, bias=False)
        self.context_norm = LaSpecRMSNorm(config.hidden_size, config.rms_norm_eps)
        needs_proj = config.target_hidden_size != config.hidden_size
        self.input_proj = nn.Linear(config.target_hidden_size, config.hidden_size, bias=False) if needs_proj else None
        self.output_proj = nn.Linear(config.hidden_size, config.target_hidden_size, bias=False) if needs_proj else None
        self.mask_embedding = nn.Parameter(torch.zeros(config.hidden_size)) if config.mask_token_id is None else None
        fuse = config.fuse_previous_state
        self.previous_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False) if fuse else None
        self.layers = nn.ModuleList(LaSpecDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LaSpecRMSNorm(config.hidden_size, config.rms_norm_eps)
        vocab = None if config.draft_vocab_size is None else torch.arange(config.draft_vocab_size)
        self.register_buffer("draft_vocab", vocab)  # None: the full vocabulary (a None buffer is not saved)
        # the target's (embedding, lm_head): plain references, never sub-modules (not saved, not moved)
        self.__dict__["_target_modules"] = None
        self.__dict__["datastore"] = None  # TokenDatastore or None: saved beside the weights (`datastore.safetensors`)
        self.post_init()

    # ---- datastore (`hf_adaptive_spec.drafters.datastore`): saved and loaded with the weights

    def set_datastore(self, datastore) -> LaSpecDrafterModel:
        """Carry a [`TokenDatastore`] (or `None`): the `laspec` strategy then adds its proposal to greedy trees, and
        `save_pretrained` writes it as `datastore.safetensors` beside the weights. Returns `self`."""
        from ..datastore import TokenDatastore

        if datastore is not None and not isinstance(datastore, TokenDatastore):
            raise ValueError(f"set_datastore needs a TokenDatastore or None, got {type(datastore).__name__}.")
        if datastore is not None and len(datastore) and int(datastore.tokens.max()) >= self.config.vocab_size:
            raise ValueError(f"The datastore holds token id {int(datastore.tokens.max())}, outside this drafter's "
                             f"{self.config.vocab_size}-token vocabulary.")
        self.__dict__["datastore"] = datastore
        return self

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, plus the datastore (if any) as `datastore.safetensors`; a stale
        datastore file of an earlier save is removed when this drafter has none."""
        from ..datastore import DATASTORE_FILE

        result = super().save_pretrained(save_directory, *args, **kwargs)
        path = Path(save_directory) / DATASTORE_FILE
        if self.datastore is not None:
            self.datastore.save(path)
        elif path.exists():
            path.unlink()
        return result

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, plus the folder's (or Hub repo's) `datastore.safetensors` when it
        has one (`model.datastore`, else `None`)."""
        from ..datastore import DATASTORE_FILE, TokenDatastore

        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        local = Path(str(pretrained_model_name_or_path)).expanduser()
        if local.is_dir():
            path = local / kwargs.get("subfolder", "") / DATASTORE_FILE
            path = path if path.exists() else None
        else:
            from transformers.utils import cached_file

            hub = {key: kwargs[key] for key in ("cache_dir", "revision", "token", "local_files_only", "subfolder")
                   if key in kwargs}
            path = cached_file(pretrained_model_name_or_path, DATASTORE_FILE,
                               _raise_exceptions_for_missing_entries=False, **hub)
        if path is not None:
            model.set_datastore(TokenDatastore.load(path))
        return model

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, LaSpecDecoderLayer):
            init.zeros_(module.visual_gate)
        elif isinstance(module, LaSpecDrafterModel) and module.mask_embedding is not None:
            init.normal_(module.mask_embedding, mean=0.0, std=self.config.initializer_range)

    # ---- forward

    def _embed_block(self, input_ids: torch.Tensor, embedding: nn.Module, dtype: torch.dtype,
                     block_length: int) -> torch.Tensor:
        """(B, L) ids -> (B, L, hidden): each block's first column embedded by the target, the others MASK."""
        batch, length = input_ids.shape
        is_first = (torch.arange(length, device=input_ids.device) % block_length) == 0  # (L,)
        with torch.no_grad():  # frozen target embedding
            mask_id = 0 if self.mask_embedding is not None else self.config.mask_token_id  # MASK columns are not read
            ids = torch.where(is_first, input_ids, mask_id)
            embedded = embedding(ids).to(dtype)  # (B, L, target_hidden)
        if self.input_proj is not None:
            embedded = self.input_proj(embedded)
        if self.mask_embedding is None:
            return embedded
        return torch.where(is_first[None, :, None], embedded, self.mask_embedding.to(dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        target_hidden: torch.Tensor,
        context_mask: torch.Tensor | None = None,
        visual_embeds: torch.Tensor | None = None,
        visual_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        context_position_ids: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        previous_state: torch.Tensor | None = None,
    ) -> LaSpecDrafterOutput:
        r"""Draft one block.

        Args:
            input_ids (`torch.LongTensor` of shape `(B, L)`): `[last accepted token, MASK, ...]`; only column 0 is
                read (every later column is a MASK).
            target_hidden (`torch.FloatTensor` of shape `(B, C, len(target_layer_ids) * target_hidden_size)`): the
                target's hidden states at C context positions ([`gather_target_hidden`]).
            context_mask (`torch.BoolTensor` of shape `(B, C)`, *optional*): False for padding context slots.
            visual_embeds (`torch.FloatTensor` of shape `(B, M, vision_hidden_size)`, *optional*): the selected
                visual tokens' embeddings; without them the cross-attention branches are skipped.
            visual_mask (`torch.BoolTensor` of shape `(B, M)`, *optional*): False for padding visual tokens.
            position_ids (`torch.LongTensor` of shape `(B, L)`, *optional*): text positions of the block; default
                `C + arange(L)`.
            context_position_ids (`torch.LongTensor` of shape `(B, C)`, *optional*): text positions of the context;
                default `arange(C)`. Only slots with a position before `position_ids[:, 0]` are visible.
            output_hidden_states (`bool`): also return the per-layer block states.
            previous_state (`torch.FloatTensor` of shape `(B, hidden_size)`, *optional*): with
                `config.fuse_previous_state`, the ENCODED state before the block (default: taken from the context).

        Returns:
            [`LaSpecDrafterOutput`] with `logits` of shape `(B, L, vocab_size)`.
        """
        expected = len(self.config.target_layer_ids) * self.config.target_hidden_size
        if target_hidden.dim() != 3 or target_hidden.shape[0] != input_ids.shape[0] or target_hidden.shape[-1] != expected:
            raise ValueError(
                f"target_hidden must have shape (batch={input_ids.shape[0]}, context, {expected}) = "
                f"len(target_layer_ids) * target_hidden_size; got {tuple(target_hidden.shape)}."
            )
        return self.forward_block(
            input_ids, self.encode_context(target_hidden), context_mask=context_mask, visual_embeds=visual_embeds,
            visual_mask=visual_mask, position_ids=position_ids, context_position_ids=context_position_ids,
            output_hidden_states=output_hidden_states, previous_state=previous_state,
        )

    def encode_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Fused target states `(B, C, len(target_layer_ids) * target_hidden_size)` -> drafter context
        `(B, C, hidden_size)` (linear + RMSNorm). Per position, so a decoding loop encodes each state once."""
        dtype = self.context_proj.weight.dtype
        return self.context_norm(self.context_proj(target_hidden.to(dtype)))

    def context_part(self, part: int, target_hidden: torch.Tensor) -> torch.Tensor:
        """`context_proj` of one fused layer's states alone, `(B, C, target_hidden_size)` -> `(B, C, hidden_size)`:
        the sum over the parts is `context_proj` of their concatenation (up to float rounding), so a long prompt's
        layers can be fused as they are read (`encode_context_sum`) instead of held until all are there."""
        width = self.config.target_hidden_size
        weight = self.context_proj.weight[:, part * width: (part + 1) * width]
        return F.linear(target_hidden.to(weight.dtype), weight)

    def encode_context_sum(self, projected: torch.Tensor) -> torch.Tensor:
        """The drafter context from the sum of every part's `context_part` (`encode_context` of the fusion)."""
        return self.context_norm(projected)

    @torch.no_grad()
    def context_kv(self, context: torch.Tensor, context_position_ids: torch.Tensor) -> ContextKV:
        """Every layer's keys/values of an encoded context `(B, C, hidden_size)` at text positions `(B, C)`:
        pass the result as `context` to [`forward_block`] (the same output, without re-projecting it)."""
        rope = rope_cos_sin(context_position_ids, self.config.head_dim, self.config.rope_theta, context.dtype)
        pairs = [layer.self_attn.context_kv(context, rope) for layer in self.layers]
        return ContextKV([keys for keys, _ in pairs], [values for _, values in pairs])

    def forward_block(
        self,
        input_ids: torch.Tensor,
        context,
        context_mask: torch.Tensor | None = None,
        visual_embeds: torch.Tensor | None = None,
        visual_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        context_position_ids: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        block_length: int | None = None,
        output_logits: bool = True,
        previous_state: torch.Tensor | None = None,
    ) -> LaSpecDrafterOutput:
        """[`forward`] with an already encoded context `(B, C, hidden_size)` ([`encode_context`]), or its keys and
        values ([`ContextKV`] from [`context_kv`], at `context_position_ids`): the decoding loop's form.

        `block_length` (default: L, one block) splits the L query positions into consecutive blocks of that
        length, each with its own anchor (its first column's token and position): a block sees the context
        before its own first position and, causally, itself only. Training runs every anchor of a sequence in
        one row this way; the result per block equals a separate one-block call.

        With several blocks, `visual_embeds` may also hold one visual set per block, `(B, L // block_length, M,
        vision_hidden_size)` with `visual_mask` `(B, L // block_length, M)`: training gives each anchor the
        visual tokens the decoding loop would have selected for it.

        `output_logits=False` skips the LM head (`logits` is None): a trainer that needs the logits at a few
        positions only maps those rows of `last_hidden_state` with [`logits_from_hidden`].

        `previous_state` (`(B, hidden_size)`, or `(B, L // block_length, hidden_size)` one per block), used only with
        `config.fuse_previous_state`: the encoded context at the position before each block's first token (zeros
        where there is none). With a context tensor it defaults to the matching context slot; with a
        [`ContextKV`] it must be given (a decoding loop keeps the last committed state).
        """
        embedding, lm_head = self.target_modules()
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (batch, block); got {tuple(input_ids.shape)}.")
        batch, length = input_ids.shape
        precomputed = isinstance(context, ContextKV)
        num_context = self._context_length(context, batch)
        if precomputed and context_position_ids is None:
            raise ValueError("forward_block with a ContextKV needs the context_position_ids it was built at.")
        device, dtype = input_ids.device, self.context_proj.weight.dtype
        if position_ids is None:
            position_ids = (num_context + torch.arange(length, device=device)).expand(batch, -1)
        if context_position_ids is None:
            context_position_ids = torch.arange(num_context, device=device).expand(batch, -1)
        if context_mask is None:
            context_mask = torch.ones(batch, num_context, dtype=torch.bool, device=device)
        block_length = length if block_length is None else block_length
        if block_length < 1 or length % block_length:
            raise ValueError(f"block_length ({block_length}) must divide the query length ({length}).")
        if visual_embeds is not None:
            visual_embeds, visual_mask = self._visual_inputs(visual_embeds, visual_mask, batch, length // block_length,
                                                             dtype, device)
        hidden = self._embed_block(input_ids, embedding, dtype, block_length)  # (B, L, hid)
        block_of = torch.arange(length, device=device) // block_length  # (L,)
        if self.previous_proj is not None:
            previous = self._previous_state(previous_state, context, context_mask, context_position_ids,
                                            position_ids[:, ::block_length], dtype)  # (B, nb, hid)
            hidden = hidden + self.previous_proj(previous).repeat_interleave(block_length, dim=1)
        elif previous_state is not None:
            raise ValueError("previous_state is only read by a drafter with config.fuse_previous_state=True.")
        allowed = self._block_attention(context_mask, context_position_ids, position_ids, block_of, block_length,
                                        batch)
        hidden, all_hidden = self._layers_and_norm(hidden, context, position_ids, context_position_ids, allowed,
                                                   visual_embeds, visual_mask, dtype, output_hidden_states)
        logits = fixed_head(hidden, lm_head) if output_logits else None  # (B, L, V)
        return LaSpecDrafterOutput(logits=logits, hidden_states=all_hidden, last_hidden_state=hidden)

    def _layers_and_norm(self, hidden, context, position_ids, context_position_ids, allowed, visual_embeds,
                         visual_mask, dtype: torch.dtype, output_hidden_states: bool):
        """`(hidden, all_hidden)`: the block `(B, L, hidden_size)` through every layer (rotary tables in `dtype`),
        the final norm and the output projection (what the LM head reads), and the block after the embedding and
        each layer (None unless `output_hidden_states`)."""
        precomputed = isinstance(context, ContextKV)
        block_rope = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, dtype)
        context_rope = None if precomputed else rope_cos_sin(context_position_ids, self.config.head_dim,
                                                               self.config.rope_theta, dtype)
        all_hidden = (hidden,) if output_hidden_states else None
        for index, layer in enumerate(self.layers):
            layer_context = (context.keys[index], context.values[index]) if precomputed else context
            hidden = layer(hidden, layer_context, block_rope, context_rope, allowed, visual_embeds, visual_mask)
            if output_hidden_states:
                all_hidden += (hidden,)
        hidden = self.norm(hidden)
        if self.output_proj is not None:
            hidden = self.output_proj(hidden)
        return hidden, all_hidden

    def _context_length(self, context, batch: int) -> int:
        """The number of context slots C of an encoded context `(B, C, hidden_size)` or a [`ContextKV`], checked
        against the batch (and the layers)."""
        if isinstance(context, ContextKV):
            if context.batch_size != batch or len(context.keys) != len(self.layers):
                raise ValueError(f"context (ContextKV) must hold batch {batch} and {len(self.layers)} layers; got "
                                 f"batch {context.batch_size} and {len(context.keys)} layers.")
            return context.length
        if context.dim() != 3 or context.shape[0] != batch or context.shape[-1] != self.config.hidden_size:
            raise ValueError(f"context must have shape (batch={batch}, C, hidden_size={self.config.hidden_size}); "
                             f"got {tuple(context.shape)}.")
        return context.shape[1]

    def _visual_inputs(self, visual_embeds, visual_mask, batch: int, num_blocks: int, dtype: torch.dtype, device):
        """`(visual_embeds, visual_mask)` checked (one set per row, or one per block) and cast: the embeddings to
        `dtype`, the mask (default: every token) to bool."""
        if self.config.num_visual_tokens == 0:
            raise ValueError("visual_embeds given to a text-only drafter (config.num_visual_tokens == 0: built "
                             "without the visual branch).")
        per_block = visual_embeds.dim() == 4
        if (visual_embeds.dim() not in (3, 4) or visual_embeds.shape[0] != batch
                or visual_embeds.shape[-1] != self.config.vision_hidden_size
                or (per_block and visual_embeds.shape[1] != num_blocks)):
            raise ValueError(
                f"visual_embeds must have shape (batch={batch}, M, vision_hidden_size="
                f"{self.config.vision_hidden_size}), or (batch, blocks={num_blocks}, M, vision_hidden_size) for "
                f"one set per block; got {tuple(visual_embeds.shape)}."
            )
        visual_embeds = visual_embeds.to(dtype)
        if visual_mask is None:
            visual_mask = torch.ones(visual_embeds.shape[:-1], dtype=torch.bool, device=device)
        return visual_embeds, visual_mask.bool()

    @staticmethod
    def _block_attention(context_mask, context_position_ids, position_ids, block_of, block_length,
                         batch: int) -> torch.Tensor:
        """`(B, 1, L, C + L)` bool over keys `[context (C) ; block (L)]`: valid context strictly before each
        query's block, causal inside its block (`block_of` `(L,)`: each query's block)."""
        length = block_of.shape[0]
        anchor = position_ids[:, block_of * block_length]  # (B, L): each query's block start
        context_visible = context_mask.bool()[:, None, :] & (context_position_ids[:, None, :] < anchor[..., None])
        same_block = block_of[:, None] == block_of[None, :]
        causal = torch.ones(length, length, dtype=torch.bool, device=block_of.device).tril() & same_block  # (L, L)
        return torch.cat([context_visible, causal.expand(batch, length, length)], dim=-1)[:, None]

    def _previous_state(self, previous_state, context, context_mask, context_position_ids, anchors, dtype):
        """`(B, nb, hidden)`: the encoded context at position `anchor - 1` of each block (zeros if absent)."""
        batch, num_blocks = anchors.shape
        if previous_state is None:
            if isinstance(context, ContextKV):
                raise ValueError("A drafter with fuse_previous_state needs previous_state with a ContextKV context "
                                 "(the encoded state at the position before the block).")
            match = context_mask.bool()[:, None, :] & (context_position_ids[:, None, :] == anchors[..., None] - 1)
            return torch.bmm(match.to(context.dtype), context).to(dtype)  # (B, nb, C) @ (B, C, hid)
        if previous_state.dim() == 2:
            previous_state = previous_state[:, None].expand(-1, num_blocks, -1)
        if previous_state.shape != (batch, num_blocks, self.config.hidden_size):
            raise ValueError(f"previous_state must have shape (batch={batch}, hidden_size={self.config.hidden_size}) "
                             f"or (batch, blocks={num_blocks}, hidden_size); got {tuple(previous_state.shape)}.")
        return previous_state.to(dtype)


def register_auto_classes() -> None:
    """Register the drafter with `AutoConfig` / `AutoModel` (idempotent: safe to call more than once)."""
    AutoConfig.register(LaSpecDrafterConfig.model_type, LaSpecDrafterConfig, exist_ok=True)
    AutoModel.register(LaSpecDrafterConfig, LaSpecDrafterModel, exist_ok=True)
