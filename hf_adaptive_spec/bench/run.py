"""End-to-end benchmark: plain greedy vs stock assisted generation vs this library's strategies.

    python -m hf_adaptive_spec.bench --limit 4 --max-new-tokens 128 --out bench_results/
    hf-adaptive-spec bench ...            # the same options

For every prompt of the chosen data sets (`hf_adaptive_spec.registry.data`) every method
runs once, INTERLEAVED, in an order rotated per prompt so that machine drift
spreads over all methods:

- ``plain``: ``target.generate`` greedy, no drafter (the reference output);
- ``plain_mode``: ``spec_strategy="plain"``, the library's rounds without a drafter (the second baseline);
- ``stock_default`` / ``stock_best``: stock transformers assisted generation
  with the drafter's default settings, and with `--stock-best-kwargs`;
- one method per `--strategies` entry: ``generate(..., spec_strategy=name)``;
- with `--visual-tokens M ...`, one more `laspec` method per M (``laspec_m8``, ...) whose spec_config sets
  ``num_visual_tokens`` to M (`hf_adaptive_spec.bench.vision`).

`--datasets scenes` runs held-out scenes (`hf_adaptive_spec.scenes.dataset`, image prompts, category ``describe``) on
a VLM target (``scenes-vlm-135m`` or a local VLM folder); their prompts are encoded by the target's processor,
and the speculative runs also count accepted drafts among grounded tokens (colours, shapes) and the others.

All runs are greedy with the same `max_new_tokens`, and every output must equal
the plain output token for token: a mismatch (or an exception) is a failure,
listed with its prompt ids, and makes `main` exit non-zero. Models load once;
load time is excluded; each method gets `--warmup` untimed runs first.

Metrics (pooled over prompts): tokens/s = new tokens / generate seconds;
tau = tokens produced per target verification forward (spec: (accepted drafts
+ bonus) / rounds, the prefill token excluded; stock: new tokens / target
forwards, since its first forward reads prompt and first draft together;
plain: 1); speedup over X = sum of X's seconds / sum of the method's seconds
on the same prompts, plus the geometric mean of per-prompt ratios.

Outputs in `--out`: ``results.json`` (per-prompt records, aggregates, command,
environment), ``results.md`` (tables) and PNG plots (matplotlib, optional).

This module holds the command line and the run (methods, models, prompts, timing, per-prompt records); the
pooled metrics are computed by `hf_adaptive_spec.bench.stats`, the outputs written by
`hf_adaptive_spec.bench.report`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from .. import loading
from . import memory as bench_memory
from . import vision as bench_vision
from .report import _describe, _environment, _jsonable, _now, _print_summary, _write_outputs
from .stats import PLAIN, PLAIN_MODE, STOCK_BEST, STOCK_DEFAULT, aggregate
from ..cost import SpecCalibration
from ..drafters.quantize import quantize_drafter
from ..scenes.vlm import SCENES_VLM

__all__ = [
    "DEFAULT_DRAFTER",
    "DEFAULT_STOCK_BEST",
    "DEFAULT_TARGET",
    "GenerationRun",
    "Method",
    "add_arguments",
    "build_methods",
    "encode_prompt",
    "load_model",
    "main",
    "run",
    "run_method",
]

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b-instruct"
#: Stock assisted generation, "tuned" for a CPU where a drafter step costs ~0.4 target steps: a short
#: starting draft that adapts per round (+2 when all accepted, -1 otherwise) and resets every call (so
#: interleaved runs stay independent), stopping early when the drafter's top probability drops below 0.3.
DEFAULT_STOCK_BEST = {
    "num_assistant_tokens": 5,
    "num_assistant_tokens_schedule": "heuristic_transient",
    "assistant_confidence_threshold": 0.3,
}
#: Stock settings recorded for `stock_default` when the drafter's generation config leaves them unset.
_STOCK_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
               "assistant_lookbehind")

ModelLoader = Callable[[str, argparse.Namespace, str], tuple]  # (name, args, role) -> (model, processor)
PromptLoader = Callable[[str, Optional[int]], list]  # (dataset, limit) -> [Prompt]


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------
def _spec_config_arg(text: str) -> tuple:
    name, sep, payload = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--spec-config wants STRATEGY=JSON, got {text!r}.")
    try:
        value = json.loads(payload)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--spec-config {name}: invalid JSON ({exc}).") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--spec-config {name}: the JSON must be an object of config fields.")
    return name.strip(), value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON ({exc}).") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object.")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the benchmark options to `parser` (used by `main` and by the `hf-adaptive-spec bench` subcommand)."""
    from .. import STRATEGIES
    from ..registry.data import list_datasets

    models = parser.add_argument_group("models")
    models.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"registry name (hf_adaptive_spec.registry.models), {SCENES_VLM} or local HF folder "
                        f"(a VLM when its config has a vision_config) (default {DEFAULT_TARGET})")
    models.add_argument("--drafter", default=DEFAULT_DRAFTER,
                        help=f"registry name, shipped LaSpec drafter name (e.g. laspec-smollm2-135m-instruct) "
                        f"or local HF folder (default {DEFAULT_DRAFTER})")
    models.add_argument("--drafter-int8", action="store_true",
                        help="quantize the DRAFTER's Linear layers to dynamic int8 (CPU only); the target is unchanged")
    models.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    models.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="compute dtype of both models (default float32; bf16 is slower on CPUs)")

    work = parser.add_argument_group("workload")
    work.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"],
                      choices=list_datasets() + [bench_vision.SCENES],
                      help="prompt sets (default: humaneval mtbench; scenes: held-out image prompts for a VLM)")
    work.add_argument("--limit", type=int, default=None,
                      help="prompts per data set, categories interleaved (default: all; scenes: "
                      f"{bench_vision.SCENES_DEFAULT_LIMIT})")
    work.add_argument("--max-new-tokens", type=int, default=128, help="(default 128)")

    meth = parser.add_argument_group("methods")
    meth.add_argument("--strategies", nargs="+", default=None, metavar="STRATEGY",
                      help=f"spec_strategy names (default: every registered one the drafter can serve: "
                      f"{' '.join(STRATEGIES)}; laspec only with a LaSpec drafter)")
    meth.add_argument("--spec-config", action="append", type=_spec_config_arg, default=[],
                      metavar="STRATEGY=JSON", help='spec_config of a strategy, e.g. sage=\'{"n_max": 12}\' '
                      "(repeatable)")
    meth.add_argument("--visual-tokens", nargs="+", type=int, default=None, metavar="M",
                      help="sweep laspec's visual tokens per round: one method laspec_mM per M (e.g. 0 1 2 4 8 16 "
                      "64), spec_config num_visual_tokens=M over any --spec-config laspec=...; needs laspec in "
                      "--strategies")
    meth.add_argument("--stock-best-kwargs", type=_json_object, default=dict(DEFAULT_STOCK_BEST), metavar="JSON",
                      help="drafter generation-config settings of the stock_best run "
                      f"(default {json.dumps(DEFAULT_STOCK_BEST)})")
    meth.add_argument("--no-stock", action="store_true", help="skip both stock assisted-generation runs")
    meth.add_argument("--no-plain-mode", action="store_true",
                      help=f"skip the {PLAIN_MODE} run (spec_strategy='plain': the library's forward without a "
                      "drafter, the second baseline: what speculation adds on top of the faster forward)")

    runs = parser.add_argument_group("run")
    runs.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    runs.add_argument("--warmup", type=int, default=1, help="untimed runs of each method before timing (default 1)")
    runs.add_argument("--seed", type=int, default=0, help="torch.manual_seed (default 0)")
    runs.add_argument("--out", default="bench_results", help="output folder (default bench_results/)")
    runs.add_argument("--no-plots", action="store_true")
    runs.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    runs.add_argument("--cold", action="store_true",
                      help="time the first calls of a fresh process instead (one per strategy; no cost curve, no "
                           "compiled kernel): first speculative call vs plain, third vs warmed "
                           "(hf_adaptive_spec.bench.cold)")
    runs.add_argument("--cold-keep-kernel", action="store_true",
                      help="with --cold: keep the machine's compiled CPU kernel (only the cost curve is fresh)")

    load = parser.add_argument_group("load (hf_adaptive_spec.bench.load: batched prompts instead of one at a time)")
    load.add_argument("--load-sweep", nargs="+", type=int, default=None, metavar="B",
                      help="concurrency sweep: at each level B the first B prompts decode as one left-padded batch, "
                      "plain vs fixed chains and trees vs the adaptive rules of --strategies (default laspec and "
                      "sage with a LaSpec drafter, else sage), e.g. 1 2 4 8 16 32")
    load.add_argument("--load-repeats", type=int, default=1, metavar="R",
                      help="with --load-sweep: timed passes per level, each method keeping its fastest (default 1)")
    load.add_argument("--fixed", nargs="+", default=None, metavar="NAME",
                      help="the fixed structures to run: chainK (K draft tokens in a line) and treeN (N draft "
                      "nodes), e.g. chain1 chain2 tree8 (default chain1 chain2 chain4 chain8 tree8 tree16)")
    load.add_argument("--arrivals", choices=("poisson", "bursty"), default=None,
                      help="replay timed request arrivals through a batching scheduler (plain vs a chain vs the "
                      "adaptive rules): mean and p90 latency, throughput")
    load.add_argument("--rate", type=float, default=1.0, help="with --arrivals: mean requests per second (default 1)")
    load.add_argument("--requests", type=int, default=32, help="with --arrivals: requests in the trace (default 32)")
    load.add_argument("--max-batch", type=int, default=8, help="with --arrivals: most requests per batch (default 8)")
    bench_memory.add_arguments(parser)
    return parser


