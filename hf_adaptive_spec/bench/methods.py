"""The per-prompt benchmark's methods (plain, the plain mode, stock assisted generation, each strategy, the
`--visual-tokens` sweep) and one timed greedy `generate` of a method (`run_method`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..cost import SpecCalibration
from . import vision as bench_vision
from .report import jsonable, sklearn_available
from .stats import PLAIN, PLAIN_MODE, STOCK_BEST, STOCK_DEFAULT

__all__ = ["GenerationRun", "Method", "build_methods", "check_baseline_options", "check_drafter_options",
           "default_strategies", "run_method", "sync"]


#: Stock settings recorded for `stock_default` when the drafter's generation config leaves them unset.
_STOCK_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
               "assistant_lookbehind")


@dataclass
class Method:
    """One way to generate.

    Fields:
        name: ``"plain"``, ``"stock_default"``, ``"stock_best"``, a strategy name or a swept variant
            (``"laspec_m8"``).
        kind: ``"plain"``, ``"plain_mode"`` (the library's rounds without a drafter), ``"stock"`` or ``"spec"``.
        spec_config: the strategy's `spec_config` dict (spec only; None = the strategy's defaults).
        drafter_settings: fields set on the drafter's generation config for the call (stock only).
        resolved: the effective settings, for the report (stock: with `confidence_threshold_adapts`, whether
            transformers adapts the confidence threshold in the call: scikit-learn importable and a threshold set).
        strategy: the `spec_strategy` a spec method runs (default: `name`).
        visual_tokens: M of a `--visual-tokens` sweep method, else None.
        visual_selection: when a swept independent drafter's M tokens are chosen ("prefill" / "round"), else None.
        calibration: what the cost rule learns (spec only), carried from one of this method's calls to the next.
        drafter_role: ``"main"`` (`--drafter`) or ``"baseline"`` (`--baseline-drafter`): the drafter it runs with.
    """

    name: str
    kind: str
    spec_config: Optional[dict] = None
    drafter_settings: Optional[dict] = None
    resolved: dict = field(default_factory=dict)
    strategy: Optional[str] = None
    visual_tokens: Optional[int] = None
    visual_selection: Optional[str] = None
    calibration: SpecCalibration = field(default_factory=SpecCalibration, repr=False, compare=False)
    drafter_role: str = "main"

    def __post_init__(self):
        if self.strategy is None:
            self.strategy = self.name


@dataclass
class GenerationRun:
    """What one `generate` call gave: new tokens (list of ids), seconds, target forwards, `SpecStats` or None."""

    tokens: list
    seconds: float
    target_forwards: int
    stats: object = None


def build_methods(args, device: torch.device, drafter=None, stock_drafter_role: str = "main") -> list:
    """The methods to run, in their base order: plain, stock_default, stock_best, the strategies, the
    `--visual-tokens` sweep (one laspec method per M), then the `--baseline-drafter`'s strategies (STRATEGY:NAME).
    `drafter` is the one stock runs with (its generation config gives the recorded stock settings), the
    `--drafter` unless `stock_drafter_role` is "baseline".

    Raises `ValueError` for an unknown strategy, a `--spec-config` of a strategy that is not run, an invalid
    config, a stock setting that is not a `GenerationConfig` field, or a sweep without laspec.
    """
    from transformers import GenerationConfig

    from ..strategies import STRATEGIES, resolve_config

    if args.strategies is None:
        args.strategies = default_strategies(laspec=False)
    strategies = list(dict.fromkeys(args.strategies))
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"Unknown strategy {unknown[0]!r} in --strategies; valid: {', '.join(STRATEGIES)}.")
    if PLAIN in strategies:
        raise ValueError(f"--strategies {PLAIN}: the bench's {PLAIN!r} method is stock generate, run always; the "
                         "library's plain mode (spec_strategy='plain') is not a bench method.")
    spec_configs = {}
    for name, config in args.spec_config:
        if name not in strategies:
            raise ValueError(f"--spec-config names {name!r}, which is not among --strategies {strategies}.")
        spec_configs[name] = {**spec_configs.get(name, {}), **config}

    methods = [Method(PLAIN, "plain")]
    if not getattr(args, "no_plain_mode", False):
        methods.append(Method(PLAIN_MODE, "plain_mode", strategy="plain",
                              resolved=jsonable(dataclasses.asdict(resolve_config("plain", None, device)))))
    if not args.no_stock:
        known = GenerationConfig()
        for key in args.stock_best_kwargs:
            if not hasattr(known, key):
                raise ValueError(f"--stock-best-kwargs: {key!r} is not a GenerationConfig field.")
        base = _effective_stock_settings(drafter)
        for name, settings in ((STOCK_DEFAULT, {}), (STOCK_BEST, dict(args.stock_best_kwargs))):
            resolved = {**base, **settings}
            resolved["confidence_threshold_adapts"] = bool(sklearn_available()
                                                           and resolved.get("assistant_confidence_threshold"))
            methods.append(Method(name, "stock", drafter_settings=settings, resolved=resolved,
                                  drafter_role=stock_drafter_role))
    # (name, strategy, M, selection, config)
    spec = [(name, name, None, None, spec_configs.get(name)) for name in strategies]
    if getattr(args, "visual_tokens", None):
        spec += bench_vision.sweep_methods(args.visual_tokens, strategies, spec_configs,
                                           getattr(args, "visual_strategy", None),
                                           getattr(args, "visual_selection", None))
    elif getattr(args, "visual_strategy", None) or getattr(args, "visual_selection", None):
        raise ValueError("--visual-strategy and --visual-selection shape a --visual-tokens sweep; add --visual-tokens.")
    for name, strategy, count, selection, config in spec:
        try:
            resolved = resolve_config(strategy, config, device)
        except TypeError as exc:  # unknown field names
            raise ValueError(f"--spec-config {strategy}: {exc}") from exc
        methods.append(Method(name, "spec", spec_config=config, resolved=jsonable(dataclasses.asdict(resolved)),
                              strategy=strategy, visual_tokens=count, visual_selection=selection))
    if getattr(args, "baseline_drafter", None):
        for strategy in dict.fromkeys(args.baseline_strategies):
            if strategy not in STRATEGIES or STRATEGIES[strategy].drafts_nothing:
                raise ValueError(f"--baseline-strategies {strategy!r}: not a strategy that drafts; valid: "
                                 f"{', '.join(n for n, c in STRATEGIES.items() if not c.drafts_nothing)}.")
            resolved = resolve_config(strategy, None, device)
            methods.append(Method(f"{strategy}:{args.baseline_drafter}", "spec",
                                  resolved=jsonable(dataclasses.asdict(resolved)), strategy=strategy,
                                  drafter_role="baseline"))
    return methods


def default_strategies(laspec: bool) -> list:
    """Every registered strategy the drafter kind can serve (block-drafter-only ones need a LaSpec drafter)."""
    from ..strategies import STRATEGIES

    return [name for name, cls in STRATEGIES.items()
            if (laspec or not cls.requires_block_drafter) and not cls.drafts_nothing]


def check_drafter_options(args, laspec: bool) -> None:
    """Fill the default strategy list for the drafter kind; refuse options that cannot apply to it."""
    from ..strategies import STRATEGIES

    if args.strategies is None:
        args.strategies = default_strategies(laspec)
    if laspec:
        if args.drafter_int8:
            raise ValueError("--drafter-int8 quantizes an independent drafter model; a LaSpec drafter is one small "
                             "forward per round (leave it out).")
        if not args.no_stock and not getattr(args, "baseline_drafter", None):
            raise ValueError("stock assisted generation needs an independent HF model as drafter, not a LaSpec "
                             "drafter: add --no-stock, or name one with --baseline-drafter.")
    else:
        block_only = [name for name in args.strategies
                      if name in STRATEGIES and STRATEGIES[name].requires_block_drafter]
        if block_only:
            raise ValueError(f"--strategies {block_only} need a LaSpec drafter (e.g. --drafter "
                             "laspec-smollm2-135m-instruct --target smollm2-135m-instruct); "
                             f"{args.drafter!r} is an independent model.")


def check_baseline_options(args, laspec: bool, baseline_laspec: bool) -> None:
    """Refuse `--baseline-*` options that cannot apply (`laspec` / `baseline_laspec`: the `--drafter` / the
    baseline is a LaSpec drafter)."""
    from ..strategies import STRATEGIES

    name = getattr(args, "baseline_drafter", None)
    if name is None:
        if getattr(args, "baseline_drafter_int8", False):
            raise ValueError("--baseline-drafter-int8 needs --baseline-drafter.")
        return
    if any(getattr(args, option, None) for option in ("cold", "load_sweep", "arrivals")):
        raise ValueError("--baseline-drafter runs in the per-prompt bench only (not with --cold, --load-sweep or "
                         "--arrivals).")
    if baseline_laspec and args.baseline_drafter_int8:
        raise ValueError("--baseline-drafter-int8 quantizes an independent drafter model, not a LaSpec drafter.")
    if not baseline_laspec:
        block_only = [s for s in args.baseline_strategies if s in STRATEGIES and STRATEGIES[s].requires_block_drafter]
        if block_only:
            raise ValueError(f"--baseline-strategies {block_only} need a LaSpec drafter; {name!r} is an independent "
                             "model.")
    if not args.no_stock and baseline_laspec and laspec:
        raise ValueError("stock assisted generation needs an independent HF model as drafter: add --no-stock.")


def _effective_stock_settings(drafter) -> dict:
    """Stock assisted-generation settings the drafter's generation config gives (defaults filled in)."""
    from transformers import GenerationConfig

    config = copy.deepcopy(drafter.generation_config) if drafter is not None else GenerationConfig()
    try:  # what AssistedCandidateGenerator does; private API, so best effort
        config.update(**config._get_default_generation_params(), defaults_only=True)
    except Exception:
        pass
    return {key: getattr(config, key, None) for key in _STOCK_KEYS}


