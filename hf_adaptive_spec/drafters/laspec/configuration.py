"""Configuration of the LaSpec block drafter (`drafters.laspec.LaSpecDrafterModel`)."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from ...adapters.compat import text_config

__all__ = ["LaSpecDrafterConfig", "default_target_layer_ids"]


@strict
class LaSpecDrafterConfig(PreTrainedConfig):
    r"""Configuration of a [`LaSpecDrafterModel`].

    Args:
        hidden_size (`int`, defaults to 256): width of the drafter's residual stream.
        num_hidden_layers (`int`, defaults to 1): drafter transformer layers (1-2).
        num_attention_heads (`int`, defaults to 4): query heads.
        num_key_value_heads (`int`, *optional*): key/value heads (GQA); defaults to `num_attention_heads`.
        head_dim (`int`, *optional*): defaults to `hidden_size // num_attention_heads`.
        intermediate_size (`int`, defaults to 688): SwiGLU MLP width.
        rms_norm_eps (`float`, defaults to 1e-6).
        vocab_size (`int`, defaults to 32000): the TARGET's vocabulary size (its LM head's output size).
        target_hidden_size (`int`, *optional*): the target's text hidden size (its embedding width);
            defaults to `hidden_size`. When it differs from `hidden_size`, linear projections map the
            target's embeddings in and the drafter's states out to the target's LM head.
        target_layer_ids (`list[int]`, *optional*): target decoder-layer indices whose outputs are fused
            (output of layer `l` is `hidden_states[l + 1]` of a forward with `output_hidden_states=True`).
            Defaults to `[0]`; use [`default_target_layer_ids`] (low/mid/high) or
            [`LaSpecDrafterConfig.for_target`].
        block_size (`int`, defaults to 4): tokens drafted per forward (B).
        mask_token_id (`int`, *optional*): if set, MASK positions use the target's embedding of this id;
            if `None` (default) a learned mask embedding is used.
        num_visual_tokens (`int`, defaults to 8): visual tokens the drafter attends to (M); 0 builds a text-only
            drafter without the visual branch.
        vision_hidden_size (`int`, *optional*): width of the visual embeddings fed to the cross-attention;
            defaults to `target_hidden_size`.
        rope_theta (`float`, defaults to 10000.0): base of the drafter's plain 1D RoPE.
        max_position_embeddings (`int`, defaults to 4096): informational (RoPE is computed on the fly).
        target_model_name (`str`, *optional*): the target this drafter was trained for (model card).
        initializer_range (`float`, defaults to 0.02).
        fuse_previous_state (`bool`, defaults to `False`): add a linear projection of the encoded target state at
            the position before each block to every block position's input (see the module docstring).
        draft_vocab_size (`int`, *optional*): when set, drafting (not training) scores only these many tokens,
            the target's most frequent ones (the `draft_vocab` buffer, [`LaSpecDrafterModel.set_draft_vocabulary`]):
            the LM head is the drafter's largest cost and, on a CPU, memory-bound. Other tokens are never drafted
            (the target still verifies every token, so outputs do not change).
        context_without_image (`bool`, defaults to `False`): the context leaves out the target's states at the
            image's positions (trained and drafted alike), so that what the drafter knows of the image comes
            through the text positions' states and its visual branch only (an experiment on the redundant route:
            CHANGELOG.md, 2026-12-07).

    Examples:
        >>> config = LaSpecDrafterConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64,
        ...                              vocab_size=128, target_layer_ids=[0, 1])
        >>> config.block_size
        4
    """

    model_type = "laspec_drafter"

    hidden_size: int = 256
    num_hidden_layers: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int = 688
    rms_norm_eps: float = 1e-6
    vocab_size: int = 32000
    target_hidden_size: int | None = None
    target_layer_ids: list[int] | None = None
    block_size: int = 4
    mask_token_id: int | None = None
    num_visual_tokens: int = 8
    vision_hidden_size: int | None = None
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    target_model_name: str | None = None
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    draft_vocab_size: int | None = None
    fuse_previous_state: bool = False
    context_without_image: bool = False

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.vision_hidden_size is None:
            self.vision_hidden_size = self.target_hidden_size
        if self.target_layer_ids is None:
            self.target_layer_ids = [0]
        self.target_layer_ids = [int(layer) for layer in self.target_layer_ids]
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Part of the `@strict` validation: shapes that the drafter cannot build."""
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE.")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
        if self.num_visual_tokens < 0:
            raise ValueError(f"num_visual_tokens must be >= 0, got {self.num_visual_tokens}.")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer.")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id ({self.mask_token_id}) must lie in [0, vocab_size={self.vocab_size}).")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) must lie in [1, vocab_size={self.vocab_size}].")

    @classmethod
    def for_target(cls, target, **overrides) -> LaSpecDrafterConfig:
        """A config sized for `target` (a model or its config): its vocabulary, text width, head layout,
        RoPE base and low/mid/high layers. Keyword arguments override any field.

        Examples:
            >>> config = LaSpecDrafterConfig.for_target(target_model, num_hidden_layers=2)  # doctest: +SKIP
        """
        config = getattr(target, "config", target)
        text = text_config(config)
        rope = getattr(text, "rope_parameters", None) or {}
        rope_theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        num_heads = text.num_attention_heads
        fields = dict(
            hidden_size=text.hidden_size,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // num_heads,
            # GPT-2-style configs name the MLP width n_inner (None: 4 x hidden)
            intermediate_size=(getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None)
                               or 4 * text.hidden_size),
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            vocab_size=text.vocab_size,
            target_hidden_size=text.hidden_size,
            target_layer_ids=default_target_layer_ids(text.num_hidden_layers),
            rope_theta=float(rope_theta),
            max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
            target_model_name=getattr(config, "name_or_path", None) or None,
        )
        fields.update(overrides)
        return cls(**fields)


def default_target_layer_ids(num_layers: int) -> list[int]:
    """Low / mid / high target layers to fuse (EAGLE-3's choice `[2, n // 2, n - 3]`, clamped, deduplicated)."""
    picks = (2, num_layers // 2, num_layers - 3)
    return sorted({min(max(layer, 0), num_layers - 1) for layer in picks})
