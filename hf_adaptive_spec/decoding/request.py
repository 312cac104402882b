"""One speculative request, resolved and checked once: `SpecRequest`.

The `generate` hook resolves it from the call's settings (`resolve_request`), a serving engine resolves it once
for all its requests, and the decoding loop reads it; nothing else looks a strategy up or checks its settings.

    request = resolve_request(model, "sage", spec_config={"n_max": 16}, assistant_model=drafter)
    run = open_run(model, request.for_call(generator=torch.Generator().manual_seed(0)), input_ids=ids, ...)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..adapters.compat import vocab_size
from ..cost import SpecCalibration
from ..runtime import RuntimeConfig, resolve_runtime
from ..strategies import Strategy, StrategyConfig, get_strategy_class, resolve_config

__all__ = ["Handoff", "SpecRequest", "resolve_request"]


class Handoff:
    """Where a call opened by `open_run` leaves its prefilled run (`run`), instead of decoding it."""

    def __init__(self):
        self.run = None


@dataclass(frozen=True)
class SpecRequest:
    """A speculative request: the strategy and its settings, resolved and checked (`resolve_request`), and what
    one call adds (`for_call`).

    Fields:
        strategy (`str`): the registered strategy name.
        config (`StrategyConfig`): its settings, resolved for devices of type `device_type`.
        spec_config: the settings as given (None, a dict or a config object), to resolve again for a call whose
            rounds run on another kind of device (`config_for`).
        device_type (`str`): the device type `config` was resolved for.
        runtime (`RuntimeConfig`): how the rounds run.
        assistant_model (*optional*): the drafter model (None for a strategy that drafts nothing).
        calibration (`SpecCalibration`, *optional*): what the cost rule learned in earlier calls, continued.
        light_trace (`bool`): keep no per-round statistics (a long-lived serving batch; rounds still report what
            they did through `Decoding.step`).
        generator (`torch.Generator`, *optional*): the call's randomness when sampling (one batch-1 call: its row's
            own; None: torch's global generator).
        raw_inputs (`dict`, *optional*): the call's inputs as given to `generate` (a VLM drafter reads the image,
            which `generate` drops before decoding).
        handoff (`Handoff`, *optional*): the call stops after its prefill and leaves the run there.
    """

    strategy: str
    config: StrategyConfig
    spec_config: object
    device_type: str
    runtime: RuntimeConfig
    assistant_model: object = dataclasses.field(default=None, repr=False)
    calibration: SpecCalibration | None = None
    light_trace: bool = False
    generator: torch.Generator | None = None
    raw_inputs: dict | None = dataclasses.field(default=None, repr=False)
    handoff: Handoff | None = None

    @property
    def strategy_class(self) -> type[Strategy]:
        return get_strategy_class(self.strategy)

    def config_for(self, device: torch.device) -> StrategyConfig:
        """The strategy's settings for rounds on `device` (resolved again only for another kind of device)."""
        if device.type == self.device_type:
            return self.config
        return resolve_config(self.strategy, self.spec_config, device)

    def for_call(self, **changes) -> "SpecRequest":
        """This request with one call's own fields (`generator`, `raw_inputs`, `handoff`) set."""
        unknown = set(changes) - {"generator", "raw_inputs", "handoff"}
        if unknown:
            raise TypeError(f"for_call sets a call's own fields only, not {sorted(unknown)}.")
        generator = changes.get("generator")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}.")
        return dataclasses.replace(self, **changes)


def resolve_request(model, strategy: str, *, spec_config=None, spec_runtime=None, calibration=None,
                    assistant_model=None, light_trace: bool = False) -> SpecRequest:
    """Resolve and check a speculative request for `model` before any decoding: the strategy name, the drafter
    it needs (or must not have), its settings (candidate ranks against the vocabulary included), the runtime
    settings and the calibration. Raises `ValueError` naming what is wrong."""
    strategy_class = get_strategy_class(strategy)
    if strategy_class.drafts_nothing and assistant_model is not None:
        raise ValueError(f"spec_strategy={strategy!r} drafts nothing: leave assistant_model out.")
    if not strategy_class.drafts_nothing and assistant_model is None:
        raise ValueError(f"spec_strategy={strategy!r} needs a drafter: pass assistant_model=...")
    if calibration is not None and not isinstance(calibration, SpecCalibration):
        raise ValueError(f"spec_calibration must be a hf_adaptive_spec.SpecCalibration, got "
                         f"{type(calibration).__name__}.")
    device = model.device
    config = resolve_config(strategy, spec_config, device)
    vocab = vocab_size(model)
    if vocab is not None:
        config.check_vocab(vocab)
    return SpecRequest(strategy=strategy, config=config, spec_config=spec_config, device_type=device.type,
                       runtime=resolve_runtime(spec_runtime), calibration=calibration, light_trace=light_trace,
                       assistant_model=None if strategy_class.drafts_nothing else assistant_model)
