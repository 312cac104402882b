"""The `generate()` hook: `spec_strategy=...` routes assisted decoding to this library.

`install()` (run by `import hf_adaptive_spec`) adds two fields to
`GenerationConfig` (`spec_strategy`, `spec_config`, `spec_runtime`, all None by
default, so `generate(spec_strategy=...)` lands in the generation config instead
of the model kwargs), and wraps two `GenerationMixin` methods:

- `generate`: finds the strategy as `generate` merges settings: this call's
  `spec_strategy=` keyword, else the `generation_config` passed to this call
  (by keyword or by position), else the model's own `generation_config`.
  When a strategy applies, it checks the request up front (strategy name,
  drafter present, no beam search, the resolved `spec_config`, including
  candidate ranks against the vocabulary) and remembers the raw multimodal
  inputs, which generate itself drops before decoding, so a VLM drafter can
  see the image.
- `_assisted_decoding`: dispatches on `generation_config.spec_strategy`; when
  it is unset, or no drafter was given, the original runs untouched.

Per call and saved strategies:

- `generate(..., spec_strategy=None)` turns this library off for the call,
  even when the model's generation config names a strategy (transformers
  applies an explicit keyword after the saved defaults): plain `generate`,
  or stock assisted decoding when an `assistant_model` is given.
- A strategy saved in the model's generation config (`save_pretrained` keeps
  `spec_strategy` and `spec_config`) applies when the call gives a drafter;
  without one, `generate` runs plain, as the call did not ask for
  speculation. A strategy named by this call, as a keyword or in a passed
  `generation_config`, without a drafter is an error.
- A `spec_config` inherited from a generation config that names another
  strategy is not used (the called strategy takes its defaults).

`uninstall()` restores both methods and removes the fields.
"""

from __future__ import annotations

import contextvars
import functools
import inspect

from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

from ..cost import SpecCalibration
from .loop import speculative_decode
from ..runtime import resolve_runtime
from ..strategies import get_strategy_class, resolve_config

_ORIGINALS: dict[str, object] = {}
# this call's raw inputs (generate drops multimodal ones before decoding) and whether to drop spec_config
_REQUEST: contextvars.ContextVar[dict | None] = contextvars.ContextVar("hf_adaptive_spec_request", default=None)
_CONFIG_FIELDS = ("spec_strategy", "spec_config", "spec_runtime")
# set by `prefilled_run`: the next speculative generate call on this thread returns its prefilled run
_HANDOFF: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_adaptive_spec_handoff", default=False)


def _call_arguments(args, kwargs) -> dict | None:
    """`generate`'s arguments by name, however they were passed (model kwargs merged in); None if they do not bind,
    so that stock `generate` reports the mistake itself."""
    try:
        bound = inspect.signature(_ORIGINALS["generate"]).bind_partial(None, *args, **kwargs)
    except TypeError:
        return None
    named = dict(bound.arguments)
    named.pop(next(iter(named)))  # self
    extra = named.pop("kwargs", {})
    return {**named, **extra}


def _setting(model, call: dict, name: str):
    """`(value, source)` of a generation setting as `generate` merges it: this call's keyword (an explicit None
    included), else the passed `generation_config`'s value unless None, else the model's saved one."""
    if name in call:
        return call[name], "call"
    passed = call.get("generation_config")
    if passed is not None and getattr(passed, name, None) is not None:
        return getattr(passed, name), "generation_config"
    saved = getattr(getattr(model, "generation_config", None), name, None)
    return saved, ("model" if saved is not None else None)


def _spec_config(model, call: dict, strategy: str):
    """The `spec_config` generate will use, and whether it must be dropped: one inherited from a generation config
    that names another strategy belongs to that strategy."""
    value, source = _setting(model, call, "spec_config")
    owner = {"generation_config": call.get("generation_config"), "model": getattr(model, "generation_config", None)}
    owner_strategy = getattr(owner.get(source), "spec_strategy", None)
    if source in owner and owner_strategy is not None and owner_strategy != strategy:
        return None, True
    return value, False


def _vocab_size(model) -> int | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "vocab_size", None)


