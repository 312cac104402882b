"""The `generate()` hook: `spec_strategy=...` routes assisted decoding to this library.

`install()` (run by `import hf_adaptive_spec`) adds three fields to
`GenerationConfig` (`spec_strategy`, `spec_config`, `spec_runtime`, all None by
default, so `generate(spec_strategy=...)` lands in the generation config instead
of the model kwargs), and wraps two `GenerationMixin` methods:

- `generate`: finds the strategy as `generate` merges settings: this call's
  `spec_strategy=` keyword, else the `generation_config` passed to this call
  (by keyword or by position), else the model's own `generation_config`.
  When a strategy applies, it refuses beam search and `custom_generate` and
  resolves the call's one `SpecRequest` (`request.resolve_request`: strategy
  name, drafter present, the resolved `spec_config` with candidate ranks
  checked against the vocabulary, `spec_runtime`, `spec_calibration`), with
  the raw inputs, which generate itself drops before decoding, so a VLM
  drafter can see the image.
- `_assisted_decoding`: runs the speculative loop for the request of the call
  in progress; in any other call (no strategy, a nested call) the original
  runs untouched.

`open_run(model, request, **generate_kwargs)` prepares and prefills a call
for a request resolved beforehand and returns the run itself (its step API),
which a serving engine drives; `generate`'s return value plays no part.

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

from .loop import Decoding, speculative_decode
from .request import Handoff, SpecRequest, resolve_request
from ..strategies import get_strategy_class

_ORIGINALS: dict[str, object] = {}
# The resolved request of the speculative `generate` call running in this context, from the `generate` wrapper to
# the `_assisted_decoding` hook (generate's signature has no place for it); None inside any other call.
_REQUEST: contextvars.ContextVar[SpecRequest | None] = contextvars.ContextVar("hf_adaptive_spec_request",
                                                                              default=None)
_CONFIG_FIELDS = ("spec_strategy", "spec_config", "spec_runtime")


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
    """The `spec_config` this call's strategy uses: one inherited from a generation config that names another
    strategy belongs to that strategy (None: the called strategy's defaults)."""
    value, source = _setting(model, call, "spec_config")
    owner = {"generation_config": call.get("generation_config"), "model": getattr(model, "generation_config", None)}
    owner_strategy = getattr(owner.get(source), "spec_strategy", None)
    if source in owner and owner_strategy is not None and owner_strategy != strategy:
        return None
    return value


def _run_generate(model, request: SpecRequest | None, args, kwargs):
    """Stock `generate`, with `request` the one the decoding hook reads (None: this call is not speculative, and
    an assisted call nested in it runs stock)."""
    token = _REQUEST.set(request)
    try:
        return _ORIGINALS["generate"](model, *args, **kwargs)
    finally:
        _REQUEST.reset(token)


def _generate(self, *args, **kwargs):
    calibration = kwargs.pop("spec_calibration", None)
    call = _call_arguments(args, kwargs)
    if call is None:
        return _run_generate(self, None, args, kwargs)
    strategy, source = _setting(self, call, "spec_strategy")
    drafts_nothing = strategy is not None and get_strategy_class(strategy).drafts_nothing
    # no strategy, or one saved in the model's config while this call gives no drafter: plain generate
    if strategy is None or (source == "model" and call.get("assistant_model") is None and not drafts_nothing):
        if calibration is not None:
            raise ValueError("spec_calibration is for speculative calls: pass spec_strategy=... and "
                             "assistant_model=....")
        if call.get("spec_runtime") is not None and strategy is None:
            raise ValueError("spec_runtime sets how speculative rounds run: pass spec_strategy=... too.")
        return _run_generate(self, None, args, kwargs)
    num_beams, _ = _setting(self, call, "num_beams")
    if num_beams is not None and num_beams > 1:
        raise ValueError("spec_strategy does not support beam search (num_beams > 1).")
    if call.get("custom_generate") is not None:
        raise ValueError("spec_strategy cannot be combined with custom_generate.")
    request = resolve_request(self, strategy, spec_config=_spec_config(self, call, strategy),
                              spec_runtime=_setting(self, call, "spec_runtime")[0], calibration=calibration,
                              assistant_model=call.get("assistant_model"))
    if drafts_nothing:  # `plain`: the rounds run on the target alone; generate reaches them through the hook
        kwargs["assistant_model"] = self
    return _run_generate(self, request.for_call(raw_inputs=dict(kwargs)), args, kwargs)


def open_run(model, request: SpecRequest, **generate_kwargs) -> Decoding:
    """A speculative call of `model` for `request` (`resolve_request`; `request.for_call(generator=...)` for a
    sampled row's own randomness), prepared by `generate` from `generate_kwargs` (inputs, limits, EOS ids,
    sampling settings) and prefilled, before its first round. Returns the run: drive it through its step API
    (`Decoding.prefill_result`, `step`, `join`, `leave`) and `close` it."""
    for name in _CONFIG_FIELDS + ("spec_calibration", "assistant_model"):
        if name in generate_kwargs:
            raise ValueError(f"open_run takes {name} from the request (resolve_request), not as a keyword.")
    handoff = Handoff()
    kwargs = dict(generate_kwargs, assistant_model=request.assistant_model or model)
    _run_generate(model, request.for_call(raw_inputs=dict(kwargs), handoff=handoff), (), kwargs)
    if handoff.run is None:
        raise RuntimeError("generate did not reach the speculative loop (the hook is not installed?).")
    return handoff.run


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
    request = _REQUEST.get()
    if request is None or assistant_model is None:
        return _ORIGINALS["_assisted_decoding"](
            self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=synced_gpus,
            streamer=streamer, inputs_tensor=inputs_tensor, assistant_model=assistant_model,
            assistant_tokenizer=assistant_tokenizer, tokenizer=tokenizer, **model_kwargs,
        )
    _REQUEST.set(None)  # the request is this call's: a generate call nested in the rounds runs as asked
    return speculative_decode(
        self, input_ids, logits_processor, stopping_criteria, generation_config, request, streamer=streamer,
        assistant_model=assistant_model, tokenizer=tokenizer, assistant_tokenizer=assistant_tokenizer,
        synced_gpus=synced_gpus, **model_kwargs,
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
