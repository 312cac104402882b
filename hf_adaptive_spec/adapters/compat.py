"""What this library can run exactly, and clear refusals for everything else.

Model-family specifics live here and in `ModelRunner` (position layout), not
in the decoding loop. The text config and vocabulary size of a model (`text_config`, `vocab_size`, defined
in `model_config`) are handed on from here to the rest of the package.
"""

from __future__ import annotations

import inspect

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .attention import text_attention
from .model_config import text_config, vocab_size
from .placement import check_placement
from .windows import attention_layout

__all__ = ["MULTIMODAL_KEYS", "SUPPORTED_ATTENTION", "cache_argument", "cache_from_kwargs", "check_cache",
           "check_model", "check_pair", "cross_attention", "output_cache", "text_config", "vocab_size"]

SUPPORTED_ATTENTION = ("sdpa", "eager")
# raw multimodal inputs a drafter may need in its prefill
MULTIMODAL_KEYS = (
    "pixel_values",
    "pixel_values_videos",
    "image_sizes",
    "image_sizes_videos",
    "image_grid_thw",
    "video_grid_thw",
    "mm_token_type_ids",
    "vision_aspect_ratio",
    "batch_num_images",
    "second_per_grid_ts",
    "pixel_attention_mask",
    "token_type_ids",  # image / prefix blocks that attend bidirectionally in the prefill (Gemma 3, PaliGemma)
)


def cache_argument(model) -> str:
    """The name under which `model.forward` takes its KV cache.

    transformers 5.24 renamed `past_key_values` to `cache` (forward arguments, `generate`'s model kwargs and
    model outputs); earlier 5.x releases use `past_key_values`. Passing the old name to 5.24 still works but
    warns on every call.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_from_kwargs(model_kwargs: dict):
    """The target's cache among the model kwargs `generate` prepared (either release's name), or None."""
    cache = model_kwargs.get("cache")
    return cache if cache is not None else model_kwargs.get("past_key_values")


def output_cache(output):
    """The cache a model output carries (`cache` from transformers 5.24, `past_key_values` before)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def cross_attention(model) -> str | None:
    """What gives `model`'s decoder cross-attention layers, or None when it has none.

    Decided by what the model holds, never by the arguments its forward accepts (GPT-2 and GPTBigCode take
    `encoder_hidden_states` but build cross-attention layers only when `config.add_cross_attention` is set):
    a decoder config that enables cross-attention (`add_cross_attention`, `cross_attention_layers`), or a
    module of the text decoder whose class is a cross-attention one.
    """
    config = text_config(model)
    if getattr(config, "add_cross_attention", False):
        return "config.add_cross_attention=True"
    layers = getattr(config, "cross_attention_layers", None)
    if layers:
        return f"config.cross_attention_layers={list(layers)}"
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError):
        decoder = None
    for module in (decoder if decoder is not None else model).modules():
        if "crossattention" in type(module).__name__.lower():
            return f"a {type(module).__name__} module"
    return None


def check_model(model, role: str) -> None:
    """Raise a `ValueError` naming the problem if `model` cannot verify or draft trees exactly."""
    name = type(model).__name__
    check_placement(model, role)  # pipeline-parallel, FSDP and multi-dimensional sharding are refused
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"spec_strategy supports decoder-only LMs and VLMs; the {role} {name} is encoder-decoder.")
    if getattr(model, "_is_stateful", False):
        raise ValueError(
            f"The {role} {name} keeps recurrent state, which cannot verify a tree through an attention mask; "
            "spec_strategy supports attention-only models."
        )
    # (a speculative call of another thread may hold the model switched to the library's sdpa: still "sdpa")
    attn = text_attention(model) or getattr(model.config, "_attn_implementation", None)
    if attn not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"The {role} {name} uses attn_implementation={attn!r}, which cannot carry a tree attention mask "
            f"(flash-attention treats masks as 2D padding). Load it with attn_implementation=\"sdpa\" "
            f"(supported: {', '.join(SUPPORTED_ATTENTION)})."
        )
    try:
        attention_layout(model)  # full, sliding-window and chunked layers only
    except ValueError as error:
        raise ValueError(f"The {role}: {error}") from None
    cross = cross_attention(model)
    if cross is not None:
        raise NotImplementedError(
            f"The {role} {name} attends to a second sequence through cross-attention layers ({cross}): their "
            "cache and per-step masks are not carried through tree rounds; spec_strategy supports self-attention "
            "decoders only."
        )
    parameters = inspect.signature(model.forward).parameters
    if "position_ids" not in parameters:
        raise ValueError(f"The {role} {name} does not accept explicit position_ids, which tree verification needs.")


def check_cache(cache, role: str) -> None:
    """Only an empty `DynamicCache` of full-attention or sliding-window layers is supported (the sliding ones keep
    plain generate's window; `windows.WindowedSlots`)."""
    if type(cache) is not DynamicCache:
        raise ValueError(
            f"spec_strategy needs a DynamicCache for the {role}, got {type(cache).__name__}; "
            "do not pass cache_implementation or a static/quantized/offloaded cache."
        )
    allowed = (DynamicLayer, DynamicSlidingWindowLayer)
    bad = sorted({type(layer).__name__ for layer in cache.layers if type(layer) not in allowed})
    if bad:
        raise ValueError(f"The {role}'s cache has layers of type {bad}; spec_strategy supports DynamicLayer and "
                         "DynamicSlidingWindowLayer only.")
    if cache.get_seq_length() != 0:
        raise ValueError("spec_strategy cannot continue from a non-empty cache (past_key_values); pass a fresh cache or none.")


def check_pair(target, drafter, tokenizer=None, assistant_tokenizer=None) -> None:
    """The drafter must speak the target's vocabulary exactly."""
    target_vocab = vocab_size(target)
    drafter_vocab = vocab_size(drafter)
    if target_vocab != drafter_vocab:
        raise ValueError(
            f"The drafter's vocabulary ({drafter_vocab} tokens) does not match the target's ({target_vocab}); "
            "spec_strategy needs a drafter that shares the target's tokenizer."
        )
    target_outputs = getattr(target.get_output_embeddings(), "out_features", None)
    drafter_outputs = getattr(drafter.get_output_embeddings(), "out_features", None)
    if target_outputs is not None and drafter_outputs is not None and target_outputs != drafter_outputs:
        raise ValueError(
            f"The drafter's LM head has {drafter_outputs} outputs, the target's {target_outputs}; "
            "spec_strategy needs identical vocabularies."
        )
    if assistant_tokenizer is not None:
        if tokenizer is None or tokenizer.get_vocab() != assistant_tokenizer.get_vocab():
            raise ValueError(
                "spec_strategy needs a drafter that shares the target's tokenizer; the assistant_tokenizer "
                "differs from the target's (universal assisted decoding is not supported)."
            )