def main(argv=None) -> int:
    """`python -m hf_adaptive_spec.bench ...`: run, print the overall table; 1 if any output differed or failed."""
    parser = argparse.ArgumentParser(prog="python -m hf_adaptive_spec.bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        results = run(args)
    except ValueError as exc:
        parser.error(str(exc))
    return results["exit_code"]


# ----------------------------------------------------------------------------
# Methods
# ----------------------------------------------------------------------------
@dataclass
class Method:
    """One way to generate.

    Fields:
        name: ``"plain"``, ``"stock_default"``, ``"stock_best"``, a strategy name or a swept variant
            (``"laspec_m8"``).
        kind: ``"plain"``, ``"plain_mode"`` (the library's rounds without a drafter), ``"stock"`` or ``"spec"``.
        spec_config: the strategy's `spec_config` dict (spec only; None = the strategy's defaults).
        drafter_settings: fields set on the drafter's generation config for the call (stock only).
        resolved: the effective settings, for the report.
        strategy: the `spec_strategy` a spec method runs (default: `name`).
        visual_tokens: M of a `--visual-tokens` sweep method, else None.
        calibration: what the cost rule learns (spec only), carried from one of this method's calls to the next.
    """

    name: str
    kind: str
    spec_config: Optional[dict] = None
    drafter_settings: Optional[dict] = None
    resolved: dict = field(default_factory=dict)
    strategy: Optional[str] = None
    visual_tokens: Optional[int] = None
    calibration: SpecCalibration = field(default_factory=SpecCalibration, repr=False, compare=False)

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


def build_methods(args, device: torch.device, drafter=None) -> list:
    """The methods to run, in their base order: plain, stock_default, stock_best, the strategies, then the
    `--visual-tokens` sweep (one laspec method per M).

    Raises `ValueError` for an unknown strategy, a `--spec-config` of a strategy that is not run, an invalid
    config, a stock setting that is not a `GenerationConfig` field, or a sweep without laspec.
    """
    from transformers import GenerationConfig

    from ..strategies import STRATEGIES, resolve_config

    if args.strategies is None:
        args.strategies = _default_strategies(laspec=False)
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
                              resolved=_jsonable(dataclasses.asdict(resolve_config("plain", None, device)))))
    if not args.no_stock:
        known = GenerationConfig()
        for key in args.stock_best_kwargs:
            if not hasattr(known, key):
                raise ValueError(f"--stock-best-kwargs: {key!r} is not a GenerationConfig field.")
        base = _effective_stock_settings(drafter)
        methods.append(Method(STOCK_DEFAULT, "stock", drafter_settings={}, resolved=base))
        methods.append(Method(STOCK_BEST, "stock", drafter_settings=dict(args.stock_best_kwargs),
                              resolved={**base, **args.stock_best_kwargs}))
    spec = [(name, name, None, spec_configs.get(name)) for name in strategies]  # (name, strategy, M, config)
    if getattr(args, "visual_tokens", None):
        spec += [(name, bench_vision.SWEPT_STRATEGY, count, config) for name, count, config in
                 bench_vision.sweep_methods(args.visual_tokens, strategies, spec_configs.get("laspec"))]
    for name, strategy, count, config in spec:
        try:
            resolved = resolve_config(strategy, config, device)
        except TypeError as exc:  # unknown field names
            raise ValueError(f"--spec-config {strategy}: {exc}") from exc
        methods.append(Method(name, "spec", spec_config=config, resolved=_jsonable(dataclasses.asdict(resolved)),
                              strategy=strategy, visual_tokens=count))
    return methods


