"""The concurrency sweep: every method at every load level on the same left-padded batch, in an order
rotated per level, each row checked against plain greedy of that batch; the best fixed structure per level,
picked after the fact."""

from __future__ import annotations

import collections
from typing import Optional, Sequence

from .batch_runs import (WARMUP_TOKENS, BatchRun, LoadMethod, decode_batch, encoder, eos_ids,
                         mismatched_rows, pad_encodings, pad_id, prompt_id, show, step, structure_stats)
from .report import describe
from .stats import PLAIN, PLAIN_MODE

__all__ = ["best_fixed", "failures_of", "run_load_sweep"]


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
    pad_token_id = pad_id(tokenizer) if pad_token_id is None else pad_token_id
    if pad_token_id is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token: pass pad_token_id.")
    eos = eos_ids(target)
    encode = encoder(tokenizer, prompts, target.device)
    methods = list(methods)
    records, level_info, warmup_errors = [], [], {}
    for index, level in enumerate(levels):
        encoded = [encode(i) for i in range(level)]
        inputs = pad_encodings(encoded, pad_token_id)
        level_info.append({"level": level, "prompt_ids": [prompt_id(prompts, i) for i in range(level)],
                           "prompt_tokens": [int(e["input_ids"].shape[1]) for e in encoded]})
        shift = index % len(methods)
        order = methods[shift:] + methods[:shift]  # rotated per level: drift spreads over all methods
        for method in order:  # untimed: first-use allocations at this batch size, the cost rule's state
            for _ in range(warmup):
                show(progress, f"b={level} warm-up {method.name}")
                try:
                    decode_batch(method, target, drafter, inputs, min(max_new_tokens, WARMUP_TOKENS), pad_token_id,
                                 eos)
                except Exception as exc:  # recorded again in the timed run
                    warmup_errors[f"{method.name}@{level}"] = describe(exc)
                step(progress)
        passes, errors = collections.defaultdict(list), {}
        for repeat in range(repeats):
            turned = order[repeat % len(order):] + order[: repeat % len(order)]
            for method in turned:
                if method.name in errors:
                    continue
                show(progress, f"b={level} {method.name}" + (f" ({repeat + 1}/{repeats})" if repeats > 1 else ""))
                try:
                    passes[method.name].append(decode_batch(method, target, drafter, inputs, max_new_tokens,
                                                            pad_token_id, eos))
                except Exception as exc:
                    errors[method.name] = describe(exc)
                step(progress)
        position = {method.name: i for i, method in enumerate(order)}
        reference = min(passes[PLAIN], key=lambda run: run.seconds) if passes.get(PLAIN) else None
        mode = min(passes[PLAIN_MODE], key=lambda run: run.seconds) if passes.get(PLAIN_MODE) else None
        for method in methods:  # a method that failed in any pass is recorded by its error alone
            runs = [] if method.name in errors else passes[method.name]
            records.append(_sweep_record(level, method, runs, errors.get(method.name), reference,
                                         position[method.name], mode))
    return {"records": records, "levels": level_info, "best_fixed": best_fixed(records),
            "warmup_errors": warmup_errors, "failures": failures_of(records)}


def _sweep_record(level: int, method: LoadMethod, runs: Sequence[BatchRun], error: Optional[str],
                  reference: Optional[BatchRun], order: int, mode: Optional[BatchRun] = None) -> dict:
    """One (level, method) record of the sweep from the method's timed passes `runs` (its fastest is scored;
    every pass's rows are checked against `reference`, plain's fastest pass; `mode`: the plain mode's fastest
    pass, the second baseline)."""
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
                                    if reference is not None and run.seconds > 0 else None),
                  speedup_vs_plain_mode=(mode.seconds / run.seconds if mode is not None and run.seconds > 0
                                         else None))
    record.update(structure_stats(run.stats))
    if reference is not None:
        mismatched = sorted({row for each in runs for row in mismatched_rows(reference.rows, each.rows)})
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
                                ("level", "method", "tokens_per_s", "speedup_vs_plain", "speedup_vs_plain_mode",
                                 "tau", "nodes_per_round")}
    levels = list(dict.fromkeys(r["level"] for r in records))
    return [best[level] for level in levels if level in best]


def failures_of(records: Sequence[dict]) -> dict:
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
