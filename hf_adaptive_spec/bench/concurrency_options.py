"""The batched modes' options, checked before anything loads: the load levels, the fixed structures
(`--fixed`), the adaptive rules (`--strategies`) and their `--spec-config`, the arrivals' trace."""

from __future__ import annotations

import re
from typing import Optional, Sequence

import torch

from ..loading import is_laspec
from .batch_runs import CHAIN_LENGTHS, TREE_SIZES, load_methods
from .inputs import bench_prompts, default_prompt_loader, resolve_device
from .options import check_run_options
from .vision import SCENES

__all__ = ["ADAPTIVE_STRATEGIES", "adaptive_strategies", "check_options", "fixed_structures", "sweep_levels"]


ADAPTIVE_STRATEGIES = ("laspec", "sage", "chain")  # strategies with a cost rule


def sweep_levels(args) -> list:
    levels = list(dict.fromkeys(args.load_sweep or []))
    bad = [b for b in levels if b < 1]
    if bad:
        raise ValueError(f"--load-sweep levels are batch sizes >= 1, got {bad[0]}.")
    if getattr(args, "load_repeats", 1) < 1:
        raise ValueError(f"--load-repeats takes the number of timed passes per level, >= 1; got {args.load_repeats}.")
    return levels


def fixed_structures(names: Optional[Sequence[str]]) -> tuple:
    """`(chain_lengths, tree_sizes)` from `--fixed` names such as ``chain2`` and ``tree8`` (None: the defaults)."""
    if names is None:
        return CHAIN_LENGTHS, TREE_SIZES
    sizes = {"chain": [], "tree": []}
    for name in dict.fromkeys(names):
        match = re.fullmatch(r"(chain|tree)([1-9][0-9]*)", name)
        if match is None:
            raise ValueError(f"--fixed {name}: name chainK (K >= 1 draft tokens in a line) or treeN (N >= 1 draft "
                             "nodes), e.g. chain2 tree8.")
        sizes[match[1]].append(int(match[2]))
    return tuple(sizes["chain"]), tuple(sizes["tree"])


def adaptive_strategies(args, laspec: bool) -> list:
    """The adaptive rules to run: `--strategies`, else laspec and sage (LaSpec drafter) or sage."""
    from ..strategies import STRATEGIES

    names = list(dict.fromkeys(args.strategies or (["laspec", "sage"] if laspec else ["sage"])))
    for name in names:
        if name not in STRATEGIES:
            raise ValueError(f"Unknown strategy {name!r} in --strategies; valid: {', '.join(STRATEGIES)}.")
        if name not in ADAPTIVE_STRATEGIES:
            raise ValueError(f"--strategies {name}: with --load-sweep / --arrivals, --strategies names the adaptive "
                             f"rules ({', '.join(ADAPTIVE_STRATEGIES)}); the fixed chains and trees run already.")
        if STRATEGIES[name].requires_block_drafter and not laspec:
            raise ValueError(f"--strategies {name} needs a LaSpec drafter (e.g. --drafter laspec-smollm2-135m-instruct "
                             f"--target smollm2-135m-instruct); {args.drafter!r} is an independent model.")
    return names


def check_options(args, prompt_loader) -> tuple:
    """Check every option before anything loads, set threads and seed; `(device, laspec?, prompts, adaptive,
    spec_configs, levels)`."""
    from ..strategies import resolve_config

    levels = sweep_levels(args)
    if not levels and not args.arrivals:
        raise ValueError("nothing to run: give --load-sweep B ... and/or --arrivals poisson|bursty.")
    if getattr(args, "cold", False):
        raise ValueError("--cold times the first calls of a fresh process; run it apart from --load-sweep / "
                         "--arrivals.")
    if getattr(args, "visual_tokens", None):
        raise ValueError("--visual-tokens sweeps are for the per-prompt bench, not --load-sweep / --arrivals.")
    if SCENES in args.datasets:
        raise ValueError("--load-sweep / --arrivals batch text prompts; --datasets scenes (image prompts) is not "
                         "supported there.")
    check_run_options(args)
    if args.arrivals:
        if not args.rate > 0:
            raise ValueError("--rate must be > 0 requests/s.")
        if args.requests < 1:
            raise ValueError("--requests must be >= 1.")
        if args.max_batch < 1:
            raise ValueError("--max-batch must be >= 1.")
    device = resolve_device(args.device)
    laspec = is_laspec(args.drafter)
    if args.drafter_int8 and laspec:
        raise ValueError("--drafter-int8 quantizes an independent drafter model; a LaSpec drafter is one small "
                         "forward per round (leave it out).")
    if args.drafter_int8 and device.type != "cpu":
        raise ValueError("--drafter-int8 uses CPU dynamic-quantization kernels; run it with --device cpu.")
    adaptive = adaptive_strategies(args, laspec)
    spec_configs = {}
    for name, config in args.spec_config:
        if name not in adaptive:
            raise ValueError(f"--spec-config names {name!r}, which is not among the adaptive rules {adaptive} "
                             "(with --load-sweep / --arrivals it sets an adaptive rule; fixed structures are set).")
        spec_configs[name] = {**spec_configs.get(name, {}), **config}
    chains, trees = fixed_structures(getattr(args, "fixed", None))
    for method in load_methods(laspec, adaptive, spec_configs, chain_lengths=chains, tree_sizes=trees)[0]:
        if method.strategy is not None:
            try:
                resolve_config(method.strategy, method.spec_config, device)
            except TypeError as exc:  # unknown field names
                raise ValueError(f"--spec-config {method.strategy}: {exc}") from exc
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    prompts = bench_prompts(args, prompt_loader or default_prompt_loader)
    return device, laspec, prompts, adaptive, spec_configs, levels