def _default_strategies(laspec: bool) -> list:
    """Every registered strategy the drafter kind can serve (block-drafter-only ones need a LaSpec drafter)."""
    from ..strategies import STRATEGIES

    return [name for name, cls in STRATEGIES.items()
            if (laspec or not cls.requires_block_drafter) and not cls.drafts_nothing]


def _check_drafter_options(args, laspec: bool) -> None:
    """Fill the default strategy list for the drafter kind; refuse options that cannot apply to it."""
    from ..strategies import STRATEGIES

    if args.strategies is None:
        args.strategies = _default_strategies(laspec)
    if laspec:
        if args.drafter_int8:
            raise ValueError("--drafter-int8 quantizes an independent drafter model; a LaSpec drafter is one small "
                             "forward per round (leave it out).")
        if not args.no_stock:
            raise ValueError("stock assisted generation needs an independent HF model as drafter, not a LaSpec "
                             "drafter: add --no-stock.")
    else:
        block_only = [name for name in args.strategies
                      if name in STRATEGIES and STRATEGIES[name].requires_block_drafter]
        if block_only:
            raise ValueError(f"--strategies {block_only} need a LaSpec drafter (e.g. --drafter "
                             "laspec-smollm2-135m-instruct --target smollm2-135m-instruct); "
                             f"{args.drafter!r} is an independent model.")


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


