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
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from .. import loading
from ..chat_template import text_tokenizer
from . import vision as bench_vision
from .batch_runs import pad_id
from .inputs import (bench_prompts, default_prompt_loader, encode_prompt, load_drafter_option, load_on_device,
                     resolve_device)
from .methods import GenerationRun, Method, build_methods, check_baseline_options, check_drafter_options, run_method
from .options import DEFAULT_DRAFTER, DEFAULT_STOCK_BEST, DEFAULT_TARGET, add_arguments, check_run_options
from .report import command_line, describe, environment, jsonable, now, print_summary, write_outputs
from .stats import PLAIN, aggregate

__all__ = [
    "DEFAULT_DRAFTER",
    "DEFAULT_STOCK_BEST",
    "DEFAULT_TARGET",
    "GenerationRun",
    "Method",
    "add_arguments",
    "build_methods",
    "encode_prompt",
    "load_drafter_option",
    "load_on_device",
    "main",
    "run",
    "run_method",
]

ModelLoader = Callable[[str, argparse.Namespace, str], tuple]  # (name, args, role) -> (model, processor)
PromptLoader = Callable[[str, Optional[int]], list]  # (dataset, limit) -> [Prompt]


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


def _prelude(args, prompt_loader: Optional[PromptLoader] = None) -> tuple:
    """Check every option before anything is loaded, set threads and seed; `(device, laspec drafter?, prompts)`."""
    check_run_options(args)
    if getattr(args, "fixed", None):
        raise ValueError("--fixed picks the fixed structures of --load-sweep / --arrivals; the per-prompt bench runs "
                         "the strategies of --strategies.")
    device = resolve_device(args.device)
    if args.drafter_int8 and device.type != "cpu":
        raise ValueError("--drafter-int8 uses CPU dynamic-quantization kernels; run it with --device cpu.")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    laspec = loading.is_laspec(args.drafter)
    check_drafter_options(args, laspec)
    baseline = getattr(args, "baseline_drafter", None)
    check_baseline_options(args, laspec, baseline is not None and loading.is_laspec(baseline))
    build_methods(args, device)  # validate every option before loading anything

    prompts = bench_prompts(args, prompt_loader or default_prompt_loader)
    return device, laspec, prompts


def plan_cold(args, prompt_loader: Optional[PromptLoader] = None) -> tuple:
    """`(strategies, {strategy: spec_config}, first prompt)` for `cold.run_cold`, with the bench's checks."""
    if getattr(args, "visual_tokens", None):
        raise ValueError("--cold times one first call per strategy; --visual-tokens sweeps are for the warm bench.")
    device, _, prompts = _prelude(args, prompt_loader)
    spec = [method for method in build_methods(args, device) if method.kind == "spec"]
    return [method.name for method in spec], {method.name: method.spec_config for method in spec}, prompts[0]


def _load_baseline(args, target, model_loader):
    """The `--baseline-drafter` (None without one), loaded like `--drafter`."""
    name = getattr(args, "baseline_drafter", None)
    if name is None:
        return None
    return load_drafter_option(name, target, args, args.baseline_drafter_int8, model_loader)


