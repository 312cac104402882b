"""Load tests against the real server: the continuous-batching engine behind its HTTP server on 127.0.0.1, driven
by the bounded load generator, one server per method and arrival rate.

    hf-adaptive-spec bench-served --target smollm2-135m-instruct --drafter laspec-smollm2-135m-instruct \\
        --arrivals poisson bursty --rates 0.25 0.5 1 2 4 --requests 24 --max-new-tokens 64 --out served/

Methods (`batch_runs.load_methods`, the same as the load sweep's), each served by its own engine:

- ``off``: speculation off, strategy `plain`: plain continuous batching through the library's own forward (the
  baseline that shows what speculation adds under load);
- fixed structures (the cost rule off): ``chain{k}`` and ``tree{n}`` (`--fixed`);
- the adaptive rule(s) (`--strategies`, default ``laspec`` with a LaSpec drafter, ``sage`` otherwise): the cost rule
  on, choosing per row and round from the batch the engine runs now.

For each arrival process and rate, every method serves the same trace (`serving.http_load.arrival_times`, `--seed`)
of `--requests` chat requests (greedy, `--max-new-tokens`, prompts cycled), in an order rotated per rate so that
machine drift spreads over the methods; each server first answers `--warmup` untimed requests. `--repeats N`
serves each trace N times in passes, the order rotated again per pass (servers run one after another drift by a
few percent on a busy 2-core machine: a ratio is only as good as its spread), and adds a table of each method's
ratios over `off` pass by pass, with their mean. Per run:
throughput (completion tokens per second over the run), mean / p50 / p90 / p99 end-to-end latency, time to first
token, and the structures the engine verified (draft nodes per row-round, from its counters; 0 = a plain step).
Every answer must equal the speculation-off server's answer to the same prompt (greedy): a mismatch or a failed
request is a failure and makes the exit code 1.

Outputs in `--out`: ``served.json``, ``served.md`` and the plots ``served_throughput.png`` and
``served_latency.png`` (p90 latency against the arrival rate).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from .. import traffic
from ..chat_template import text_tokenizer
from ..cost import SpecCalibration
from ..serving.http_load import table_cell, table_row
from .batch_runs import LoadMethod, load_methods
from .report import command_line, figure, save_figures

OFF = "off"


def served_methods(laspec: bool, adaptive: Sequence[str], chain_lengths: Sequence[int], tree_sizes: Sequence[int],
                   block_size: Optional[int] = None) -> list:
    """Speculation off, the fixed structures and the adaptive rules (`batch_runs.load_methods`), as engines run
    them: the load sweep's ``plain`` (stock generate) becomes ``off`` (strategy `plain` in the engine)."""
    methods, _ = load_methods(laspec, adaptive, block_size=block_size, chain_lengths=chain_lengths,
                              tree_sizes=tree_sizes, plain_mode=False)  # `off` is the plain mode, served
    # one long-lived server per method: what the cost rule learns, the verdict of each batch size included, is
    # kept across its runs (`SpecCalibration(keep_pauses=True)`, as the engine's own default)
    return [LoadMethod(OFF, "plain", "plain") if m.family == "plain"
            else dataclasses.replace(m, calibration=SpecCalibration(keep_pauses=True)) for m in methods]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def served(target, tokenizer, drafter, method: LoadMethod, model_name: str, max_batch: int, max_queue: int):
    """A server on 127.0.0.1 (a free port) for `method`'s engine, in a background thread; yields its URL."""
    import uvicorn

    from ..serving.engine import Engine
    from ..serving.server import create_app

    engine = Engine(target, None if method.strategy == "plain" else drafter, strategy=method.strategy,
                    spec_config=method.spec_config, max_batch=max_batch, max_queue=max_queue,
                    calibration=method.calibration)
    app = create_app(engine, tokenizer, model_name)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name=f"served-{method.name}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the {method.name} server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(120)


def _structure(report: dict) -> dict:
    """Draft nodes verified per row-round during the run, from the engine's counters before and after."""
    server = report.get("server") or {}
    before = ((server.get("before") or {}).get("engine") or {}).get("verified_nodes") or {}
    after = ((server.get("after") or {}).get("engine") or {}).get("verified_nodes") or {}
    counts = {int(k): int(v) - int(before.get(k, 0)) for k, v in after.items()}
    counts = {k: v for k, v in counts.items() if v > 0}
    total = sum(counts.values())
    return {"row_rounds": total, "nodes_per_row_round": sum(k * v for k, v in counts.items()) / total if total else None,
            "plain_step_share": counts.get(0, 0) / total if total else None, "histogram": counts}


