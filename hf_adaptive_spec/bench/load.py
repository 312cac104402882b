"""Speculative decoding under load: a concurrency sweep, and a replay of timed request arrivals.

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
`--rate` (requests/s; `--seed`), served by a batching scheduler on a simulated clock: when the server is free,
every request that has arrived and waits (up to `--max-batch`, first come first served) forms the next batch,
which runs to completion; its duration is the measured seconds of actually running `generate` on that batch.
Latency of a request: its batch's finish time - its arrival time; throughput: new tokens / (last finish -
first arrival). Request i asks prompt i (cycled). Methods: plain, the linear verification (``chain4``, or the
longest chain the drafter has) and the adaptive rule(s), replayed one after another, plain first.

Before timing, `hf_adaptive_spec.prepare` measures the verifier's cost curve at every batch size that will run
(stored on disk: measured once per machine), so that the cost rule prices trees at each load as a prepared
server would.

Outputs in `--out`: ``load_sweep.json`` / ``load_sweep.md`` and the plots ``load_structure_size.png`` (chosen
structure size against load) and ``load_throughput.png`` (throughput against load per method);
``arrivals.json`` / ``arrivals.md``.
"""

from __future__ import annotations

import collections
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .. import loading
from . import run as bench
from . import report as bench_report
from . import stats as bench_stats
from . import vision as bench_vision
from ..cost import SpecCalibration
from ..drafters.quantize import quantize_drafter

__all__ = [
    "ARRIVAL_KINDS",
    "BatchRun",
    "LoadMethod",
    "arrival_methods",
    "best_fixed",
    "decode_batch",
    "left_pad",
    "load_methods",
    "fixed_structures",
    "make_arrivals",
    "replay",
    "row_tokens",
    "run_arrivals",
    "run_load",
    "run_load_sweep",
    "structure_stats",
    "summarize_replay",
]

PLAIN = bench_stats.PLAIN
CHAIN_LENGTHS = (1, 2, 4, 8)
TREE_SIZES = (8, 16)
LASPEC_TREE_TOP_K = 2  # children offered per node of a fixed laspec tree
STATIC_TREE_DEPTH = 6  # depth limit of a fixed static tree (`default_tree_paths`)
LINEAR_CHAIN = 4  # the arrivals' linear verification: a chain of this many draft tokens (or the longest one run)
ADAPTIVE_STRATEGIES = ("laspec", "sage", "chain")  # strategies with a cost rule
ARRIVAL_KINDS = ("poisson", "bursty")
BURST_SIZE = 4  # mean requests per burst of a bursty trace
WARMUP_TOKENS = 16  # new tokens of an untimed warm-up run
P90 = 0.9
PLOT_FILES = {"structure": "load_structure_size.png", "throughput": "load_throughput.png"}
# the fixed laspec structures: no cost rule, no context-lookup or datastore branch beside the drafted tree
_LASPEC_FIXED = {"verify_cost": False, "context_lookup": 0, "datastore": False}


# ----------------------------------------------------------------------------
# Methods
# ----------------------------------------------------------------------------
@dataclass
class LoadMethod:
    """One way to decode a batch.

    Fields:
        name: ``"plain"``, ``"chain{k}"``, ``"tree{n}"`` or the adaptive strategy's name.
        family: ``"plain"``, ``"fixed"`` (a structure set in advance, cost rule off) or ``"adaptive"`` (the
            strategy's rule with the cost rule on).
        strategy: the `spec_strategy` (None for plain).
        spec_config: the strategy's `spec_config` dict (None for plain).
        size: draft nodes per round of a fixed structure (k of a chain, n of a tree); None otherwise.
        calibration: what the cost rule learns, carried from one of this method's calls to the next.
    """

    name: str
    family: str
    strategy: Optional[str] = None
    spec_config: Optional[dict] = None
    size: Optional[int] = None
    calibration: SpecCalibration = field(default_factory=SpecCalibration, repr=False, compare=False)

    def generate_kwargs(self, drafter) -> dict:
        """The speculative `generate` arguments of this method (none for plain)."""
        if self.family == "plain":
            return {}
        return {"assistant_model": drafter, "spec_strategy": self.strategy,
                "spec_config": None if self.spec_config is None else dict(self.spec_config),
                "spec_calibration": self.calibration}

    def to_dict(self) -> dict:
        return {"family": self.family, "strategy": self.strategy,
                "spec_config": bench_report._jsonable(self.spec_config), "size": self.size}


def load_methods(laspec: bool, adaptive: Sequence[str], spec_configs: Optional[dict] = None,
                 block_size: Optional[int] = None, chain_lengths: Sequence[int] = CHAIN_LENGTHS,
                 tree_sizes: Sequence[int] = TREE_SIZES) -> tuple:
    """The methods of the load modes, in their base order: plain, the fixed chains and trees, the adaptive rules.

    Args:
        laspec: True for a LaSpec drafter (fixed structures through `laspec`), False for an independent one
            (through `chain` and `static_tree`).
        adaptive: the adaptive strategies, e.g. ``["laspec", "sage"]``.
        spec_configs: `{strategy: spec_config dict}` for the adaptive methods (over the cost rule on).
        block_size: a LaSpec drafter's block size: chains longer than it are left out (it drafts no deeper).
        chain_lengths / tree_sizes: the fixed structures.

    Returns:
        `(methods, skipped)`: a list of `LoadMethod` and `{name: reason}` of the fixed structures left out.
    """
    from ..strategies import default_tree_paths

    spec_configs = spec_configs or {}
    methods, skipped = [LoadMethod(PLAIN, "plain")], {}
    for k in chain_lengths:
        name = f"chain{k}"
        if laspec:
            if block_size is not None and k > block_size:
                skipped[name] = f"the LaSpec drafter drafts at most block_size={block_size} tokens per round"
                continue
            methods.append(LoadMethod(name, "fixed", "laspec", {"top_k": 1, "n_max": k, **_LASPEC_FIXED}, k))
        else:
            config = {"num_draft_tokens": k, "min_draft_tokens": k, "max_draft_tokens": k, "adaptive": False,
                      "verify_cost": False}
            methods.append(LoadMethod(name, "fixed", "chain", config, k))
    for n in tree_sizes:
        if laspec:
            config = {"top_k": LASPEC_TREE_TOP_K, "n_max": n, **_LASPEC_FIXED}
            methods.append(LoadMethod(f"tree{n}", "fixed", "laspec", config, n))
        else:
            paths = [list(path) for path in default_tree_paths(n, STATIC_TREE_DEPTH)]
            methods.append(LoadMethod(f"tree{n}", "fixed", "static_tree", {"paths": paths}, n))
    for strategy in adaptive:
        config = {"verify_cost": True, **(spec_configs.get(strategy) or {})}
        methods.append(LoadMethod(strategy, "adaptive", strategy, config))
    return methods, skipped


