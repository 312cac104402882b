"""Timed arrivals: a trace of request arrival times (Poisson or bursty, `hf_adaptive_spec.traffic`), served by a
batching scheduler on a simulated clock whose batches run for real (`replay`, `run_arrivals`), and its latency /
throughput summary."""

from __future__ import annotations

import collections
from typing import Callable, Optional, Sequence

from .. import traffic

from .batch_runs import (WARMUP_TOKENS, LoadMethod, decode_batch, encoder, eos_ids, mismatched_rows, pad_encodings,
                         pad_id, prompt_id, show, step, structure_stats)
from .report import describe

__all__ = ["ARRIVAL_KINDS", "ARRIVAL_OPTIONS", "make_arrivals", "pool_stats", "replay", "run_arrivals",
           "summarize_replay"]


ARRIVAL_KINDS = traffic.PROCESSES
# the replay's traces: bursts of random size (mean `burst_size`) at one instant, the first arrival after one gap,
# the numbers from `random.Random(f"{kind}|{seed}")`
ARRIVAL_OPTIONS = traffic.ArrivalOptions(burst_sizes="random", first_arrival="after_gap", seeding="process_and_seed")


def make_arrivals(kind: str, rate: float, requests: int, seed: int = 0, burst_size: int = traffic.BURST_SIZE) -> list:
    """Arrival times (seconds, ascending) of `requests` requests at a mean rate of `rate` requests/s:
    `traffic.arrival_times` of process `kind` with `ARRIVAL_OPTIONS` (``bursty``: bursts of sizes uniform in
    1..2*burst_size-1 arriving at one instant; the first arrival after one gap from time 0)."""
    return traffic.arrival_times(requests, rate, kind, seed, ARRIVAL_OPTIONS, burst_size)


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


def summarize_replay(replayed: dict, tokens: Optional[Sequence[int]] = None) -> dict:
    """Latency and throughput of a `replay`: mean, p90 (`traffic.percentile`: linear interpolation) and max
    latency, makespan, busy seconds, batches and their mean size, requests/s and, given new `tokens` per request,
    tokens and tokens/s (both over the makespan: first arrival to last finish)."""
    latency, makespan = replayed["latency"], replayed["makespan"]
    batches = replayed["batches"]
    stats = traffic.summary(latency, (90,))
    summary = {
        "requests": len(latency),
        "batches": len(batches),
        "mean_batch_size": len(latency) / len(batches) if batches else None,
        "mean_latency_s": stats["mean"],
        "p90_latency_s": stats["p90"],
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
    pad_token_id = pad_id(tokenizer) if pad_token_id is None else pad_token_id
    if pad_token_id is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token: pass pad_token_id.")
    eos = eos_ids(target)
    encode = encoder(tokenizer, prompts, target.device)
    plain = next(m for m in methods if m.family == "plain")
    ordered = [plain] + [m for m in methods if m is not plain]
    reference = {}  # tuple of request ids -> plain greedy rows of that batch

    def batch_inputs(ids):
        return pad_encodings([encode(i) for i in ids], pad_token_id)

    summaries, per_request, per_batch, failures = {}, {}, {}, []
    for method in ordered:
        warm_ids = list(range(min(max_batch, len(arrivals))))
        for _ in range(warmup):
            show(progress, f"arrivals warm-up {method.name}")
            try:
                decode_batch(method, target, drafter, batch_inputs(warm_ids), min(max_new_tokens, WARMUP_TOKENS),
                             pad_token_id, eos)
            except Exception:  # recorded below if the replay fails too
                pass
        runs = []

        def run_batch(ids, method=method, runs=runs):
            show(progress, f"arrivals {method.name} batch of {len(ids)}")
            run = decode_batch(method, target, drafter, batch_inputs(ids), max_new_tokens, pad_token_id, eos)
            runs.append((tuple(ids), run))
            step(progress)
            return run.seconds

        try:
            replayed = replay(arrivals, run_batch, max_batch)
        except Exception as exc:
            summaries[method.name] = {"error": describe(exc), "failures": 1}
            failures.append({"method": method.name, "reason": describe(exc)})
            continue
        rows, mismatched = {}, []
        for ids, run in runs:
            if method is plain:
                reference.setdefault(ids, run.rows)
            elif ids not in reference:  # untimed check run (outside the simulated clock)
                show(progress, f"arrivals check {method.name}")
                reference[ids] = decode_batch(plain, target, drafter, batch_inputs(ids), max_new_tokens,
                                              pad_token_id, eos).rows
            bad = mismatched_rows(reference[ids], run.rows)
            mismatched += [ids[i] for i in bad if i < len(ids)]
            rows.update(zip(ids, run.rows))
        tokens = [len(rows[i]) for i in range(len(arrivals))]
        summary = summarize_replay(replayed, tokens)
        pooled = pool_stats([run.stats for _, run in runs])
        summary.update(pooled, error=None, failures=len(mismatched), mismatched_requests=sorted(mismatched))
        summaries[method.name] = summary
        if mismatched:
            failures.append({"method": method.name,
                             "reason": f"requests {sorted(mismatched)} differ from plain greedy of their batch"})
        batch_of = {r: b for b, batch in enumerate(replayed["batches"]) for r in batch["requests"]}
        per_request[method.name] = [
            {"request": i, "prompt_id": prompt_id(prompts, i), "arrival": arrivals[i],
             "finish": replayed["finish"][i], "latency": replayed["latency"][i], "tokens": tokens[i],
             "batch": batch_of[i]}
            for i in range(len(arrivals))]
        per_batch[method.name] = replayed["batches"]
    modes = [m.name for m in methods if m.family == "plain_mode"]
    for suffix, name in (("plain", plain.name), ("plain_mode", modes[0] if modes else None)):
        base = summaries.get(name) or {}
        for summary in summaries.values():
            if summary.get("error") is None and base.get("error") is None and base:
                summary[f"mean_latency_vs_{suffix}"] = (base["mean_latency_s"] / summary["mean_latency_s"]
                                                        if summary["mean_latency_s"] else None)
                summary[f"tokens_per_s_vs_{suffix}"] = (summary["tokens_per_s"] / base["tokens_per_s"]
                                                        if base.get("tokens_per_s") else None)
    return {"methods": summaries, "requests": per_request, "batches": per_batch,
            "failures": {"count": len(failures), "items": failures}}


def pool_stats(stats: Sequence) -> dict:
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
