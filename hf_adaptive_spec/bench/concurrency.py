"""The bench's batched modes, speculative decoding at several concurrencies: a concurrency sweep
(`--load-sweep`), and a replay of timed request arrivals (`--arrivals`).

    hf-adaptive-spec bench --target smollm2-135m-instruct --drafter laspec-smollm2-135m-instruct \\
        --load-sweep 1 2 4 8 16 32 --max-new-tokens 64 --out bench_load/
    hf-adaptive-spec bench ... --arrivals bursty --rate 0.5 --requests 48 --max-batch 8

Both modes batch text prompts of the bench's data sets (`--datasets`, `--limit`): each prompt is encoded like
`bench.encode_prompt` (chat template, generation prompt) and the rows of a batch are padded on the LEFT (with
their attention mask). Every run is greedy with `--max-new-tokens`, and every row of every speculative run must
equal plain greedy of the same batch, token for token up to the row's EOS: a mismatch or an exception is a
failure and makes the exit code 1.

Methods (`load_methods`), chosen from the drafter kind:

- ``plain``: `generate` without a drafter (the reference);
- fixed structures, the cost rule off, set in advance for every round and every load:
  ``chain1``, ``chain2``, ``chain4``, ``chain8`` (k draft tokens in a line) and ``tree8``, ``tree16`` (n draft
  nodes). With a LaSpec drafter they are `laspec` with ``top_k`` 1 and ``n_max`` k (a chain; only k <= the
  drafter's ``block_size``, its depth limit) or ``top_k`` 2 and ``n_max`` n (the n nodes of highest path
  probability), the context-lookup and datastore branches off so that the structure is exactly that; with an
  independent drafter, `chain` with ``num_draft_tokens`` = min = max = k and ``adaptive`` False, and
  `static_tree` with `default_tree_paths(n, 6)`; `--fixed chain2 tree8 ...` runs a subset (or other sizes);
- the adaptive rule: each of `--strategies` (default ``laspec`` and ``sage`` with a LaSpec drafter, ``sage``
  with an independent one) with its defaults, the cost rule on (``verify_cost`` True) and any `--spec-config`;
- ``best_fixed``: per load level, the fixed structure of highest throughput there, picked AFTER the fact from
  the same runs (no run of its own): what the best per-batch-size table one could tune for this workload
  would ship. Picked on the very runs it is scored on, it is an optimistic reference.

Load sweep (`run_load_sweep`): at concurrency b (rows decoding together) the first b prompts (cycled when
there are fewer) form one batch; each method runs one timed `generate` on it (`time.perf_counter`), in an
order rotated per level so that machine drift spreads over all methods, after `--warmup` untimed short runs
(`WARMUP_TOKENS` new tokens) of each method on the same batch. With `--load-repeats R` every method runs R
timed passes per level (each pass in an order rotated once more) and keeps its fastest: a shared machine only
ever slows a run down, so the fastest of R is the least disturbed. Per level and method:

- new tokens: summed over rows, each row counted up to and including its EOS;
- throughput: new tokens / seconds; speedup: plain's seconds / the method's seconds, same batch;
- tau: `SpecStats.mean_accepted_length` (tokens per row and target verification forward; plain: 1);
- nodes per round: the structure verified, `SpecStats.drafted_tokens / row_rounds`: draft nodes verified per
  row and round, the root (the target's own next token) not counted, a round that verified the root alone
  (drafting paused by the cost rule) counted as 0; candidates per round: `(drafted + pruned) / row_rounds`,
  before the cost rule trimmed the tree. For a fixed structure both are its size (less only near the end of
  `max_new_tokens`); for the adaptive rule they are what the rule chose at that load.

Arrivals (`make_arrivals`, `replay`, `run_arrivals`): a trace of `--requests` arrival times at mean rate
`--rate` (requests/s; `--seed`; `hf_adaptive_spec.traffic` with the replay's `arrivals.ARRIVAL_OPTIONS`), served
by a batching scheduler on a simulated clock: when the server is free, every request that has arrived and waits
(up to `--max-batch`, first come first served) forms the next batch, which runs to completion; its duration is
the measured seconds of actually running `generate` on that batch. Latency of a request: its batch's finish time
- its arrival time (mean, p90 by linear interpolation, max); throughput: new tokens / (last finish - first
arrival). Request i asks prompt i (cycled). Methods: plain, the linear verification (``chain4``, or the longest
chain the drafter has) and the adaptive rule(s), replayed one after another, plain first.

Before timing, `hf_adaptive_spec.prepare` measures the verifier's cost curve at every batch size that will run
(stored on disk: measured once per machine), so that the cost rule prices trees at each load as a prepared
server would.

Outputs in `--out`: ``load_sweep.json`` / ``load_sweep.md`` and the plots ``load_structure_size.png`` (chosen
structure size against load) and ``load_throughput.png`` (throughput against load per method);
``arrivals.json`` / ``arrivals.md``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from .. import traffic
from .arrivals import ARRIVAL_KINDS, ARRIVAL_OPTIONS, make_arrivals, replay, run_arrivals, summarize_replay
from .batch_runs import (CHAIN_LENGTHS, TREE_SIZES, WARMUP_TOKENS, BatchRun, LoadMethod, arrival_methods,
                         decode_batch, load_methods, pad_encodings, pad_id, row_tokens, structure_stats)
from .concurrency_options import check_options, fixed_structures
from .concurrency_report import PLOT_FILES, arrivals_markdown, sweep_markdown, write_load_plots
from .concurrency_sweep import best_fixed, run_load_sweep
from .report import command_line, describe, environment, jsonable, now
from .inputs import load_drafter_option, load_on_device
from ..chat_template import text_tokenizer

__all__ = [
    "ARRIVAL_KINDS",
    "ARRIVAL_OPTIONS",
    "CHAIN_LENGTHS",
    "PLOT_FILES",
    "TREE_SIZES",
    "BatchRun",
    "LoadMethod",
    "arrival_methods",
    "best_fixed",
    "decode_batch",
    "load_methods",
    "fixed_structures",
    "make_arrivals",
    "pad_encodings",
    "replay",
    "row_tokens",
    "run_arrivals",
    "run",
    "run_load_sweep",
    "structure_stats",
    "summarize_replay",
]


def _load_models(args, model_loader) -> tuple:
    """`(target, tokenizer, drafter, load seconds)`, as the bench loads them."""
    start = time.perf_counter()
    target, processor = (model_loader or load_on_device)(args.target, args, "target")
    tokenizer = text_tokenizer(processor)
    drafter = load_drafter_option(args.drafter, target, args, args.drafter_int8, model_loader)
    return target, tokenizer, drafter, time.perf_counter() - start


def _prepare(target, drafter, methods: Sequence[LoadMethod], batch_sizes: Sequence[int]) -> dict:
    """The verifier's cost curve at every batch size that will run (`hf_adaptive_spec.prepare`: measured once
    per machine, then read from disk), for each adaptive strategy. A failure is reported, never fatal."""
    from ..decoding.prepare import prepare

    done = {"batch_sizes": sorted(set(batch_sizes)), "strategies": [], "seconds": 0.0, "error": None}
    start = time.perf_counter()
    for method in methods:
        if method.family != "adaptive" or method.strategy in done["strategies"]:
            continue
        try:
            prepare(target, drafter, method.strategy, batch_sizes=done["batch_sizes"], spec_config=method.spec_config)
        except Exception as exc:
            done["error"] = f"{method.strategy}: {describe(exc)}"
            break
        done["strategies"].append(method.strategy)
    done["seconds"] = time.perf_counter() - start
    return done


def run(args, model_loader=None, prompt_loader=None) -> dict:
    """Run `--load-sweep` and/or `--arrivals` as `args` (from `bench.add_arguments`) describe; write the outputs
    to `args.out`.

    Args:
        args: the parsed bench options.
        model_loader: `(name, args, role) -> (model, tokenizer)` (default `bench.load_on_device`).
        prompt_loader: `(dataset, limit) -> [Prompt]` (default: the bench's).

    Returns:
        ``{"load_sweep": results or None, "arrivals": results or None, "exit_code": 0 or 1}``; each results dict
        is also written as JSON, with a Markdown report beside it.
    """
    from tqdm.auto import tqdm

    started = now()
    device, laspec, prompts, adaptive, spec_configs, levels = check_options(args, prompt_loader)
    target, tokenizer, drafter, load_seconds = _load_models(args, model_loader)
    block_size = getattr(getattr(drafter, "config", None), "block_size", None) if laspec else None
    chains, trees = fixed_structures(getattr(args, "fixed", None))
    methods, skipped = load_methods(laspec, adaptive, spec_configs, block_size, chains, trees,
                                    plain_mode=not getattr(args, "no_plain_mode", False))
    pad_token_id = pad_id(tokenizer)
    sizes = list(levels) + (list(range(1, args.max_batch + 1)) if args.arrivals else [])
    prepared = _prepare(target, drafter, methods, sizes)
    header = {
        "command": command_line(),
        "argv": list(sys.argv),
        "args": jsonable(vars(args)),
        "models": {"target": args.target, "drafter": args.drafter, "drafter_int8": bool(args.drafter_int8),
                   "target_class": type(target).__name__, "drafter_class": type(drafter).__name__,
                   "drafter_block_size": block_size, "load_seconds": load_seconds},
        "prepare": prepared,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    output = {"load_sweep": None, "arrivals": None}

    if levels:
        bar = tqdm(total=len(levels) * len(methods) * (args.load_repeats + args.warmup), desc="load sweep",
                   unit="run", disable=args.no_progress, dynamic_ncols=True)
        sweep = run_load_sweep(target, tokenizer, drafter, prompts, levels, methods, args.max_new_tokens,
                               pad_token_id, args.warmup, bar, repeats=args.load_repeats)
        bar.close()
        results = {"mode": "load_sweep", **header, "environment": environment(device, started),
                   "settings": {"max_new_tokens": args.max_new_tokens, "greedy": True, "warmup": args.warmup,
                                "repeats": args.load_repeats,
                                "warmup_tokens": WARMUP_TOKENS, "levels": levels,
                                "datasets": list(dict.fromkeys(args.datasets)), "limit": args.limit},
                   "methods": {m.name: m.to_dict() for m in methods}, "skipped_methods": skipped, **sweep}
        results["ok"] = not results["failures"]["count"]
        results["environment"]["finished"] = now()
        results["plots"] = (write_load_plots(results, out_dir) if not args.no_plots
                            else {"files": {}, "skipped": ["--no-plots"]})
        results["files"] = {"json": "load_sweep.json", "markdown": "load_sweep.md", **results["plots"]["files"]}
        (out_dir / "load_sweep.json").write_text(json.dumps(jsonable(results), indent=1))
        markdown = sweep_markdown(results)
        (out_dir / "load_sweep.md").write_text(markdown)
        print(markdown)
        output["load_sweep"] = results

    if args.arrivals:
        arrivals = make_arrivals(args.arrivals, args.rate, args.requests, args.seed)
        chosen = arrival_methods(methods)
        bar = tqdm(desc="arrivals", unit="batch", disable=args.no_progress, dynamic_ncols=True)
        replayed = run_arrivals(target, tokenizer, drafter, prompts, arrivals, chosen, args.max_new_tokens,
                                args.max_batch, pad_token_id, args.warmup, bar)
        bar.close()
        results = {"mode": "arrivals", **header, "environment": environment(device, started),
                   "settings": {"max_new_tokens": args.max_new_tokens, "greedy": True, "warmup": args.warmup,
                                "arrivals": args.arrivals, "rate": args.rate, "requests": args.requests,
                                "max_batch": args.max_batch, "seed": args.seed, "burst_size": traffic.BURST_SIZE,
                                "arrival_options": dataclasses.asdict(ARRIVAL_OPTIONS),
                                "percentile": traffic.PERCENTILE_METHOD,
                                "datasets": list(dict.fromkeys(args.datasets)), "limit": args.limit},
                   "arrival_times": arrivals,
                   "method_settings": {m.name: m.to_dict() for m in chosen}, **replayed}
        results["ok"] = not results["failures"]["count"]
        results["environment"]["finished"] = now()
        results["files"] = {"json": "arrivals.json", "markdown": "arrivals.md"}
        (out_dir / "arrivals.json").write_text(json.dumps(jsonable(results), indent=1))
        markdown = arrivals_markdown(results)
        (out_dir / "arrivals.md").write_text(markdown)
        print(markdown)
        output["arrivals"] = results

    failed = any(r is not None and not r["ok"] for r in output.values())
    output["exit_code"] = 1 if failed else 0
    return output