class _ForwardCounter:
    """Counts forward calls of a module while active (a pre-hook: a few ns per call)."""

    def __init__(self, module):
        self.module, self.count, self.handle = module, 0, None

    def _hook(self, module, args):
        self.count += 1

    def __enter__(self):
        self.handle = self.module.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def run_method(method: Method, target, drafter, inputs: dict, max_new_tokens: int, pad_token_id=None
               ) -> GenerationRun:
    """One greedy `generate` of `method` on `inputs` (batch 1), timed with `time.perf_counter`.

    Stock methods set `method.drafter_settings` on (a copy of) the drafter's generation config for the call
    only, so every call starts from the same settings.
    """
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, return_dict_in_generate=True)
    if pad_token_id is not None:
        kwargs["pad_token_id"] = pad_token_id
    saved_config = None
    if method.kind == "stock":
        kwargs["assistant_model"] = drafter
        saved_config = drafter.generation_config
        drafter.generation_config = copy.deepcopy(saved_config)
        for key, value in (method.drafter_settings or {}).items():
            setattr(drafter.generation_config, key, value)
    elif method.kind == "plain_mode":  # drafts nothing: no assistant_model
        kwargs.update(spec_strategy="plain")
    elif method.kind == "spec":
        kwargs.update(assistant_model=drafter, spec_strategy=method.strategy, spec_calibration=method.calibration)
        if method.spec_config is not None:
            kwargs["spec_config"] = dict(method.spec_config)
    elif method.kind not in ("plain", "plain_mode"):
        raise ValueError(f"unknown method kind {method.kind!r}")
    device = inputs["input_ids"].device
    # the library's calls count their target forwards themselves (`SpecStats.target_forwards`): a hook on the
    # target would make their rounds run the model's own forward instead of the lean one users get
    counting = method.kind in ("plain", "stock")
    try:
        with _ForwardCounter(target) if counting else contextlib.nullcontext() as counter:
            sync(device)
            start = time.perf_counter()
            out = target.generate(**inputs, **kwargs)
            sync(device)
            seconds = time.perf_counter() - start
    finally:
        if saved_config is not None:
            drafter.generation_config = saved_config
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    stats = getattr(out, "spec_stats", None)
    return GenerationRun(tokens, seconds, counter.count if counting else stats.target_forwards, stats)