def arrival_methods(methods: Sequence[LoadMethod]) -> list:
    """The arrivals' methods: plain, the linear verification (``chain4``, else the longest chain) and every
    adaptive method."""
    chains = [m for m in methods if m.family == "fixed" and m.name.startswith("chain")]
    linear = next((m for m in chains if m.size == LINEAR_CHAIN), max(chains, key=lambda m: m.size, default=None))
    chosen = [m for m in methods if m.family == "plain"] + ([linear] if linear is not None else [])
    return chosen + [m for m in methods if m.family == "adaptive"]


# ----------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------
def left_pad(encoded: Sequence[dict], pad_token_id: int) -> dict:
    """One batch `{"input_ids", "attention_mask"}` `(B, T_max)` from B encoded prompts `(1, T_i)`, each row
    padded on the left with `pad_token_id` (attention mask 0)."""
    width = max(e["input_ids"].shape[1] for e in encoded)
    first = encoded[0]["input_ids"]
    input_ids = torch.full((len(encoded), width), pad_token_id, dtype=first.dtype, device=first.device)
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long, device=first.device)
    for row, e in enumerate(encoded):
        length = e["input_ids"].shape[1]
        input_ids[row, width - length:] = e["input_ids"][0]
        attention_mask[row, width - length:] = e["attention_mask"][0]
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def row_tokens(sequences: torch.Tensor, prompt_width: int, eos_token_ids: Sequence[int] = ()) -> list:
    """Each row's new tokens `[[int]]` from `generate`'s `sequences` `(B, T + N)`, up to and including the row's
    first EOS (after it, `generate` only pads)."""
    eos = set(eos_token_ids)
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        rows.append(row[:end])
    return rows


def _eos_ids(target) -> list:
    eos = getattr(target.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


@dataclass
class BatchRun:
    """What one batched `generate` gave: new tokens per row (up to its EOS), seconds, `SpecStats` or None."""

    rows: list
    seconds: float
    stats: object = None


@torch.no_grad()
def decode_batch(method: LoadMethod, target, drafter, inputs: dict, max_new_tokens: int,
                 pad_token_id: Optional[int] = None, eos_token_ids: Sequence[int] = ()) -> BatchRun:
    """One greedy `generate` of `method` on the left-padded batch `inputs`, timed with `time.perf_counter`."""
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
                  **method.generate_kwargs(drafter))
    if pad_token_id is not None:
        kwargs["pad_token_id"] = pad_token_id
    device = inputs["input_ids"].device
    bench._sync(device)
    start = time.perf_counter()
    out = target.generate(**inputs, **kwargs)
    bench._sync(device)
    seconds = time.perf_counter() - start
    rows = row_tokens(out.sequences, inputs["input_ids"].shape[1], eos_token_ids)
    return BatchRun(rows, seconds, getattr(out, "spec_stats", None))


def structure_stats(stats) -> dict:
    """tau and the structure verified per row and round, from a run's `SpecStats` (None: plain, tau 1).

    ``nodes_per_round`` = drafted_tokens / row_rounds (draft nodes verified per row and round, root not
    counted, paused rounds as 0); ``candidates_per_round`` = (drafted + pruned) / row_rounds (before the cost
    rule); the sums (``tau_num``, ``tau_den`` = row_rounds, ``drafted``, ``pruned``) pool over runs.
    """
    if stats is None:
        return {"tau": 1.0, "nodes_per_round": None, "candidates_per_round": None, "rounds": None,
                "row_rounds": None, "paused_rounds": None, "acceptance_rate": None, "tau_num": None, "tau_den": None,
                "drafted": None, "pruned": None}
    row_rounds = stats.row_rounds
    return {
        "tau": stats.mean_accepted_length if row_rounds else None,
        "nodes_per_round": stats.drafted_tokens / row_rounds if row_rounds else None,
        "candidates_per_round": (stats.drafted_tokens + stats.pruned_tokens) / row_rounds if row_rounds else None,
        "rounds": stats.rounds, "row_rounds": row_rounds, "paused_rounds": stats.paused_rounds,
        "acceptance_rate": stats.acceptance_rate if stats.drafted_tokens else None,
        "tau_num": stats.accepted_tokens + row_rounds, "tau_den": row_rounds,
        "drafted": stats.drafted_tokens, "pruned": stats.pruned_tokens,
    }


def _mismatched_rows(reference: list, rows: list) -> list:
    """Rows (indices) whose tokens differ from the reference's (a missing or extra row differs too)."""
    differ = [i for i, (a, b) in enumerate(zip(reference, rows)) if a != b]
    return differ + list(range(min(len(reference), len(rows)), max(len(reference), len(rows))))


def _encoder(tokenizer, prompts: Sequence, device) -> Callable[[int], dict]:
    """`index -> {"input_ids", "attention_mask"}` `(1, T)` of prompt `index % len(prompts)`, encoded once."""
    cache = {}

    def encode(index: int) -> dict:
        index %= len(prompts)
        if index not in cache:
            prompt = prompts[index]
            messages = getattr(prompt, "messages", prompt)
            cache[index] = bench.encode_prompt(tokenizer, messages, device)
        return cache[index]

    return encode


def _prompt_id(prompts: Sequence, index: int):
    return getattr(prompts[index % len(prompts)], "id", index % len(prompts))