def _answers(report: dict) -> dict:
    """`{prompt index in the trace: text}` of the answered requests (the load generator keeps each answer)."""
    return {r["index"]: r.get("text") for r in report.get("per_request", []) if r.get("status") == "200"}


def run_served(target, tokenizer, drafter, model_name: str, methods: Sequence[LoadMethod], rates: Sequence[float],
               arrivals: Sequence[str], requests: int, max_new_tokens: int, max_batch: int, max_queue: int,
               seed: int, prompts: Sequence[str], warmup: int = 2, time_limit: float = 900.0,
               progress=sys.stderr, repeats: int = 1) -> dict:
    """Every method at every arrival process and rate, `repeats` passes each (see the module docstring); the
    results dict (each run carries its pass, `repeat`)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    runs, failures = [], []
    for kind in arrivals:
        for index, rate in enumerate(rates):
            for repeat in range(repeats):
                _serve_pass(target, tokenizer, drafter, model_name, methods, kind, rate, index + repeat, repeat,
                            requests, max_new_tokens, max_batch, max_queue, seed, prompts, warmup, time_limit,
                            progress, runs, failures)
    return {"runs": runs, "failures": failures}


def _serve_pass(target, tokenizer, drafter, model_name, methods, kind, rate, rotation, repeat, requests,
                max_new_tokens, max_batch, max_queue, seed, prompts, warmup, time_limit, progress, runs, failures):
    """One pass: every method serves the trace of `kind` at `rate` (order rotated by `rotation`); appends the
    runs and failures."""
    from ..serving.http_load import LoadSpec, run_load

    shift = rotation % len(methods)
    order = list(methods[shift:]) + list(methods[:shift])
    by_method = {}
    for method in order:
        if progress is not None:
            print(f"[served] {kind} rate {rate:g}/s: {method.name}"
                  + (f" (pass {repeat + 1})" if repeat else ""), file=progress, flush=True)
        try:
            with served(target, tokenizer, drafter, method, model_name, max_batch, max_queue) as url:
                if warmup:
                    run_load(LoadSpec(url=url, rate=100.0, requests=warmup, max_tokens=8, prompts=prompts,
                                      seed=seed + 1, time_limit=time_limit))
                report = run_load(LoadSpec(url=url, rate=rate, arrivals=kind, requests=requests, seed=seed,
                                           max_tokens=max_new_tokens, prompts=prompts, label=method.name,
                                           time_limit=time_limit))
        except Exception as error:
            failures.append({"method": method.name, "arrivals": kind, "rate": rate,
                             "error": f"{type(error).__name__}: {error}"})
            continue
        by_method[method.name] = report
    off = by_method.get(OFF)
    reference = _answers(off) if off is not None else None
    for method in methods:
        report = by_method.get(method.name)
        if report is None:
            continue
        counts = report["requests"]
        if counts["ok"] != counts["total"]:
            failures.append({"method": method.name, "arrivals": kind, "rate": rate,
                             "error": f"{counts['total'] - counts['ok']} of {counts['total']} requests not "
                                      f"answered: {counts['errors']}"})
        mismatched = []
        if reference is not None and method.name != OFF:
            answers = _answers(report)
            mismatched = [i for i, text in answers.items()
                          if i in reference and text is not None and text != reference[i]]
            if mismatched:
                failures.append({"method": method.name, "arrivals": kind, "rate": rate,
                                 "error": f"answers differ from speculation off at requests {mismatched}"})
        runs.append({**_record(method, kind, rate, report, off, mismatched), "repeat": repeat})


def _record(method: LoadMethod, kind: str, rate: float, report: dict, off: Optional[dict], mismatched: list) -> dict:
    throughput = report["throughput_tok_s"]
    off_throughput = off["throughput_tok_s"] if off is not None else None
    return {
        "method": method.name, "family": method.family, "strategy": method.strategy, "size": method.size,
        "arrivals": kind, "rate": rate, "requests": report["requests"], "throughput_tok_s": throughput,
        "vs_off": throughput / off_throughput if throughput and off_throughput else None,
        "latency_s": report["latency_s"], "ttft_s": report["ttft_s"], "duration_s": report["duration_s"],
        "completion_tokens": report["completion_tokens"], "structure": _structure(report),
        "mismatched_requests": mismatched,
    }


def served_markdown(results: dict) -> str:
    """One table per arrival process: a row per (rate, method)."""
    setup = results["settings"]
    lines = [f"Served load ({setup['target']} + {setup['drafter']}; {setup['requests']} requests per run, "
             f"{setup['max_new_tokens']} new tokens, greedy, max batch {setup['max_batch']}; "
             f"{setup['machine']}, {setup['date']}).", ""]
    passes = 1 + max((run.get("repeat", 0) for run in results["runs"]), default=0)
    for kind in dict.fromkeys(run["arrivals"] for run in results["runs"]):
        lines += [f"### {kind} arrivals", "",
                  "| rate (req/s) | method | tok/s | vs off | latency mean | p50 | p90 | p99 | TTFT mean | p90 "
                  "| nodes / row-round | plain steps |",
                  "|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
        for run in results["runs"]:
            if run["arrivals"] != kind:
                continue
            latency, ttft, structure = run["latency_s"], run["ttft_s"], run["structure"]
            share = structure["plain_step_share"]
            label = run["method"] + (f" (pass {run['repeat'] + 1})" if passes > 1 else "")
            measured = (latency["mean"], latency["p50"], latency["p90"], latency["p99"], ttft["mean"], ttft["p90"],
                        structure["nodes_per_row_round"])
            lines.append(table_row([f"{run['rate']:g}", label, table_cell(run["throughput_tok_s"], 1),
                                    table_cell(run["vs_off"]) + "x", *map(table_cell, measured),
                                    "-" if share is None else f"{100 * share:.0f}%"]))
        lines.append("")
    if passes > 1:
        lines += passes_table(results) + [""]
    if results["failures"]:
        lines += ["Failures:", ""] + [f"- {f['method']} {f['arrivals']} {f['rate']:g}: {f['error']}"
                                      for f in results["failures"]]
    return "\n".join(lines) + "\n"


def pass_ratios(results: dict) -> dict:
    """`{(arrivals, rate, method): {"throughput": [...], "latency": [...]}}`: per pass, the method's throughput over
    `off`'s and its mean end-to-end latency over `off`'s in the same pass (None where either is missing)."""
    runs = results["runs"]
    off = {(run["arrivals"], run["rate"], run.get("repeat", 0)): run for run in runs if run["method"] == OFF}
    ratios = {}
    for run in runs:
        if run["method"] == OFF:
            continue
        base = off.get((run["arrivals"], run["rate"], run.get("repeat", 0)))
        mine, theirs = run["latency_s"]["mean"], base["latency_s"]["mean"] if base else None
        entry = ratios.setdefault((run["arrivals"], run["rate"], run["method"]), {"throughput": [], "latency": []})
        entry["throughput"].append(run["vs_off"])
        entry["latency"].append(mine / theirs if mine and theirs else None)
    return ratios


def passes_table(results: dict) -> list:
    """Markdown lines: each method's ratios over `off` pass by pass (throughput; mean latency), and their means."""
    def listed(values: list) -> str:
        known = [v for v in values if v is not None]
        mean = f" (mean {sum(known) / len(known):.2f}x)" if known else ""
        return ", ".join("-" if v is None else f"{v:.2f}x" for v in values) + mean

    lines = ["### pass by pass, over `off` in the same pass", "",
             "| arrivals | rate (req/s) | method | throughput vs off | mean latency vs off |", "|---|--:|---|---|---|"]
    for (kind, rate, method), entry in pass_ratios(results).items():
        lines.append(f"| {kind} | {rate:g} | {method} | {listed(entry['throughput'])} | {listed(entry['latency'])} |")
    return lines


