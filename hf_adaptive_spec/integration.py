"""The `generate()` hook: `spec_strategy=...` routes assisted decoding to this library.

`install()` (run by `import hf_adaptive_spec`) adds two fields to
`GenerationConfig` (`spec_strategy`, `spec_config`, both None by default, so
`generate(spec_strategy=...)` lands in the generation config instead of the
model kwargs), and wraps two `GenerationMixin` methods:

- `generate`: when `spec_strategy` is set, checks the request up front
  (strategy name, drafter present, no beam search) and remembers the raw
  multimodal inputs, which generate itself drops before decoding, so a VLM
  drafter can see the image.
- `_assisted_decoding`: dispatches on `generation_config.spec_strategy`; when
  it is unset the original runs untouched.

`uninstall()` restores both methods and removes the fields.
"""

from __future__ import annotations

import contextvars
import functools

from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

from .loop import speculative_decode
from .strategies import get_strategy_class

_ORIGINALS: dict[str, object] = {}
_RAW_INPUTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("hf_adaptive_spec_raw_inputs", default=None)
_CONFIG_FIELDS = ("spec_strategy", "spec_config")


def _requested_strategy(model, kwargs):
    if kwargs.get("spec_strategy") is not None:
        return kwargs["spec_strategy"]
    generation_config = kwargs.get("generation_config")
    for config in (generation_config, getattr(model, "generation_config", None)):
        if config is not None and getattr(config, "spec_strategy", None) is not None:
            return config.spec_strategy
    return None


def _num_beams(model, kwargs):
    if kwargs.get("num_beams") is not None:
        return kwargs["num_beams"]
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        if config is not None and config.num_beams is not None:
            return config.num_beams
    return 1


def _generate(self, *args, **kwargs):
    strategy = _requested_strategy(self, kwargs)
    if strategy is None:
        return _ORIGINALS["generate"](self, *args, **kwargs)
    get_strategy_class(strategy)  # unknown names fail here, listing the valid ones
    if kwargs.get("assistant_model") is None:
        raise ValueError(f"spec_strategy={strategy!r} needs a drafter: pass assistant_model=... to generate().")
    if _num_beams(self, kwargs) > 1:
        raise ValueError("spec_strategy does not support beam search (num_beams > 1).")
    if kwargs.get("custom_generate") is not None:
        raise ValueError("spec_strategy cannot be combined with custom_generate.")
    token = _RAW_INPUTS.set(dict(kwargs))
    try:
        return _ORIGINALS["generate"](self, *args, **kwargs)
    finally:
        _RAW_INPUTS.reset(token)


def _assisted_decoding(
    self,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    streamer=None,
    inputs_tensor=None,
    assistant_model=None,
    assistant_tokenizer=None,
    tokenizer=None,
    **model_kwargs,
):
    if getattr(generation_config, "spec_strategy", None) is None:
        return _ORIGINALS["_assisted_decoding"](
            self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=synced_gpus,
            streamer=streamer, inputs_tensor=inputs_tensor, assistant_model=assistant_model,
            assistant_tokenizer=assistant_tokenizer, tokenizer=tokenizer, **model_kwargs,
        )
    return speculative_decode(
        self, input_ids, logits_processor, stopping_criteria, generation_config, streamer=streamer,
        assistant_model=assistant_model, tokenizer=tokenizer, assistant_tokenizer=assistant_tokenizer,
        raw_inputs=_RAW_INPUTS.get(), synced_gpus=synced_gpus, **model_kwargs,
    )


def is_installed() -> bool:
    return bool(_ORIGINALS)


def install() -> None:
    """Hook `generate` (idempotent: a second call does nothing)."""
    if _ORIGINALS:
        return
    _ORIGINALS["generate"] = GenerationMixin.generate
    _ORIGINALS["_assisted_decoding"] = GenerationMixin._assisted_decoding
    for name in _CONFIG_FIELDS:
        setattr(GenerationConfig, name, None)
    GenerationMixin.generate = functools.wraps(_ORIGINALS["generate"])(_generate)
    GenerationMixin._assisted_decoding = functools.wraps(_ORIGINALS["_assisted_decoding"])(_assisted_decoding)


def uninstall() -> None:
    """Restore stock `generate` (idempotent)."""
    if not _ORIGINALS:
        return
    GenerationMixin.generate = _ORIGINALS.pop("generate")
    GenerationMixin._assisted_decoding = _ORIGINALS.pop("_assisted_decoding")
    for name in _CONFIG_FIELDS:
        if name in GenerationConfig.__dict__:
            delattr(GenerationConfig, name)