def _pad_id(tokenizer) -> Optional[int]:
    pad = getattr(tokenizer, "pad_token_id", None)
    return getattr(tokenizer, "eos_token_id", None) if pad is None else pad


# ----------------------------------------------------------------------------
# Load sweep
# ----------------------------------------------------------------------------
def run_load_sweep(target, tokenizer, drafter, prompts: Sequence, levels: Sequence[int], methods: Sequence[LoadMethod],
                   max_new_tokens: int, pad_token_id: Optional[int] = None, warmup: int = 1, progress=None,
                   repeats: int = 1) -> dict:
    """Run every method at every concurrency level and check each row against plain greedy of the same batch.

    Args:
        target: the target model (its `generate` runs every method).
        tokenizer: encodes the prompts (`bench.encode_prompt`: chat template when it has one).
        drafter: the drafter of the speculative methods.
        prompts: `Prompt`s (or lists of chat messages); level b takes the first b, cycled when fewer.
        levels: the concurrency levels (batch sizes), e.g. ``[1, 2, 4, 8, 16, 32]``.
        methods: from `load_methods`; must include plain (the reference).
        max_new_tokens: new tokens per row (greedy).
        pad_token_id: left padding and `generate`'s padding (default: the tokenizer's pad, else EOS token).
        warmup: untimed runs of each method (`WARMUP_TOKENS` new tokens) on each level's batch before timing.
        progress: a tqdm-like bar (`update`, `set_postfix_str`), or None.
        repeats: timed passes per level, each in the order rotated once more; a method's record is its fastest
            pass (every pass's rows are checked against plain's).

    Returns:
        `dict` with ``records`` (one per level and method: seconds (the fastest pass), repeat_seconds (every
        pass), new_tokens, row_tokens, tokens_per_s, speedup_vs_plain, tau, nodes_per_round, candidates_per_round,
        matches_plain, mismatched_rows, error, order), ``levels`` (per level: its prompts and their lengths), ``best_fixed`` (`best_fixed`),
        ``warmup_errors`` and ``failures``.
    """
    if not any(m.family == "plain" for m in methods):
        raise ValueError("run_load_sweep needs the plain method: it is every row's reference.")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"run_load_sweep needs repeats >= 1 timed passes per level, got {repeats!r}.")
    pad_token_id = _pad_id(tokenizer) if pad_token_id is None else pad_token_id
    if pad_token_id is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token: pass pad_token_id.")
    eos = _eos_ids(target)
    encode = _encoder(tokenizer, prompts, target.device)
    methods = list(methods)
    records, level_info, warmup_errors = [], [], {}
    for index, level in enumerate(levels):
        encoded = [encode(i) for i in range(level)]
        inputs = left_pad(encoded, pad_token_id)
        level_info.append({"level": level, "prompt_ids": [_prompt_id(prompts, i) for i in range(level)],
                           "prompt_tokens": [int(e["input_ids"].shape[1]) for e in encoded]})
        shift = index % len(methods)
        order = methods[shift:] + methods[:shift]  # rotated per level: drift spreads over all methods
        for method in order:  # untimed: first-use allocations at this batch size, the cost rule's state
            for _ in range(warmup):
                _show(progress, f"b={level} warm-up {method.name}")
                try:
                    decode_batch(method, target, drafter, inputs, min(max_new_tokens, WARMUP_TOKENS), pad_token_id,
                                 eos)
                except Exception as exc:  # recorded again in the timed run
                    warmup_errors[f"{method.name}@{level}"] = bench_report._describe(exc)
                _step(progress)
        passes, errors = collections.defaultdict(list), {}
        for repeat in range(repeats):
            turned = order[repeat % len(order):] + order[: repeat % len(order)]
            for method in turned:
                if method.name in errors:
                    continue
                _show(progress, f"b={level} {method.name}" + (f" ({repeat + 1}/{repeats})" if repeats > 1 else ""))
                try:
                    passes[method.name].append(decode_batch(method, target, drafter, inputs, max_new_tokens,
                                                            pad_token_id, eos))
                except Exception as exc:
                    errors[method.name] = bench_report._describe(exc)
                _step(progress)
        position = {method.name: i for i, method in enumerate(order)}
        reference = min(passes[PLAIN], key=lambda run: run.seconds) if passes.get(PLAIN) else None
        for method in methods:  # a method that failed in any pass is recorded by its error alone
            runs = [] if method.name in errors else passes[method.name]
            records.append(_sweep_record(level, method, runs, errors.get(method.name), reference,
                                         position[method.name]))
    return {"records": records, "levels": level_info, "best_fixed": best_fixed(records),
            "warmup_errors": warmup_errors, "failures": _failures(records)}


def _show(progress, text: str) -> None:
    if progress is not None:
        progress.set_postfix_str(text)


def _step(progress) -> None:
    if progress is not None:
        progress.update(1)


def _sweep_record(level: int, method: LoadMethod, runs: Sequence[BatchRun], error: Optional[str],
                  reference: Optional[BatchRun], order: int) -> dict:
    """One (level, method) record of the sweep from the method's timed passes `runs` (its fastest is scored;
    every pass's rows are checked against `reference`, plain's fastest pass)."""
    record = {"level": level, "method": method.name, "family": method.family, "order": order, "error": error,
              "matches_plain": None, "mismatched_rows": None}
    if not runs:
        return record
    run = min(runs, key=lambda each: each.seconds)
    new_tokens = sum(len(row) for row in run.rows)
    record.update(seconds=run.seconds, repeat_seconds=[each.seconds for each in runs], new_tokens=new_tokens,
                  row_tokens=[len(row) for row in run.rows],
                  tokens_per_s=new_tokens / run.seconds if run.seconds > 0 else None,
                  speedup_vs_plain=(reference.seconds / run.seconds
                                    if reference is not None and run.seconds > 0 else None))
    record.update(structure_stats(run.stats))
    if reference is not None:
        mismatched = sorted({row for each in runs for row in _mismatched_rows(reference.rows, each.rows)})
        record["matches_plain"] = not mismatched
        record["mismatched_rows"] = mismatched
    return record


