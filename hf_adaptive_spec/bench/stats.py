"""The benchmark's statistics: pooled metrics per method over the per-prompt records of `hf_adaptive_spec.bench`.

Pure functions over record dicts (``results.json`` rows): `aggregate` groups them overall, per data set and per
category; each group maps a method to its tokens/s, tau, speedups over plain, the plain mode (the library's forward
without a drafter) and the stock runs (ratio of summed
seconds and geometric mean of per-prompt ratios), acceptance rate, time split and grounded-token acceptance.
"""

from __future__ import annotations

import math

from . import vision as bench_vision

__all__ = [
    "PLAIN",
    "PLAIN_MODE",
    "STOCK_BEST",
    "STOCK_DEFAULT",
    "TIME_PHASES",
    "aggregate",
]

PLAIN, STOCK_DEFAULT, STOCK_BEST = "plain", "stock_default", "stock_best"
PLAIN_MODE = "plain_mode"  # the library's plain mode (spec_strategy="plain"): its forward without a drafter
TIME_PHASES = ("prefill", "draft", "tree", "verify", "accept", "compact")


# ----------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------
def _ratio_stats(base: dict, other: dict) -> tuple:
    """(sum(base) / sum(other), geometric mean of base/other, pairs) over keys timed in both."""
    keys = [k for k in other if k in base and other[k] > 0 and base[k] > 0]
    if not keys:
        return None, None, 0
    total = sum(base[k] for k in keys) / sum(other[k] for k in keys)
    geomean = math.exp(sum(math.log(base[k] / other[k]) for k in keys) / len(keys))
    return total, geomean, len(keys)


def _summarize(records: list, method_names: list) -> dict:
    """Per-method pooled metrics over `records` (one group: a category, a data set or everything)."""
    times = {m: {} for m in method_names}
    for r in records:
        if r.get("time_s") is not None and r["error"] is None:
            times.setdefault(r["method"], {})[(r["dataset"], r["prompt_id"])] = r["time_s"]
    out = {}
    for name in method_names:
        rows = [r for r in records if r["method"] == name]
        if not rows:
            continue
        timed = [r for r in rows if r.get("time_s") is not None and r["error"] is None]
        new_tokens = sum(r["new_tokens"] for r in timed)
        seconds = sum(r["time_s"] for r in timed)
        tau_den = sum(r["tau_den"] for r in timed)
        failed = [r for r in rows if r["error"] is not None or r["matches_plain"] is not True]
        summary = {
            "prompts": len(rows),
            "timed_prompts": len(timed),
            "failures": len(failed),
            "failed_prompt_ids": [r["prompt_id"] for r in failed],
            "new_tokens": new_tokens,
            "time_s": seconds,
            "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
            "tau": sum(r["tau_num"] for r in timed) / tau_den if tau_den else None,
            "target_forwards": sum(r["target_forwards"] for r in timed),
        }
        for label, base in (("plain", PLAIN), ("plain_mode", PLAIN_MODE), ("stock_default", STOCK_DEFAULT),
                            ("stock_best", STOCK_BEST)):
            total, geomean, pairs = _ratio_stats(times.get(base, {}), times[name])
            summary[f"speedup_vs_{label}"] = total
            summary[f"speedup_vs_{label}_geomean"] = geomean
            summary[f"speedup_vs_{label}_prompts"] = pairs
        spec = [r["spec_stats"] for r in timed if r.get("spec_stats")]
        if spec:
            drafted = sum(s["drafted_tokens"] for s in spec)
            summary["acceptance_rate"] = sum(s["accepted_tokens"] for s in spec) / drafted if drafted else None
            total_time = sum(s["time_total"] for s in spec)
            split = {p: (sum(s[f"time_{p}"] for s in spec) / total_time if total_time else None)
                     for p in TIME_PHASES}
            if total_time:
                split["other"] = max(0.0, 1.0 - sum(split.values()))
            summary["time_split"] = split
        pooled = bench_vision.pool_grounded(timed)
        if pooled is not None:
            summary["grounded_acceptance"] = pooled
        out[name] = summary
    return out


def aggregate(records: list, method_names: list) -> dict:
    """Pooled metrics per method: ``{"overall": {...}, "datasets": {ds: {...}}, "categories": {ds: {cat: {...}}}}``.

    Each leaf maps method -> prompts, failures, tokens_per_s, tau, speedup_vs_{plain,stock_default,stock_best}
    (+ ``_geomean``), and for speculative methods acceptance_rate and time_split (fractions of `time_total`);
    on scene prompts also grounded_acceptance: ``{"grounded" | "other": {tokens, accepted, acceptance}}``.
    """
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    out = {"overall": _summarize(records, method_names), "datasets": {}, "categories": {}}
    for dataset in datasets:
        rows = [r for r in records if r["dataset"] == dataset]
        out["datasets"][dataset] = _summarize(rows, method_names)
        categories = list(dict.fromkeys(r["category"] for r in rows))
        out["categories"][dataset] = {c: _summarize([r for r in rows if r["category"] == c], method_names)
                                      for c in categories}
    return out