def _sync(device: torch.device) -> None:
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
    try:
        with _ForwardCounter(target) as counter:
            _sync(device)
            start = time.perf_counter()
            out = target.generate(**inputs, **kwargs)
            _sync(device)
            seconds = time.perf_counter() - start
    finally:
        if saved_config is not None:
            drafter.generation_config = saved_config
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return GenerationRun(tokens, seconds, counter.count, getattr(out, "spec_stats", None))


# ----------------------------------------------------------------------------
# Models and prompts
# ----------------------------------------------------------------------------
def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_model(name: str, args, role: str) -> tuple:
    """`(model, processor)` from a registry name, ``scenes-vlm-135m`` or a local HF folder
    (`loading.load_model`), on `args.device` with `args.dtype`; `role` names the option in an error."""
    model, processor = loading.load_model(name, args.dtype, progress=not getattr(args, "no_progress", False),
                                          option=f"--{role}")
    return model.to(_resolve_device(args.device)), processor


def _default_prompt_loader(dataset: str, limit: Optional[int]) -> list:
    if dataset == bench_vision.SCENES:
        return bench_vision.scene_prompts(limit)
    from ..registry.data import load_prompts

    return load_prompts(dataset, limit=limit)


def encode_prompt(processor, messages: list, device, image=None, dtype=None) -> dict:
    """`{"input_ids", "attention_mask"}` `(1, T)` of the chat template with the generation prompt.

    A tokenizer without a chat template gets the last message's text. With an `image`, `processor` is a VLM's
    processor and every input it makes is returned (pixel values in `dtype`: `bench_vision.encode_image_prompt`).
    """
    if image is not None:
        return bench_vision.encode_image_prompt(processor, messages, image, device, dtype)
    tokenizer = bench_vision.text_tokenizer(processor)
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
    else:
        encoded = tokenizer(messages[-1]["content"], return_tensors="pt")
    input_ids = encoded["input_ids"].to(device)
    attention_mask = encoded.get("attention_mask")
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