def best_fixed(records: Sequence[dict]) -> list:
    """Per level, the fixed structure of highest throughput among those whose every row matched plain greedy:
    ``[{"level", "method", "tokens_per_s", "speedup_vs_plain", "tau", "nodes_per_round"}]`` in level order
    (levels where none qualified are left out). Picked after the fact from `records`; nothing runs again."""
    best = {}
    for r in records:
        if r["family"] != "fixed" or r["error"] is not None or r["matches_plain"] is not True:
            continue
        if r.get("tokens_per_s") is None:
            continue
        if r["level"] not in best or r["tokens_per_s"] > best[r["level"]]["tokens_per_s"]:
            best[r["level"]] = {key: r.get(key) for key in
                                ("level", "method", "tokens_per_s", "speedup_vs_plain", "tau", "nodes_per_round")}
    levels = list(dict.fromkeys(r["level"] for r in records))
    return [best[level] for level in levels if level in best]


def _failures(records: Sequence[dict]) -> dict:
    """Failed runs: an exception, rows that differ from plain greedy, or no plain run to compare with."""
    items = []
    for r in records:
        where = {"method": r["method"], **({"level": r["level"]} if "level" in r else {})}
        if r["error"] is not None:
            items.append({**where, "reason": r["error"]})
        elif r["matches_plain"] is False:
            items.append({**where, "reason": f"rows {r['mismatched_rows']} differ from plain greedy"})
        elif r["matches_plain"] is None:
            items.append({**where, "reason": "not checked: the plain run failed"})
    return {"count": len(items), "items": items}


# ----------------------------------------------------------------------------
# Arrivals
# ----------------------------------------------------------------------------
def make_arrivals(kind: str, rate: float, requests: int, seed: int = 0, burst_size: int = BURST_SIZE) -> list:
    """Arrival times (seconds, ascending) of `requests` requests at a mean rate of `rate` requests/s.

    Args:
        kind: ``"poisson"``: exponential gaps of mean 1/rate between requests. ``"bursty"``: bursts of requests
            that arrive at the same instant, with sizes uniform in 1..2*burst_size-1 (mean `burst_size`) and
            exponential gaps of mean burst_size/rate between bursts, so the mean rate is `rate` too; the last
            burst is cut to `requests`.
        rate: mean arrival rate, requests per second (> 0).
        requests: number of requests (>= 1).
        seed: the trace is a function of (kind, rate, requests, seed, burst_size) only.
        burst_size: mean requests per burst (bursty).

    Returns:
        `list` of `requests` floats; the first arrival is after one gap from time 0.
    """
    if kind not in ARRIVAL_KINDS:
        raise ValueError(f"Unknown arrival kind {kind!r}; valid: {', '.join(ARRIVAL_KINDS)}.")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate!r}.")
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests!r}.")
    if burst_size < 1:
        raise ValueError(f"burst_size must be >= 1, got {burst_size!r}.")
    rng = random.Random(f"{kind}|{seed}")
    times, clock = [], 0.0
    if kind == "poisson":
        for _ in range(requests):
            clock += rng.expovariate(rate)
            times.append(clock)
        return times
    while len(times) < requests:
        clock += rng.expovariate(rate / burst_size)
        size = rng.randint(1, 2 * burst_size - 1)
        times.extend([clock] * min(size, requests - len(times)))
    return times


def replay(arrivals: Sequence[float], run_batch: Callable[[list], float], max_batch: int) -> dict:
    """Serve `arrivals` with a batching scheduler on a simulated clock.

    The clock starts at the first arrival. While requests remain: every request that has arrived by the clock
    and waits joins a queue (by arrival time, then index); the first `max_batch` of the queue form a batch,
    `run_batch(request_ids)` runs it to completion and returns its seconds, and the clock advances by them;
    when nothing waits, the clock jumps to the next arrival. Nothing here reads a real clock: given a
    deterministic `run_batch`, the result is deterministic.

    Args:
        arrivals: arrival time of each request (request i arrives at `arrivals[i]`).
        run_batch: `(list of request indices) -> seconds` (>= 0).
        max_batch: most requests per batch (>= 1).

    Returns:
        `dict` with ``finish`` and ``latency`` (per request: its batch's finish time, and that minus its
        arrival), ``batches`` (``[{"start", "seconds", "requests"}]`` in order) and ``makespan`` (last finish -
        first arrival).
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch!r}.")
    count = len(arrivals)
    if count == 0:
        return {"finish": [], "latency": [], "batches": [], "makespan": 0.0}
    order = sorted(range(count), key=lambda i: (arrivals[i], i))
    finish = [None] * count
    batches, waiting = [], collections.deque()
    next_arrival, served = 0, 0
    clock = float(arrivals[order[0]])
    while served < count:
        while next_arrival < count and arrivals[order[next_arrival]] <= clock:
            waiting.append(order[next_arrival])
            next_arrival += 1
        if not waiting:  # idle: jump to the next arrival
            clock = float(arrivals[order[next_arrival]])
            continue
        batch = [waiting.popleft() for _ in range(min(max_batch, len(waiting)))]
        seconds = float(run_batch(list(batch)))
        if not seconds >= 0:
            raise ValueError(f"run_batch returned {seconds!r} seconds for requests {batch}; expected >= 0.")
        batches.append({"start": clock, "seconds": seconds, "requests": batch})
        clock += seconds
        for request in batch:
            finish[request] = clock
        served += len(batch)
    latency = [finish[i] - arrivals[i] for i in range(count)]
    return {"finish": finish, "latency": latency, "batches": batches,
            "makespan": max(finish) - min(arrivals)}


def _nearest_rank(values: Sequence[float], fraction: float) -> float:
    """The `fraction` quantile by nearest rank: the ceil(fraction * n)-th smallest value."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def summarize_replay(replayed: dict, tokens: Optional[Sequence[int]] = None) -> dict:
    """Latency and throughput of a `replay`: mean, p90 (nearest rank) and max latency, makespan, busy seconds,
    batches and their mean size, requests/s and, given new `tokens` per request, tokens and tokens/s (both over
    the makespan: first arrival to last finish)."""
    latency, makespan = replayed["latency"], replayed["makespan"]
    batches = replayed["batches"]
    summary = {
        "requests": len(latency),
        "batches": len(batches),
        "mean_batch_size": len(latency) / len(batches) if batches else None,
        "mean_latency_s": sum(latency) / len(latency) if latency else None,
        "p90_latency_s": _nearest_rank(latency, P90) if latency else None,
        "max_latency_s": max(latency) if latency else None,
        "makespan_s": makespan,
        "busy_s": sum(b["seconds"] for b in batches),
        "requests_per_s": len(latency) / makespan if makespan > 0 else None,
    }
    if tokens is not None:
        summary["tokens"] = int(sum(tokens))
        summary["tokens_per_s"] = summary["tokens"] / makespan if makespan > 0 else None
    return summary


