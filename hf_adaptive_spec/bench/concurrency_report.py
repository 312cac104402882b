"""The batched modes' result files: the Markdown of the sweep and of the arrivals, and the sweep's plots."""

from __future__ import annotations

import json
from pathlib import Path

from .batch_runs import WARMUP_TOKENS
from .report import figure, fmt, save_figures
from .stats import PLAIN, PLAIN_MODE

__all__ = ["PLOT_FILES", "arrivals_markdown", "arrivals_table", "sweep_markdown", "sweep_tables",
           "write_load_plots"]


PLOT_FILES = {"structure": "load_structure_size.png", "throughput": "load_throughput.png"}


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
            ratios = f"{r['speedup_vs_plain']:.2f}x"
            if r["method"] != PLAIN_MODE and r.get("speedup_vs_plain_mode") is not None:
                ratios += f" / {r['speedup_vs_plain_mode']:.2f}x"
            text += f" ({ratios})"
        return text + (" FAIL" if r["matches_plain"] is False or r["error"] else "")

    def size(r):
        if r is None or r.get("nodes_per_round") is None:
            return "–"
        return f"{r['nodes_per_round']:.2f} ({r['candidates_per_round']:.2f})"

    best_row = "| best fixed | " + " | ".join(
        f"{best[b]['method']} {best[b]['tokens_per_s']:.1f} ({fmt(best[b]['speedup_vs_plain'])}x"
        + (f" / {fmt(best[b]['speedup_vs_plain_mode'])}x" if best[b].get("speedup_vs_plain_mode") else "") + ")"
        if b in best else "–" for b in levels) + " |"
    return {
        "throughput": [head, rule] + [row(name, throughput) for name in methods] + [best_row],
        "tau": [head, rule] + [row(name, lambda r: "–" if r is None else fmt(r.get("tau")))
                               for name in methods],
        "sizes": [head, rule] + [row(name, size) for name in methods if name not in (PLAIN, PLAIN_MODE)],
    }


def sweep_markdown(results: dict) -> str:
    """``load_sweep.md``: setup, failures, throughput / speedup, tau and structure size per level and method."""
    lines = ["# hf_adaptive_spec under load: concurrency sweep", ""] + _setup_lines(results)
    lines += ["- order of methods rotated per level"] + _method_lines(results["methods"])
    lines += [f"- {name}: not run ({reason})" for name, reason in results["skipped_methods"].items()]
    lines += ["", "b: rows decoding together (the first b prompts, left-padded). Throughput: new tokens over all rows "
              "(each up to its EOS) / seconds of the batch's `generate`; speedup: plain's seconds / the method's, "
              "same batch, then after a slash the plain mode's seconds / the method's (plain_mode: "
              "spec_strategy='plain', the library's forward without a drafter: the share of a speedup that is "
              "speculation). tau: tokens per row and target verification forward. Nodes per round: draft nodes "
              "verified per row and round (SpecStats drafted_tokens / row_rounds; root not counted); in brackets "
              "the candidates before the cost rule trimmed them. best fixed: the fixed structure of highest "
              "throughput at that level, picked after the fact from these runs.", ""]
    lines += _failure_lines(results["failures"])
    tables = sweep_tables(results)
    lines += ["## Throughput (tokens/s; speedup over plain / over the plain mode)", ""] + tables["throughput"]
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
    # a results file without the key was summarized by nearest rank
    rule = "linear interpolation" if s.get("percentile") == "linear" else "nearest rank"
    lines += ["", "A free server batches every request that has arrived (first come first served, up to the maximum) "
              "and runs the batch to completion; latency: the batch's finish - the request's arrival (simulated "
              f"clock, measured batch times); p90 by {rule}; throughput over first arrival to last finish.", ""]
    lines += _failure_lines(results["failures"])
    return "\n".join(lines + arrivals_table(results)) + "\n"


def arrivals_table(results: dict) -> list:
    """The arrivals' Markdown table (latency, throughput, tau and structure per method), as lines."""
    lines = ["| method | mean latency s | p90 latency s | max latency s | mean latency vs plain | tokens/s "
             "| vs plain | vs plain mode | requests/s | batches | mean batch | busy s | tau | nodes/round |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in results["methods"].items():
        if m.get("error"):
            lines.append(f"| {name} | **FAIL**: {m['error']} |" + " |" * 13)
            continue
        cells = [fmt(m["mean_latency_s"], 3), fmt(m["p90_latency_s"], 3),
                 fmt(m["max_latency_s"], 3),
                 "1.00x" if name == PLAIN else fmt(m.get("mean_latency_vs_plain"), 2, "x"),
                 fmt(m.get("tokens_per_s"), 1),
                 "1.00x" if name == PLAIN else fmt(m.get("tokens_per_s_vs_plain"), 2, "x"),
                 "1.00x" if name == PLAIN_MODE else fmt(m.get("tokens_per_s_vs_plain_mode"), 2, "x"),
                 fmt(m["requests_per_s"], 3), str(m["batches"]),
                 fmt(m["mean_batch_size"]), fmt(m["busy_s"], 1),
                 fmt(m.get("tau")), fmt(m.get("nodes_per_round"))]
        lines.append(f"| {name}" + (" **FAIL**" if m["failures"] else "") + " | " + " | ".join(cells) + " |")
    return lines


def write_load_plots(results: dict, out_dir: Path) -> dict:
    """The sweep's PNGs: chosen structure size against load, throughput against load per method; returns
    ``{"files": {kind: filename}, "skipped": [reasons]}``."""
    makers = [(kind, lambda plot=plot: plot(results))
              for kind, plot in (("structure", _plot_structure), ("throughput", _plot_throughput))]
    return save_figures(makers, out_dir, PLOT_FILES)


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
    spec = [name for name, m in results["methods"].items() if m["family"] not in ("plain", "plain_mode")]
    if not any(_series(results, name, "nodes_per_round")[0] for name in spec):
        return None
    fig = figure(6.5, 4.2)
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
    fig = figure(7.5, 4.4)
    ax = _load_axes(fig, results, "throughput, new tokens/s over all rows")
    for name in names:
        xs, ys = _series(results, name, "tokens_per_s")
        if not xs:
            continue
        family = results["methods"][name]["family"]
        style = {"plain": dict(color="black", linewidth=2), "plain_mode": dict(color="gray", linewidth=2),
                 "adaptive": dict(linewidth=2, marker="o"),
                 "fixed": dict(linewidth=0.9, linestyle="--", marker=".")}[family]
        ax.plot(xs, ys, label=name, **style)
    best = results["best_fixed"]
    if best:
        ax.plot([b["level"] for b in best], [b["tokens_per_s"] for b in best], linestyle=":", color="crimson",
                linewidth=1.5, label="best fixed (after the fact)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
