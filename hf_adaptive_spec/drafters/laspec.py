"""Uni-LaSpec block-parallel drafter (PAPERS.md section 2).

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

import contextlib
import contextvars
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from ..ops import cpu_linear, tensor_version
from .configuration_laspec import LaSpecDrafterConfig, default_target_layer_ids

__all__ = [
    "ContextKV",
    "LaSpecDrafterConfig",
    "LaSpecDrafterModel",
    "LaSpecDrafterOutput",
    "register_auto_classes",
    "default_target_layer_ids",
    "gather_target_hidden",
    "make_block_inputs",
]


def spread_to_vocabulary(scores: torch.Tensor, vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Scores `(..., V')` over a draft vocabulary `vocab` `(V',)` (token ids) spread to the whole vocabulary
    `(..., vocab_size)`, -inf elsewhere; returned as is when `vocab` is None."""
    if vocab is None:
        return scores
    full = scores.new_full((*scores.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, vocab, scores)


def gather_target_hidden(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the outputs of the chosen target layers.

    Args:
        hidden_states (tuple of `torch.Tensor` of shape `(B, S, H)`): `outputs.hidden_states` of a target
            forward with `output_hidden_states=True` (entry 0 = embeddings, entry l + 1 = layer l).
        layer_ids (`list[int]`): target decoder-layer indices (`config.target_layer_ids`).

    Returns:
        `torch.Tensor` of shape `(B, S, len(layer_ids) * H)`.
    """
    return torch.cat([hidden_states[layer + 1] for layer in layer_ids], dim=-1)


def make_block_inputs(
    last_token: torch.Tensor, last_position: torch.Tensor, block_size: int, mask_token_id: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block `[last accepted token, MASK, ...]` and its positions.

    Args:
        last_token (`torch.LongTensor` of shape `(B,)`): the last accepted (or bonus) token per row.
        last_position (`torch.LongTensor` of shape `(B,)`): its text position.
        block_size (`int`): block length.
        mask_token_id (`int`, *optional*): id written in the MASK columns (0 if None; never read).

    Returns:
        `(input_ids, position_ids)`, both `(B, block_size)`.
    """
    offsets = torch.arange(block_size, device=last_token.device)
    input_ids = torch.full((last_token.shape[0], block_size), mask_token_id or 0, dtype=torch.long,
                           device=last_token.device)
    input_ids[:, 0] = last_token
    position_ids = last_position[:, None] + offsets  # (B, block)
    return input_ids, position_ids


# --------------------------------------------------------------------------- modules


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


def _rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin of shape (B, 1, L, head_dim) for plain 1D RoPE (computed on the fly, no buffer)."""
    exponent = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)  # (D/2,)
    freqs = position_ids.float()[..., None] * inv_freq  # (B, L, D/2)
    angles = torch.cat([freqs, freqs], dim=-1)  # (B, L, D)
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
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
        keys = _apply_rope(self._heads(self.k_proj(context), self.num_kv_heads), *context_rope)
        return keys, self._heads(self.v_proj(context), self.num_kv_heads)

    def forward(self, hidden, context, block_rope, context_rope, allowed):
        # hidden (B, L, hid), context (B, C, hid) or its precomputed (keys, values); allowed (B, 1, L, C + L) bool
        batch, length, _ = hidden.shape
        query = _apply_rope(self._heads(self.q_proj(hidden), self.num_heads), *block_rope)  # (B, H, L, D)
        context_keys, context_values = context if isinstance(context, tuple) else self.context_kv(context, context_rope)
        keys = torch.cat([context_keys, _apply_rope(self._heads(self.k_proj(hidden), self.num_kv_heads), *block_rope)],
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



# the target modules a drafter uses in this context's decoding call: id(drafter) -> (embedding, lm_head)
_CALL_TARGETS = contextvars.ContextVar("hf_adaptive_spec_call_targets", default=None)


@contextlib.contextmanager
def attached_for_call(drafter, target):
    """Inside the block, in this context only, `drafter` uses `target`'s embedding and LM head, whatever it is
    attached to (nothing, another target): the drafter object itself is never changed, so other threads using
    it, and the caller after the block, see it as it was."""
    modules = drafter._checked_target_modules(target)
    token = _CALL_TARGETS.set({**(_CALL_TARGETS.get() or {}), id(drafter): modules})
    try:
        yield drafter
    finally:
        _CALL_TARGETS.reset(token)


# the draft vocabulary's LM-head rows (and their bf16 copy) of each drafter, for one decoding call
_DRAFT_HEADS = contextvars.ContextVar("hf_adaptive_spec_draft_heads", default=None)


@contextlib.contextmanager
def draft_head_cache():
    """Inside the block, `draft_vocab_logits` gathers the draft vocabulary's LM-head rows once per drafter
    (again if the head changes) instead of on every call; the rows are dropped with the block, never kept on
    the drafter."""
    token = _DRAFT_HEADS.set({})
    try:
        yield
    finally:
        _DRAFT_HEADS.reset(token)

@dataclass
class ContextKV:
    """The context's keys (post-RoPE) and values in every drafter layer, `(B, H_kv, C, D)` each.

    Every round of a decoding loop would recompute them from the same encoded context; a loop builds them
    once per committed position ([`LaSpecDrafterModel.context_kv`]) and extends them ([`extend`]).
    """

    keys: list
    values: list

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    def keep_rows(self, rows: torch.Tensor) -> ContextKV:
        return ContextKV([k[rows] for k in self.keys], [v[rows] for v in self.values])

    def extend(self, other: ContextKV) -> ContextKV:
        return ContextKV([torch.cat([a, b], dim=2) for a, b in zip(self.keys, other.keys)],
                         [torch.cat([a, b], dim=2) for a, b in zip(self.values, other.values)])


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


def _readable(lm_head: nn.Module) -> bool:
    """Whether `lm_head` is an `nn.Linear` whose weight can be read directly: a plain tensor, not on the meta
    device, and no accelerate hook (which brings offloaded weights in and moves inputs only around a call). A
    tensor-parallel head holds a shard (a DTensor); such heads are called as modules instead."""
    if not isinstance(lm_head, nn.Linear) or getattr(lm_head, "_hf_hook", None) is not None:
        return False
    weight = lm_head.weight
    return type(weight) in (torch.Tensor, nn.Parameter) and weight.device.type != "meta"


class LaSpecDrafterModel(PreTrainedModel):
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
        from .datastore import TokenDatastore

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
        from .datastore import DATASTORE_FILE

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
        from .datastore import DATASTORE_FILE, TokenDatastore

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

    # ---- target modules

    def attach_target(self, target) -> LaSpecDrafterModel:
        """Use `target`'s input embedding and LM head (frozen, not stored in this model's checkpoint).

        Args:
            target (`PreTrainedModel`): the verifier (LM or VLM); its text vocabulary must match `config.vocab_size`.

        Returns:
            `self`, for chaining.
        """
        self.__dict__["_target_modules"] = self._checked_target_modules(target)
        return self

    def _checked_target_modules(self, target) -> tuple:
        """`(embedding, lm_head)` of `target`, checked against this drafter's config."""
        embedding, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        if embedding is None or lm_head is None:
            raise ValueError("attach_target needs a target with both input embeddings and an LM head.")
        if embedding.weight.shape[1] != self.config.target_hidden_size:
            raise ValueError(
                f"The target's embedding width {embedding.weight.shape[1]} differs from "
                f"config.target_hidden_size={self.config.target_hidden_size}."
            )
        if lm_head.weight.shape[0] != self.config.vocab_size:
            raise ValueError(
                f"The target's LM head has {lm_head.weight.shape[0]} outputs but config.vocab_size="
                f"{self.config.vocab_size}."
            )
        return embedding, lm_head

    def detach_target(self) -> None:
        """Drop the references to the target's modules."""
        self.__dict__["_target_modules"] = None

    def _target_pair(self):
        """The target's (embedding, lm_head): those of the calling context's decoding call (`attached_for_call`),
        else those set by `attach_target`, else None."""
        called = _CALL_TARGETS.get()
        if called is not None and id(self) in called:
            return called[id(self)]
        return self.__dict__.get("_target_modules")

    @property
    def has_target(self) -> bool:
        return self._target_pair() is not None

    def _target(self):
        modules = self._target_pair()
        if modules is None:
            raise RuntimeError(
                "LaSpecDrafterModel has no token embedding / LM head: they are the target's own modules and are "
                "not stored in the drafter checkpoint. Call `drafter.attach_target(target_model)` first."
            )
        return modules

    def get_input_embeddings(self):
        modules = self._target_pair()
        return None if modules is None else modules[0]

    def get_output_embeddings(self):
        modules = self._target_pair()
        return None if modules is None else modules[1]

    def set_input_embeddings(self, value):
        raise NotImplementedError("The drafter uses the target's embedding: call attach_target(target).")

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

    def set_draft_vocabulary(self, token_ids) -> LaSpecDrafterModel:
        """Draft over `token_ids` only (e.g. the target's most frequent tokens, [`~hf_adaptive_spec.training.data.
        frequent_tokens`]); `None` restores the full vocabulary. Saved with the model (`draft_vocab` buffer)."""
        if token_ids is not None:
            token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
            if token_ids.numel() == 0 or int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size:
                raise ValueError(f"draft vocabulary ids must be non-empty and lie in [0, {self.config.vocab_size}).")
            if token_ids.unique().numel() != token_ids.numel():
                raise ValueError("draft vocabulary ids must be distinct.")
            token_ids = token_ids.to(self.context_proj.weight.device)
        self.draft_vocab = token_ids  # a registered buffer: saved with the model unless None
        self.config.draft_vocab_size = None if token_ids is None else int(token_ids.numel())
        return self

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Decoding-time logits `(..., vocab_size)` from `last_hidden_state`: with a draft vocabulary, only its
        rows of the LM head are computed (a cached copy) and every other token gets -inf."""
        if self.draft_vocab is None:
            return self.logits_from_hidden(hidden)
        return spread_to_vocabulary(self.draft_vocab_logits(hidden), self.draft_vocab, self.config.vocab_size)

    def draft_vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary only, `(..., draft_vocab_size)` in `draft_vocab` order: the LM head's
        rows of those tokens (held fixed; gradients reach `hidden` only). Training on them costs a fraction of
        the full head and matches decoding, where no other token can be drafted."""
        if self.draft_vocab is None:
            raise ValueError("draft_vocab_logits needs a draft vocabulary (set_draft_vocabulary).")
        lm_head = self._target()[1]
        if not _readable(lm_head):  # offloaded or sharded: the module's own forward, then the draft columns
            logits = lm_head(hidden)
            return logits[..., self.draft_vocab.to(logits.device)]
        weight = lm_head.weight
        key = (weight.data_ptr(), weight.device, weight.dtype, tensor_version(weight), self.draft_vocab.data_ptr())
        holder = _DRAFT_HEADS.get()  # inside `draft_head_cache` (a decoding call): id(self) -> cached rows
        cached = None if holder is None else holder.get(id(self))
        if cached is None or cached[0] != key:
            rows = weight.detach()[self.draft_vocab]
            bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.detach()[self.draft_vocab]
            cached = (key, rows, bias, {})  # {}: the bf16 copy the decoding loop's CPU kernel may read
            if holder is not None:
                holder[id(self)] = cached
        _, rows, bias, compact = cached
        # F.linear outside the decoding loop; inside it on a CPU, the small-batch kernel over a bf16 copy
        return cpu_linear.compact_linear(hidden.to(rows.dtype), rows, bias, compact, self)

    def draft_vocab_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Each token's index in the draft vocabulary, -1 for tokens outside it (same shape as `token_ids`;
        -100 labels stay -1)."""
        if self.draft_vocab is None:
            raise ValueError("draft_vocab_index needs a draft vocabulary (set_draft_vocabulary).")
        lookup = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=token_ids.device)
        lookup[self.draft_vocab.to(token_ids.device)] = torch.arange(self.draft_vocab.numel(), device=token_ids.device)
        return torch.where(token_ids >= 0, lookup[token_ids.clamp_min(0)], -1)

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head (held fixed) over `last_hidden_state` rows `(..., target_hidden_size)`."""
        return self._lm_head(hidden, self._target()[1])

    def _lm_head(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Target LM head with its weights held fixed (gradients reach `hidden` only)."""
        if _readable(lm_head):
            weight = lm_head.weight.detach()
            bias = None if lm_head.bias is None else lm_head.bias.detach()
            return cpu_linear.linear(hidden.to(weight.dtype), weight, bias)
        return lm_head(hidden)

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
        rope = _rope_cos_sin(context_position_ids, self.config.head_dim, self.config.rope_theta, context.dtype)
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
        embedding, lm_head = self._target()
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (batch, block); got {tuple(input_ids.shape)}.")
        batch, length = input_ids.shape
        precomputed = isinstance(context, ContextKV)
        if precomputed:
            if context.batch_size != batch or len(context.keys) != len(self.layers):
                raise ValueError(f"context (ContextKV) must hold batch {batch} and {len(self.layers)} layers; got "
                                 f"batch {context.batch_size} and {len(context.keys)} layers.")
            if context_position_ids is None:
                raise ValueError("forward_block with a ContextKV needs the context_position_ids it was built at.")
            num_context = context.length
        else:
            if context.dim() != 3 or context.shape[0] != batch or context.shape[-1] != self.config.hidden_size:
                raise ValueError(f"context must have shape (batch={batch}, C, hidden_size={self.config.hidden_size}); "
                                 f"got {tuple(context.shape)}.")
            num_context = context.shape[1]
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
            num_blocks = length // block_length
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
            visual_mask = visual_mask.bool()
        hidden = self._embed_block(input_ids, embedding, dtype, block_length)  # (B, L, hid)
        block_of = torch.arange(length, device=device) // block_length  # (L,)
        anchor = position_ids[:, block_of * block_length]  # (B, L): each query's block start
        if self.previous_proj is not None:
            previous = self._previous_state(previous_state, context, context_mask, context_position_ids,
                                            position_ids[:, ::block_length], dtype)  # (B, nb, hid)
            hidden = hidden + self.previous_proj(previous).repeat_interleave(block_length, dim=1)
        elif previous_state is not None:
            raise ValueError("previous_state is only read by a drafter with config.fuse_previous_state=True.")

        # keys = [context (C) ; block (L)]: valid context strictly before the block, causal inside the block
        context_visible = context_mask.bool()[:, None, :] & (context_position_ids[:, None, :] < anchor[..., None])
        same_block = block_of[:, None] == block_of[None, :]
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril() & same_block  # (L, L)
        allowed = torch.cat([context_visible, causal.expand(batch, length, length)], dim=-1)[:, None]  # (B,1,L,C+L)
        block_rope = _rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, dtype)
        context_rope = None if precomputed else _rope_cos_sin(context_position_ids, self.config.head_dim,
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
        logits = self._lm_head(hidden, lm_head) if output_logits else None  # (B, L, V)
        return LaSpecDrafterOutput(logits=logits, hidden_states=all_hidden, last_hidden_state=hidden)

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