def run_arrivals(target, tokenizer, drafter, prompts: Sequence, arrivals: Sequence[float],
                 methods: Sequence[LoadMethod], max_new_tokens: int, max_batch: int,
                 pad_token_id: Optional[int] = None, warmup: int = 1, progress=None) -> dict:
    """Replay `arrivals` once per method (request i asks prompt i, cycled), each batch run for real.

    Every row of a speculative batch is checked against plain greedy of the same batch: plain's own batch of
    the same requests when its replay formed one, else an untimed plain run (outside the simulated clock).

    Args:
        target, tokenizer, drafter, prompts, max_new_tokens, pad_token_id: as in `run_load_sweep`.
        arrivals: arrival times (`make_arrivals`).
        methods: from `arrival_methods`; must include plain.
        max_batch: most requests per batch.
        warmup: untimed runs of each method (`WARMUP_TOKENS` new tokens) on a batch of the first
            min(max_batch, requests) requests first.
        progress: a tqdm-like bar, or None.

    Returns:
        `dict` with ``methods`` (per method: `summarize_replay`'s figures, tau, nodes_per_round,
        ``mean_latency_vs_plain`` and ``tokens_per_s_vs_plain`` (plain's / the method's mean latency; the
        method's / plain's tokens/s), ``failures``, ``error``), ``requests`` (per method: per request arrival,
        finish, latency, tokens, batch), ``batches`` (per method) and ``failures``.
    """
    if not any(m.family == "plain" for m in methods):
        raise ValueError("run_arrivals needs the plain method: it is every row's reference.")
    pad_token_id = _pad_id(tokenizer) if pad_token_id is None else pad_token_id
    if pad_token_id is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token: pass pad_token_id.")
    eos = _eos_ids(target)
    encode = _encoder(tokenizer, prompts, target.device)
    plain = next(m for m in methods if m.family == "plain")
    ordered = [plain] + [m for m in methods if m is not plain]
    reference = {}  # tuple of request ids -> plain greedy rows of that batch

    def batch_inputs(ids):
        return left_pad([encode(i) for i in ids], pad_token_id)

    summaries, per_request, per_batch, failures = {}, {}, {}, []
    for method in ordered:
        warm_ids = list(range(min(max_batch, len(arrivals))))
        for _ in range(warmup):
            _show(progress, f"arrivals warm-up {method.name}")
            try:
                decode_batch(method, target, drafter, batch_inputs(warm_ids), min(max_new_tokens, WARMUP_TOKENS),
                             pad_token_id, eos)
            except Exception:  # recorded below if the replay fails too
                pass
        runs = []

        def run_batch(ids, method=method, runs=runs):
            _show(progress, f"arrivals {method.name} batch of {len(ids)}")
            run = decode_batch(method, target, drafter, batch_inputs(ids), max_new_tokens, pad_token_id, eos)
            runs.append((tuple(ids), run))
            _step(progress)
            return run.seconds

        try:
            replayed = replay(arrivals, run_batch, max_batch)
        except Exception as exc:
            summaries[method.name] = {"error": bench_report._describe(exc), "failures": 1}
            failures.append({"method": method.name, "reason": bench_report._describe(exc)})
            continue
        rows, mismatched = {}, []
        for ids, run in runs:
            if method is plain:
                reference.setdefault(ids, run.rows)
            elif ids not in reference:  # untimed check run (outside the simulated clock)
                _show(progress, f"arrivals check {method.name}")
                reference[ids] = decode_batch(plain, target, drafter, batch_inputs(ids), max_new_tokens,
                                              pad_token_id, eos).rows
            bad = _mismatched_rows(reference[ids], run.rows)
            mismatched += [ids[i] for i in bad if i < len(ids)]
            rows.update(zip(ids, run.rows))
        tokens = [len(rows[i]) for i in range(len(arrivals))]
        summary = summarize_replay(replayed, tokens)
        pooled = _pool_stats([run.stats for _, run in runs])
        summary.update(pooled, error=None, failures=len(mismatched), mismatched_requests=sorted(mismatched))
        summaries[method.name] = summary
        if mismatched:
            failures.append({"method": method.name,
                             "reason": f"requests {sorted(mismatched)} differ from plain greedy of their batch"})
        batch_of = {r: b for b, batch in enumerate(replayed["batches"]) for r in batch["requests"]}
        per_request[method.name] = [
            {"request": i, "prompt_id": _prompt_id(prompts, i), "arrival": arrivals[i],
             "finish": replayed["finish"][i], "latency": replayed["latency"][i], "tokens": tokens[i],
             "batch": batch_of[i]}
            for i in range(len(arrivals))]
        per_batch[method.name] = replayed["batches"]
    base = summaries.get(plain.name) or {}
    for summary in summaries.values():
        if summary.get("error") is None and base.get("error") is None and base:
            summary["mean_latency_vs_plain"] = (base["mean_latency_s"] / summary["mean_latency_s"]
                                                if summary["mean_latency_s"] else None)
            summary["tokens_per_s_vs_plain"] = (summary["tokens_per_s"] / base["tokens_per_s"]
                                                if base.get("tokens_per_s") else None)
    return {"methods": summaries, "requests": per_request, "batches": per_batch,
            "failures": {"count": len(failures), "items": failures}}