# ----------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------
def check_run_options(args) -> None:
    """The options every bench mode shares: --max-new-tokens, --limit, --warmup."""
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1.")
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be >= 1.")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0.")


def _prelude(args, prompt_loader: Optional[PromptLoader] = None) -> tuple:
    """Check every option before anything is loaded, set threads and seed; `(device, laspec drafter?, prompts)`."""
    check_run_options(args)
    if getattr(args, "fixed", None):
        raise ValueError("--fixed picks the fixed structures of --load-sweep / --arrivals; the per-prompt bench runs "
                         "the strategies of --strategies.")
    device = _resolve_device(args.device)
    if args.drafter_int8 and device.type != "cpu":
        raise ValueError("--drafter-int8 uses CPU dynamic-quantization kernels; run it with --device cpu.")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    laspec = loading.is_laspec(args.drafter)
    _check_drafter_options(args, laspec)
    build_methods(args, device)  # validate every option before loading anything

    prompt_loader = prompt_loader or _default_prompt_loader
    prompts = []
    for dataset in dict.fromkeys(args.datasets):
        prompts.extend(prompt_loader(dataset, args.limit))
    if not prompts:
        raise ValueError("no prompts to run.")
    return device, laspec, prompts


def plan_cold(args, prompt_loader: Optional[PromptLoader] = None) -> tuple:
    """`(strategies, {strategy: spec_config}, first prompt)` for `cold.run_cold`, with the bench's checks."""
    if getattr(args, "visual_tokens", None):
        raise ValueError("--cold times one first call per strategy; --visual-tokens sweeps are for the warm bench.")
    device, _, prompts = _prelude(args, prompt_loader)
    spec = [method for method in build_methods(args, device) if method.kind == "spec"]
    return [method.name for method in spec], {method.name: method.spec_config for method in spec}, prompts[0]