PLOT_FILES = {"throughput": "served_throughput.png", "latency": "served_latency.png"}


def write_served_plots(results: dict, out_dir: Path) -> dict:
    """Throughput and p90 latency against the arrival rate, one line per method and arrival process
    (`report.save_figures`: ``{"files": {kind: filename}, "skipped": [reasons]}``)."""
    makers = [("throughput", lambda: _plot_by_rate(results, lambda run: run["throughput_tok_s"],
                                                   "completion tokens / s")),
              ("latency", lambda: _plot_by_rate(results, lambda run: run["latency_s"]["p90"],
                                                "p90 end-to-end latency (s)"))]
    return save_figures(makers, out_dir, PLOT_FILES)


def _plot_by_rate(results: dict, value_of, ylabel: str):
    """One line per (method, arrival process): `value_of(run)` against the rate, the mean over passes."""
    fig = figure(7, 4)
    ax = fig.add_subplot(1, 1, 1)
    runs = results["runs"]
    for kind in dict.fromkeys(run["arrivals"] for run in runs):
        for method in dict.fromkeys(run["method"] for run in runs):
            by_rate = {}
            for run in runs:
                value = value_of(run)
                if run["arrivals"] == kind and run["method"] == method and value is not None:
                    by_rate.setdefault(run["rate"], []).append(value)
            points = [(rate, sum(values) / len(values)) for rate, values in by_rate.items()]
            if points:
                ax.plot(*zip(*points), marker="o", label=f"{method} ({kind})",
                        linestyle="-" if kind == "poisson" else "--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("arrival rate (requests / s)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def add_arguments(parser) -> None:
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default="laspec-smollm2-135m-instruct")
    parser.add_argument("--drafter-int8", action=argparse.BooleanOptionalAction, default=True,
                        help="int8-quantize an independent drafter, as `serve` does (CPU; the target is never changed)")
    parser.add_argument("--strategies", nargs="+", default=None,
                        help="adaptive rules (default: laspec with a LaSpec drafter, else sage)")
    parser.add_argument("--fixed", nargs="*", default=["chain2", "chain4", "tree8"],
                        help="fixed structures chain{k} / tree{n} (default: chain2 chain4 tree8)")
    parser.add_argument("--arrivals", nargs="+", choices=traffic.PROCESSES, default=["poisson"])
    parser.add_argument("--rates", nargs="+", type=float, default=[0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", default=None, help="a prompts file (default: the load generator's list)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1,
                        help="passes per arrival process and rate, the method order rotated per pass (default 1)")
    parser.add_argument("--no-prepare", action="store_true",
                        help="skip measuring the verifier's cost curve at batch sizes 1..--max-batch before the runs "
                             "(measured once per machine, then read from disk)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds per run at most")
    parser.add_argument("--out", default="bench_served")


def run(args) -> int:
    """`hf-adaptive-spec bench-served`: run, write the outputs, print the tables; 1 on any failure."""
    import platform

    import torch

    from ..loading import is_laspec, load_assistant, load_model
    from ..serving.http_load import DEFAULT_PROMPTS, load_prompts
    from .concurrency_options import fixed_structures
    from .report import environment

    if (args.requests < 1 or args.max_batch < 1 or args.max_new_tokens < 1 or args.repeats < 1
            or any(r <= 0 for r in args.rates)):
        raise SystemExit("bench-served: --requests, --max-batch, --max-new-tokens, --repeats and every rate must be "
                         "positive.")
    chains, trees = fixed_structures(args.fixed)
    if args.threads:
        torch.set_num_threads(args.threads)
    laspec = is_laspec(args.drafter)
    adaptive = args.strategies or (["laspec"] if laspec else ["sage"])
    target, processor = load_model(args.target)
    tokenizer = text_tokenizer(processor)
    drafter = load_assistant(args.drafter, target, args.drafter_int8)
    block_size = getattr(getattr(drafter, "config", None), "block_size", None) if laspec else None
    methods = served_methods(laspec, adaptive, chains, trees, block_size)
    prompts = tuple(load_prompts(args.prompts)) if args.prompts else DEFAULT_PROMPTS
    if not args.no_prepare:  # the cost rule prices each batch size on its measured curve, as a prepared server's
        from ..decoding.prepare import prepare

        for strategy in dict.fromkeys(m.strategy for m in methods if m.family == "adaptive"):
            prepare(target, drafter, strategy, batch_sizes=list(range(1, args.max_batch + 1)))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    env = environment(torch.device("cpu"), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)))
    results = run_served(target, tokenizer, drafter, args.target, methods, args.rates, args.arrivals, args.requests,
                         args.max_new_tokens, args.max_batch, args.max_queue, args.seed, prompts, args.warmup,
                         args.time_limit, repeats=args.repeats)
    results["settings"] = {
        "target": args.target, "drafter": args.drafter, "drafter_int8": bool(args.drafter_int8 and not laspec),
        "methods": [m.name for m in methods],
        "rates": list(args.rates), "arrivals": list(args.arrivals), "requests": args.requests,
        "max_new_tokens": args.max_new_tokens, "max_batch": args.max_batch, "seed": args.seed,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(), "machine": f"{env['cpu_model'] or platform.machine()}, "
        f"{torch.get_num_threads()} threads", "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
        "seconds": time.time() - started, "environment": env, "command": command_line(),
    }
    (out_dir / "served.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    markdown = served_markdown(results)
    (out_dir / "served.md").write_text(markdown, encoding="utf-8")
    write_served_plots(results, out_dir)
    print(markdown)
    return 1 if results["failures"] else 0