def _pool_stats(stats: Sequence) -> dict:
    """tau and nodes/candidates per round pooled over runs (row-rounds weighted); plain: tau 1."""
    parts = [structure_stats(s) for s in stats if s is not None]
    if not parts:
        return {"tau": 1.0, "nodes_per_round": None, "candidates_per_round": None}
    row_rounds = sum(p["tau_den"] for p in parts)
    if not row_rounds:
        return {"tau": None, "nodes_per_round": None, "candidates_per_round": None}
    return {"tau": sum(p["tau_num"] for p in parts) / row_rounds,
            "nodes_per_round": sum(p["drafted"] for p in parts) / row_rounds,
            "candidates_per_round": sum(p["drafted"] + p["pruned"] for p in parts) / row_rounds}


# ----------------------------------------------------------------------------
# The command: `hf-adaptive-spec bench --load-sweep ... / --arrivals ...`
# ----------------------------------------------------------------------------
def _levels(args) -> list:
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


def _adaptive_strategies(args, laspec: bool) -> list:
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


def _prelude(args, prompt_loader) -> tuple:
    """Check every option before anything loads, set threads and seed; `(device, laspec?, prompts, adaptive,
    spec_configs, levels)`."""
    from ..strategies import resolve_config

    levels = _levels(args)
    if not levels and not args.arrivals:
        raise ValueError("nothing to run: give --load-sweep B ... and/or --arrivals poisson|bursty.")
    if getattr(args, "cold", False):
        raise ValueError("--cold times the first calls of a fresh process; run it apart from --load-sweep / "
                         "--arrivals.")
    if getattr(args, "visual_tokens", None):
        raise ValueError("--visual-tokens sweeps are for the per-prompt bench, not --load-sweep / --arrivals.")
    if bench_vision.SCENES in args.datasets:
        raise ValueError("--load-sweep / --arrivals batch text prompts; --datasets scenes (image prompts) is not "
                         "supported there.")
    bench.check_run_options(args)
    if args.arrivals:
        if not args.rate > 0:
            raise ValueError("--rate must be > 0 requests/s.")
        if args.requests < 1:
            raise ValueError("--requests must be >= 1.")
        if args.max_batch < 1:
            raise ValueError("--max-batch must be >= 1.")
    device = bench._resolve_device(args.device)
    laspec = loading.is_laspec(args.drafter)
    if args.drafter_int8 and laspec:
        raise ValueError("--drafter-int8 quantizes an independent drafter model; a LaSpec drafter is one small "
                         "forward per round (leave it out).")
    if args.drafter_int8 and device.type != "cpu":
        raise ValueError("--drafter-int8 uses CPU dynamic-quantization kernels; run it with --device cpu.")
    adaptive = _adaptive_strategies(args, laspec)
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
    prompt_loader = prompt_loader or bench._default_prompt_loader
    prompts = []
    for dataset in dict.fromkeys(args.datasets):
        prompts.extend(prompt_loader(dataset, args.limit))
    if not prompts:
        raise ValueError("no prompts to run.")
    return device, laspec, prompts, adaptive, spec_configs, levels


def _load_models(args, laspec: bool, model_loader) -> tuple:
    """`(target, tokenizer, drafter, load seconds)`, as the bench loads them."""
    start = time.perf_counter()
    target, processor = (model_loader or bench.load_model)(args.target, args, "target")
    tokenizer = bench_vision.text_tokenizer(processor)
    if laspec:  # a LaSpec drafter runs on the target's own states, embedding and LM head
        from ..drafters.hub import load_drafter

        drafter = load_drafter(args.drafter, target)
    else:
        drafter, _ = (model_loader or bench.load_model)(args.drafter, args, "drafter")
    if args.drafter_int8:
        drafter = quantize_drafter(drafter)
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
            done["error"] = f"{method.strategy}: {bench_report._describe(exc)}"
            break
        done["strategies"].append(method.strategy)
    done["seconds"] = time.perf_counter() - start
    return done