def run(args, model_loader: Optional[ModelLoader] = None, prompt_loader: Optional[PromptLoader] = None) -> dict:
    """Run the benchmark described by `args` (from `add_arguments`) and write the outputs to `args.out`.

    Args:
        args: the parsed options.
        model_loader: `(name, args, role) -> (model, processor or tokenizer)`, role "target" or "drafter"
            (default `load_model`).
        prompt_loader: `(dataset, limit) -> [Prompt]` (default `hf_adaptive_spec.registry.data.load_prompts`; scenes:
            `bench_vision.scene_prompts`).

    Returns:
        The results dict also written to ``results.json``; ``results["exit_code"]`` is 0 when every run
        succeeded and matched plain greedy, else 1 (the CLI should exit with it).
    """
    from tqdm.auto import tqdm

    started = _now()
    if getattr(args, "cold", False):
        raise ValueError("--cold runs through `hf-adaptive-spec bench --cold` (hf_adaptive_spec.bench.cold.run_cold).")
    if getattr(args, "load_sweep", None) or getattr(args, "arrivals", None):
        raise ValueError("--load-sweep / --arrivals run through `hf-adaptive-spec bench` "
                         "(hf_adaptive_spec.bench.load.run_load).")
    device, laspec, prompts = _prelude(args, prompt_loader)
    model_loader = model_loader or load_model

    load_start = time.perf_counter()
    target, processor = model_loader(args.target, args, "target")
    tokenizer = bench_vision.text_tokenizer(processor)
    if laspec:  # a LaSpec drafter runs on the target's own states, embedding and LM head
        from ..drafters.hub import load_drafter

        drafter = load_drafter(args.drafter, target)
    else:
        drafter, _ = model_loader(args.drafter, args, "drafter")
    if args.drafter_int8:
        drafter = quantize_drafter(drafter)
    load_seconds = time.perf_counter() - load_start
    methods = build_methods(args, device, drafter)
    pad_token_id = getattr(tokenizer, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(tokenizer, "eos_token_id", None)
    encoded = [encode_prompt(processor, prompt.messages, target.device, getattr(prompt, "image", None), target.dtype)
               for prompt in prompts]

    bar = tqdm(total=len(methods) * (args.warmup + len(prompts)), desc="bench", unit="run",
               disable=args.no_progress, dynamic_ncols=True)
    warmup_errors = {}
    for method in methods:  # untimed: first-call allocations, kernel selection, caches
        for _ in range(args.warmup):
            bar.set_postfix_str(f"warm-up {method.name}")
            try:
                run_method(method, target, drafter, encoded[0], args.max_new_tokens, pad_token_id)
            except Exception as exc:  # recorded again, per prompt, in the timed runs
                warmup_errors[method.name] = _describe(exc)
            bar.update(1)

    records = []
    for index, (prompt, inputs) in enumerate(zip(prompts, encoded)):
        shift = index % len(methods)
        order = methods[shift:] + methods[:shift]  # rotated per prompt: drift spreads over all methods
        runs, errors = {}, {}
        for position, method in enumerate(order):
            bar.set_postfix_str(f"{prompt.id} {method.name}")
            try:
                runs[method.name] = run_method(method, target, drafter, inputs, args.max_new_tokens, pad_token_id)
            except Exception as exc:
                errors[method.name] = _describe(exc)
            bar.update(1)
        order_of = {method.name: position for position, method in enumerate(order)}
        reference = runs.get(PLAIN)
        for method in methods:
            records.append(_record(prompt, inputs, method, runs.get(method.name), errors.get(method.name),
                                   reference, order_of[method.name], tokenizer))
    bar.close()

    results = {
        "command": _command_line(),
        "argv": list(sys.argv),
        "args": _jsonable(vars(args)),
        "environment": _environment(device, started),
        "models": {
            "target": args.target, "drafter": args.drafter, "drafter_int8": bool(args.drafter_int8),
            "target_class": type(target).__name__, "drafter_class": type(drafter).__name__,
            "drafter_datastore": (None if getattr(drafter, "datastore", None) is None
                                  else {"repr": repr(drafter.datastore), **drafter.datastore.info}),
            "load_seconds": load_seconds,
        },
        "settings": {"max_new_tokens": args.max_new_tokens, "greedy": True, "warmup": args.warmup,
                     "datasets": list(dict.fromkeys(args.datasets)), "limit": args.limit,
                     "visual_tokens": getattr(args, "visual_tokens", None)},
        "methods": {m.name: {"kind": m.kind, "strategy": m.strategy if m.kind == "spec" else None,
                             "visual_tokens": m.visual_tokens, "spec_config": m.spec_config,
                             "drafter_settings": m.drafter_settings, "resolved": _jsonable(m.resolved)}
                    for m in methods},
        "prompts": [{"id": p.id, "dataset": p.dataset, "category": p.category} for p in prompts],
        "records": records,
        "warmup_errors": warmup_errors,
    }
    results["aggregates"] = aggregate(records, [m.name for m in methods])
    results["visual_sweep"] = bench_vision.sweep_rows(results["methods"], results["aggregates"]["overall"], records)
    results["failures"] = _failures(records)
    results["ok"] = not results["failures"]["count"]
    results["exit_code"] = 0 if results["ok"] else 1
    results["environment"]["finished"] = _now()
    _write_outputs(results, records, Path(args.out), plots=not args.no_plots)
    _print_summary(results, Path(args.out))
    return results


def _command_line() -> str:
    """The command as typed, as far as `sys.argv` tells (`python -m hf_adaptive_spec.bench` for this module)."""
    argv = list(sys.argv)
    if not argv:
        return ""
    if Path(argv[0]).resolve() in (Path(__file__).resolve(), Path(__file__).with_name("__main__.py").resolve()):
        return shlex.join(["python", "-m", "hf_adaptive_spec.bench"] + argv[1:])
    return shlex.join([Path(argv[0]).name] + argv[1:])


def _first_mismatch(reference: list, tokens: list) -> Optional[int]:
    """Index of the first differing token (a length difference counts), or None when equal."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def _record(prompt, inputs, method, result, error, reference, position, tokenizer) -> dict:
    """One (prompt, method) row of results.json."""
    record = {
        "dataset": prompt.dataset, "category": prompt.category, "prompt_id": prompt.id, "method": method.name,
        "kind": method.kind, "order": position, "prompt_tokens": int(inputs["input_ids"].shape[1]),
        "error": error, "matches_plain": None, "mismatch_at": None,
    }
    if result is None:
        return record
    new_tokens = len(result.tokens)
    record.update(new_tokens=new_tokens, time_s=result.seconds,
                  tokens_per_s=new_tokens / result.seconds if result.seconds > 0 else None,
                  target_forwards=result.target_forwards)
    stats = result.stats
    if stats is not None:  # speculative: tokens produced by rounds / rounds
        record["tau_num"], record["tau_den"] = stats.accepted_tokens + stats.row_rounds, stats.row_rounds
        record["spec_stats"] = _jsonable(stats.to_dict())
        record["accepted_lengths"] = [int(x) for x in stats.accepted_lengths]
        alphas = stats.round_values.get("alpha")  # sage: the confidence that shaped each tree
        if alphas:
            record["sage_alphas"] = [float(x) for x in alphas]
        if prompt.dataset == bench_vision.SCENES and method.kind == "spec":
            record.update(_grounded(tokenizer, result.tokens, record["accepted_lengths"]))
    else:  # plain (1 token per forward) and stock (no prefill: every forward verifies)
        record["tau_num"], record["tau_den"] = new_tokens, result.target_forwards
    if method.kind == "plain":
        record["matches_plain"] = True
        record["tokens"] = result.tokens
        record["text"] = _decode(tokenizer, result.tokens)
    elif reference is not None:
        mismatch = _first_mismatch(reference.tokens, result.tokens)
        record["matches_plain"] = mismatch is None
        record["mismatch_at"] = mismatch
        if mismatch is not None:  # keep the evidence
            record["tokens"] = result.tokens
            record["text"] = _decode(tokenizer, result.tokens)
    return record


def _grounded(tokenizer, tokens: list, accepted_lengths: list) -> dict:
    """``{"grounded": {tokens, accepted}, "other": {...}}`` of a batch-1 speculative run of a scene prompt
    (`bench_vision`), or ``{"grounded_error": reason}`` when its tokens cannot be attributed."""
    from ..scenes.dataset import grounded_words

    try:
        accepted = bench_vision.accepted_mask(len(tokens), accepted_lengths)
        grounded = bench_vision.grounded_mask(
            lambda ids: tokenizer.decode(ids, skip_special_tokens=False), tokens, grounded_words())
        return bench_vision.grounded_counts(accepted, grounded)
    except Exception as exc:  # the accounting must never lose the measurements
        return {"grounded_error": _describe(exc)}


def _decode(tokenizer, tokens: list) -> Optional[str]:
    try:
        return tokenizer.decode(tokens, skip_special_tokens=False)
    except Exception:
        return None


def _failures(records: list) -> dict:
    """Failed runs: an exception, a mismatch with plain greedy, or no plain reference to compare with."""
    items = []
    for r in records:
        if r["error"] is not None:
            reason = r["error"]
        elif r["matches_plain"] is False:
            reason = f"output differs from plain greedy at new token {r['mismatch_at']}"
        elif r["matches_plain"] is None:
            reason = "not checked: the plain run of this prompt failed"
        else:
            continue
        items.append({"method": r["method"], "dataset": r["dataset"], "prompt_id": r["prompt_id"], "reason": reason})
    by_method = {}
    for item in items:
        entry = by_method.setdefault(item["method"], {"count": 0, "prompt_ids": []})
        entry["count"] += 1
        entry["prompt_ids"].append(item["prompt_id"])
    return {"count": len(items), "by_method": by_method, "items": items}


if __name__ == "__main__":
    sys.exit(main())