def _generate(self, *args, **kwargs):
    calibration = kwargs.pop("spec_calibration", None)
    if calibration is not None and not isinstance(calibration, SpecCalibration):
        raise ValueError(f"spec_calibration must be a hf_adaptive_spec.SpecCalibration, got "
                         f"{type(calibration).__name__}.")
    call = _call_arguments(args, kwargs)
    if call is None:
        return _ORIGINALS["generate"](self, *args, **kwargs)
    strategy, source = _setting(self, call, "spec_strategy")
    drafts_nothing = strategy is not None and get_strategy_class(strategy).drafts_nothing
    # no strategy, or one saved in the model's config while this call gives no drafter: plain generate
    if strategy is None or (source == "model" and call.get("assistant_model") is None and not drafts_nothing):
        if calibration is not None:
            raise ValueError("spec_calibration is for speculative calls: pass spec_strategy=... and "
                             "assistant_model=....")
        if call.get("spec_runtime") is not None and strategy is None:
            raise ValueError("spec_runtime sets how speculative rounds run: pass spec_strategy=... too.")
        return _ORIGINALS["generate"](self, *args, **kwargs)
    if drafts_nothing:  # `plain`: the rounds run on the target alone; generate reaches them through the hook
        if call.get("assistant_model") is not None:
            raise ValueError(f"spec_strategy={strategy!r} drafts nothing: leave assistant_model out.")
        kwargs["assistant_model"] = self
    elif call.get("assistant_model") is None:
        raise ValueError(f"spec_strategy={strategy!r} needs a drafter: pass assistant_model=... to generate().")
    num_beams, _ = _setting(self, call, "num_beams")
    if num_beams is not None and num_beams > 1:
        raise ValueError("spec_strategy does not support beam search (num_beams > 1).")
    if call.get("custom_generate") is not None:
        raise ValueError("spec_strategy cannot be combined with custom_generate.")
    spec_config, dropped = _spec_config(self, call, strategy)
    vocab_size = _vocab_size(self)
    resolved = resolve_config(strategy, spec_config, self.device)  # bad settings fail before any decoding
    if vocab_size is not None:
        resolved.check_vocab(vocab_size)
    resolve_runtime(_setting(self, call, "spec_runtime")[0])  # checked once, here; the loop reads the config
    handoff = _HANDOFF.get()
    handoff_token = _HANDOFF.set(False)  # a nested generate call runs as usual
    token = _REQUEST.set({"raw_inputs": dict(kwargs), "drop_spec_config": dropped, "calibration": calibration,
                          "handoff": handoff, "config": (resolved, self.device.type)})
    try:
        return _ORIGINALS["generate"](self, *args, **kwargs)
    finally:
        _REQUEST.reset(token)
        _HANDOFF.reset(handoff_token)


def prefilled_run(model, **generate_kwargs):
    """`model.generate(**generate_kwargs)` (a speculative call: `spec_strategy=...`) up to its first round: returns
    the prefilled `loop.Decoding` instead of tokens, its scope open (`Decoding.scope`; the caller closes it). A
    serving engine runs the rounds, joins rows of several such runs into one batch and lets rows leave."""
    if generate_kwargs.get("spec_strategy") is None:
        raise ValueError("prefilled_run needs spec_strategy=...")
    token = _HANDOFF.set(True)
    try:
        run = model.generate(**generate_kwargs)
    finally:
        _HANDOFF.reset(token)
    if not hasattr(run, "join"):
        raise RuntimeError("generate did not reach the speculative loop (the hook is not installed?).")
    return run


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
    if getattr(generation_config, "spec_strategy", None) is None or assistant_model is None:
        return _ORIGINALS["_assisted_decoding"](
            self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=synced_gpus,
            streamer=streamer, inputs_tensor=inputs_tensor, assistant_model=assistant_model,
            assistant_tokenizer=assistant_tokenizer, tokenizer=tokenizer, **model_kwargs,
        )
    request = _REQUEST.get() or {}
    if request.get("drop_spec_config"):  # generation_config is this call's own merged copy
        generation_config.spec_config = None
    return speculative_decode(
        self, input_ids, logits_processor, stopping_criteria, generation_config, streamer=streamer,
        assistant_model=assistant_model, tokenizer=tokenizer, assistant_tokenizer=assistant_tokenizer,
        raw_inputs=request.get("raw_inputs"), synced_gpus=synced_gpus, spec_calibration=request.get("calibration"),
        handoff=bool(request.get("handoff")), resolved_config=_resolved_for(request, self, input_ids), **model_kwargs,
    )


def _resolved_for(request: dict, model, input_ids):
    """The strategy config `_generate` resolved, if it was resolved for the device the rounds run on."""
    from ..adapters.placement import execution_device

    resolved, device_type = request.get("config") or (None, None)
    if resolved is None or request.get("drop_spec_config"):
        return None
    return resolved if execution_device(model, input_ids.device).type == device_type else None


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