def run_load(args, model_loader=None, prompt_loader=None) -> dict:
    """Run `--load-sweep` and/or `--arrivals` as `args` (from `bench.add_arguments`) describe; write the outputs
    to `args.out`.

    Args:
        args: the parsed bench options.
        model_loader: `(name, args, role) -> (model, tokenizer)` (default `bench.load_model`).
        prompt_loader: `(dataset, limit) -> [Prompt]` (default: the bench's).

    Returns:
        ``{"load_sweep": results or None, "arrivals": results or None, "exit_code": 0 or 1}``; each results dict
        is also written as JSON, with a Markdown report beside it.
    """
    from tqdm.auto import tqdm

    started = bench_report._now()
    device, laspec, prompts, adaptive, spec_configs, levels = _prelude(args, prompt_loader)
    target, tokenizer, drafter, load_seconds = _load_models(args, laspec, model_loader)
    block_size = getattr(getattr(drafter, "config", None), "block_size", None) if laspec else None
    chains, trees = fixed_structures(getattr(args, "fixed", None))
    methods, skipped = load_methods(laspec, adaptive, spec_configs, block_size, chains, trees)
    pad_token_id = _pad_id(tokenizer)
    sizes = list(levels) + (list(range(1, args.max_batch + 1)) if args.arrivals else [])
    prepared = _prepare(target, drafter, methods, sizes)
    header = {
        "command": bench._command_line(),
        "argv": list(sys.argv),
        "args": bench_report._jsonable(vars(args)),
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
        results = {"mode": "load_sweep", **header, "environment": bench_report._environment(device, started),
                   "settings": {"max_new_tokens": args.max_new_tokens, "greedy": True, "warmup": args.warmup,
                                "repeats": args.load_repeats,
                                "warmup_tokens": WARMUP_TOKENS, "levels": levels,
                                "datasets": list(dict.fromkeys(args.datasets)), "limit": args.limit},
                   "methods": {m.name: m.to_dict() for m in methods}, "skipped_methods": skipped, **sweep}
        results["ok"] = not results["failures"]["count"]
        results["environment"]["finished"] = bench_report._now()
        results["plots"] = (write_load_plots(results, out_dir) if not args.no_plots
                            else {"files": {}, "skipped": ["--no-plots"]})
        results["files"] = {"json": "load_sweep.json", "markdown": "load_sweep.md", **results["plots"]["files"]}
        (out_dir / "load_sweep.json").write_text(json.dumps(bench_report._jsonable(results), indent=1))
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
        results = {"mode": "arrivals", **header, "environment": bench_report._environment(device, started),
                   "settings": {"max_new_tokens": args.max_new_tokens, "greedy": True, "warmup": args.warmup,
                                "arrivals": args.arrivals, "rate": args.rate, "requests": args.requests,
                                "max_batch": args.max_batch, "seed": args.seed, "burst_size": BURST_SIZE,
                                "datasets": list(dict.fromkeys(args.datasets)), "limit": args.limit},
                   "arrival_times": arrivals,
                   "method_settings": {m.name: m.to_dict() for m in chosen}, **replayed}
        results["ok"] = not results["failures"]["count"]
        results["environment"]["finished"] = bench_report._now()
        results["files"] = {"json": "arrivals.json", "markdown": "arrivals.md"}
        (out_dir / "arrivals.json").write_text(json.dumps(bench_report._jsonable(results), indent=1))
        markdown = arrivals_markdown(results)
        (out_dir / "arrivals.md").write_text(markdown)
        print(markdown)
        output["arrivals"] = results

    failed = any(r is not None and not r["ok"] for r in output.values())
    output["exit_code"] = 1 if failed else 0
    return output


# ----------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------
def _setup_lines(results: dict) -> list:
    env, models = results["environment"], results["models"]
    lines = [
        f"- command: `{results['command']}`",
        f"- target: `{models['target']}`; drafter: `{models['drafter']}`"
        + (" (int8 dynamic)" if models["drafter_int8"] else "")
        + (f" (block_size {models['drafter_block_size']})" if models.get("drafter_block_size") else ""),
        f"- greedy, max_new_tokens={results['settings']['max_new_tokens']}, rows left-padded; warm-up runs per "
        f"method: {results['settings']['warmup']} ({WARMUP_TOKENS} new tokens)"
        + (f"; timed passes per level: {results['settings']['repeats']}, each method's fastest kept"
           if results["settings"].get("repeats", 1) > 1 else ""),
        f"- {env['device']} ({env.get('gpu') or env['cpu_model']}), {env['threads']} threads; torch {env['torch']}, "
        f"transformers {env['transformers']}, hf_adaptive_spec {env['hf_adaptive_spec']} ({env['git_commit']}); "
        f"{env['started']} -> {env['finished']}",
    ]
    prepared = results["prepare"]
    lines.append(f"- cost curves prepared for batch sizes {prepared['batch_sizes']} "
                 f"({', '.join(prepared['strategies']) or 'none'}; {prepared['seconds']:.1f} s)"
                 + (f"; FAILED: {prepared['error']}" if prepared.get("error") else ""))
    return lines


def _method_lines(settings: dict) -> list:
    return [f"- {name} ({m['family']}): `{m['strategy']}` `{json.dumps(m['spec_config'])}`"
            for name, m in settings.items() if m["family"] != "plain"]


def _failure_lines(failures: dict) -> list:
    if not failures["count"]:
        return ["Every row equals plain greedy of the same batch, token for token.", ""]
    lines = [f"## FAILURES: {failures['count']}", ""]
    lines += [f"- {item['method']}" + (f" at b={item['level']}" if "level" in item else "") + f": {item['reason']}"
              for item in failures["items"]]
    return lines + [""]


def sweep_tables(results: dict) -> dict:
    """The sweep's Markdown tables, `{"throughput", "tau", "sizes"}` -> lines (methods x levels)."""
    levels = results["settings"]["levels"]
    methods = list(results["methods"])
    cell = {(r["method"], r["level"]): r for r in results["records"]}
    best = {b["level"]: b for b in results["best_fixed"]}
    head = "| method | " + " | ".join(f"b={b}" for b in levels) + " |"
    rule = "|---|" + "---:|" * len(levels)

    def row(name, value):
        return f"| {name} | " + " | ".join(value(cell.get((name, b))) for b in levels) + " |"

    def throughput(r):
        if r is None or r.get("tokens_per_s") is None:
            return "FAIL" if r is not None else "–"
        text = f"{r['tokens_per_s']:.1f}"
        if r["method"] != PLAIN and r.get("speedup_vs_plain") is not None:
            text += f" ({r['speedup_vs_plain']:.2f}x)"
        return text + (" FAIL" if r["matches_plain"] is False or r["error"] else "")

    def size(r):
        if r is None or r.get("nodes_per_round") is None:
            return "–"
        return f"{r['nodes_per_round']:.2f} ({r['candidates_per_round']:.2f})"

    best_row = "| best fixed | " + " | ".join(
        f"{best[b]['method']} {best[b]['tokens_per_s']:.1f} ({bench_report._fmt(best[b]['speedup_vs_plain'])}x)"
        if b in best else "–" for b in levels) + " |"
    return {
        "throughput": [head, rule] + [row(name, throughput) for name in methods] + [best_row],
        "tau": [head, rule] + [row(name, lambda r: "–" if r is None else bench_report._fmt(r.get("tau")))
                               for name in methods],
        "sizes": [head, rule] + [row(name, size) for name in methods if name != PLAIN],
    }


def sweep_markdown(results: dict) -> str:
    """``load_sweep.md``: setup, failures, throughput / speedup, tau and structure size per level and method."""
    lines = ["# hf_adaptive_spec under load: concurrency sweep", ""] + _setup_lines(results)
    lines += ["- order of methods rotated per level"] + _method_lines(results["methods"])
    lines += [f"- {name}: not run ({reason})" for name, reason in results["skipped_methods"].items()]
    lines += ["", "b: rows decoding together (the first b prompts, left-padded). Throughput: new tokens over all rows "
              "(each up to its EOS) / seconds of the batch's `generate`; speedup: plain's seconds / the method's, "
              "same batch. tau: tokens per row and target verification forward. Nodes per round: draft nodes "
              "verified per row and round (SpecStats drafted_tokens / row_rounds; root not counted); in brackets "
              "the candidates before the cost rule trimmed them. best fixed: the fixed structure of highest "
              "throughput at that level, picked after the fact from these runs.", ""]
    lines += _failure_lines(results["failures"])
    tables = sweep_tables(results)
    lines += ["## Throughput (tokens/s; speedup over plain)", ""] + tables["throughput"]
    lines += ["", "## tau", ""] + tables["tau"]
    lines += ["", "## Structure verified: draft nodes per row and round (candidates before the cost rule)", ""]
    lines += tables["sizes"]
    plots = results.get("plots", {})
    if plots.get("files"):
        lines += ["", "## Plots", ""] + [f"![{name}]({file})" for name, file in plots["files"].items()]
    if plots.get("skipped"):
        lines += ["", f"Plots skipped: {'; '.join(plots['skipped'])}"]
    return "\n".join(lines) + "\n"


def arrivals_markdown(results: dict) -> str:
    """``arrivals.md``: setup, failures, and latency / throughput per method."""
    s = results["settings"]
    lines = ["# hf_adaptive_spec under load: timed arrivals", ""] + _setup_lines(results)
    lines.append(f"- {s['requests']} requests, {s['arrivals']} arrivals at {s['rate']:g} requests/s (seed {s['seed']}"
                 + (f", mean burst {s['burst_size']}" if s["arrivals"] == "bursty" else "")
                 + f"), batches of at most {s['max_batch']}; methods replayed one after another, plain first")
    lines += _method_lines(results["method_settings"])
    lines += ["", "A free server batches every request that has arrived (first come first served, up to the maximum) "
              "and runs the batch to completion; latency: the batch's finish - the request's arrival (simulated "
              "clock, measured batch times); p90 by nearest rank; throughput over first arrival to last finish.",
              ""]
    lines += _failure_lines(results["failures"])
    return "\n".join(lines + arrivals_table(results)) + "\n"


def arrivals_table(results: dict) -> list:
    """The arrivals' Markdown table (latency, throughput, tau and structure per method), as lines."""
    lines = ["| method | mean latency s | p90 latency s | max latency s | mean latency vs plain | tokens/s "
             "| vs plain | requests/s | batches | mean batch | busy s | tau | nodes/round |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in results["methods"].items():
        if m.get("error"):
            lines.append(f"| {name} | **FAIL**: {m['error']} |" + " |" * 12)
            continue
        cells = [bench_report._fmt(m["mean_latency_s"], 3), bench_report._fmt(m["p90_latency_s"], 3),
                 bench_report._fmt(m["max_latency_s"], 3),
                 "1.00x" if name == PLAIN else bench_report._fmt(m.get("mean_latency_vs_plain"), 2, "x"),
                 bench_report._fmt(m.get("tokens_per_s"), 1),
                 "1.00x" if name == PLAIN else bench_report._fmt(m.get("tokens_per_s_vs_plain"), 2, "x"),
                 bench_report._fmt(m["requests_per_s"], 3), str(m["batches"]),
                 bench_report._fmt(m["mean_batch_size"]), bench_report._fmt(m["busy_s"], 1),
                 bench_report._fmt(m.get("tau")), bench_report._fmt(m.get("nodes_per_round"))]
        lines.append(f"| {name}" + (" **FAIL**" if m["failures"] else "") + " | " + " | ".join(cells) + " |")
    return lines


def write_load_plots(results: dict, out_dir: Path) -> dict:
    """The sweep's PNGs: chosen structure size against load, throughput against load per method; returns
    ``{"files": {kind: filename}, "skipped": [reasons]}``."""
    makers = [(kind, lambda plot=plot: plot(results))
              for kind, plot in (("structure", _plot_structure), ("throughput", _plot_throughput))]
    return bench_report.save_figures(makers, out_dir, PLOT_FILES)


def _series(results: dict, name: str, key: str) -> tuple:
    points = [(r["level"], r[key]) for r in results["records"] if r["method"] == name and r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _load_axes(fig, results, ylabel):
    ax = fig.add_subplot(1, 1, 1)
    levels = results["settings"]["levels"]
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels)
    ax.set_xticklabels([str(b) for b in levels])
    ax.set_xlabel("concurrency (rows decoding together)")
    ax.set_ylabel(ylabel)
    models = results["models"]
    ax.set_title(f"{Path(models['target']).name} + {Path(models['drafter']).name}, "
                 f"{results['settings']['max_new_tokens']} new tokens", fontsize=9)
    return ax


def _plot_structure(results):
    spec = [name for name, m in results["methods"].items() if m["family"] != "plain"]
    if not any(_series(results, name, "nodes_per_round")[0] for name in spec):
        return None
    fig = bench_report._figure(6.5, 4.2)
    ax = _load_axes(fig, results, "draft nodes verified per row and round")
    for name in spec:
        xs, ys = _series(results, name, "nodes_per_round")
        if not xs:
            continue
        if results["methods"][name]["family"] == "adaptive":
            ax.plot(xs, ys, marker="o", linewidth=2, label=f"{name} (chosen)")
        else:
            ax.plot(xs, ys, linestyle="--", linewidth=0.8, color="grey", alpha=0.7)
            ax.annotate(name, (xs[-1], ys[-1]), fontsize=6, color="grey", xytext=(3, 0), textcoords="offset points")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _plot_throughput(results):
    names = list(results["methods"])
    if not any(_series(results, name, "tokens_per_s")[0] for name in names):
        return None
    fig = bench_report._figure(7.5, 4.4)
    ax = _load_axes(fig, results, "throughput, new tokens/s over all rows")
    for name in names:
        xs, ys = _series(results, name, "tokens_per_s")
        if not xs:
            continue
        family = results["methods"][name]["family"]
        style = {"plain": dict(color="black", linewidth=2), "adaptive": dict(linewidth=2, marker="o"),
                 "fixed": dict(linewidth=0.9, linestyle="--", marker=".")}[family]
        ax.plot(xs, ys, label=name, **style)
    best = results["best_fixed"]
    if best:
        ax.plot([b["level"] for b in best], [b["tokens_per_s"] for b in best], linestyle=":", color="crimson",
                linewidth=1.5, label="best fixed (after the fact)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