def run(args, model_loader: Optional[ModelLoader] = None, prompt_loader: Optional[PromptLoader] = None) -> dict:
    """Run the benchmark described by `args` (from `add_arguments`) and write the outputs to `args.out`.

    Args:
        args: the parsed options.
        model_loader: `(name, args, role) -> (model, processor or tokenizer)`, role "target" or "drafter"
            (default `load_on_device`).
        prompt_loader: `(dataset, limit) -> [Prompt]` (default `hf_adaptive_spec.registry.data.load_prompts`; scenes:
            `bench_vision.scene_prompts`).

    Returns:
        The results dict also written to ``results.json``; ``results["exit_code"]`` is 0 when every run
        succeeded and matched plain greedy, else 1 (the CLI should exit with it).
    """
    from tqdm.auto import tqdm

    started = now()
    if getattr(args, "cold", False):
        raise ValueError("--cold runs through `hf-adaptive-spec bench --cold` (hf_adaptive_spec.bench.cold.run_cold).")
    if getattr(args, "load_sweep", None) or getattr(args, "arrivals", None):
        raise ValueError("--load-sweep / --arrivals run through `hf-adaptive-spec bench` "
                         "(hf_adaptive_spec.bench.concurrency.run).")
    device, laspec, prompts = _prelude(args, prompt_loader)
    model_loader = model_loader or load_on_device

    load_start = time.perf_counter()
    target, processor = model_loader(args.target, args, "target")
    tokenizer = text_tokenizer(processor)
    drafter = load_drafter_option(args.drafter, target, args, args.drafter_int8, model_loader)
    drafters = {"main": drafter, "baseline": _load_baseline(args, target, model_loader)}
    load_seconds = time.perf_counter() - load_start
    stock_role = "baseline" if laspec and drafters["baseline"] is not None else "main"
    methods = build_methods(args, device, drafters[stock_role], stock_drafter_role=stock_role)
    pad_token_id = pad_id(tokenizer)
    encoded = [encode_prompt(processor, prompt.messages, target.device, getattr(prompt, "image", None), target.dtype)
               for prompt in prompts]

    bar = tqdm(total=len(methods) * (args.warmup + len(prompts)), desc="bench", unit="run",
               disable=args.no_progress, dynamic_ncols=True)
    warmup_errors = {}
    for method in methods:  # untimed: first-call allocations, kernel selection, caches
        for _ in range(args.warmup):
            bar.set_postfix_str(f"warm-up {method.name}")
            try:
                run_method(method, target, drafters[method.drafter_role], encoded[0], args.max_new_tokens,
                           pad_token_id)
            except Exception as exc:  # recorded again, per prompt, in the timed runs
                warmup_errors[method.name] = describe(exc)
            bar.update(1)

    records = []
    for index, (prompt, inputs) in enumerate(zip(prompts, encoded)):
        shift = index % len(methods)
        order = methods[shift:] + methods[:shift]  # rotated per prompt: drift spreads over all methods
        runs, errors = {}, {}
        for position, method in enumerate(order):
            bar.set_postfix_str(f"{prompt.id} {method.name}")
            try:
                runs[method.name] = run_method(method, target, drafters[method.drafter_role], inputs,
                                               args.max_new_tokens, pad_token_id)
            except Exception as exc:
                errors[method.name] = describe(exc)
            bar.update(1)
        order_of = {method.name: position for position, method in enumerate(order)}
        reference = runs.get(PLAIN)
        for method in methods:
            records.append(_record(prompt, inputs, method, runs.get(method.name), errors.get(method.name),
                                   reference, order_of[method.name], tokenizer))
    bar.close()

    results = {
        "command": command_line(),
        "argv": list(sys.argv),
        "args": jsonable(vars(args)),
        "environment": environment(device, started),
        "models": {
            "target": args.target, "drafter": args.drafter, "drafter_int8": bool(args.drafter_int8),
            "target_class": type(target).__name__, "drafter_class": type(drafter).__name__,
            "drafter_datastore": (None if getattr(drafter, "datastore", None) is None
                                  else {"repr": repr(drafter.datastore), **drafter.datastore.info}),
            "load_seconds": load_seconds,
            "baseline_drafter": getattr(args, "baseline_drafter", None),
            "baseline_drafter_int8": bool(getattr(args, "baseline_drafter_int8", False)),
        },
        "settings": {"max_new_tokens": args.max_new_tokens, "greedy": True, "warmup": args.warmup,
                     "datasets": list(dict.fromkeys(args.datasets)), "limit": args.limit,
                     "skip": getattr(args, "skip", 0),
                     "visual_tokens": getattr(args, "visual_tokens", None)},
        "methods": {m.name: {"kind": m.kind, "strategy": m.strategy if m.kind == "spec" else None,
                             "visual_tokens": m.visual_tokens, "visual_selection": m.visual_selection,
                             "spec_config": m.spec_config,
                             "drafter_settings": m.drafter_settings, "resolved": jsonable(m.resolved)}
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
    results["environment"]["finished"] = now()
    write_outputs(results, records, Path(args.out), plots=not args.no_plots)
    print_summary(results, Path(args.out))
    return results



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
        record["spec_stats"] = jsonable(stats.to_dict())
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
        return {"grounded_error": describe(exc)}


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
