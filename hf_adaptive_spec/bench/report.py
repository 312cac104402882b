"""The benchmark's reports: the environment description, JSON helpers, the Markdown tables of ``results.md``,
the printed summary and the PNG plots (matplotlib on an Agg canvas; `save_figures` is shared with
`hf_adaptive_spec.bench.concurrency_report`).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

from . import vision as bench_vision
from .stats import PLAIN, PLAIN_MODE, STOCK_BEST, STOCK_DEFAULT
from ..ops import cpu_linear

__all__ = [
    "PLOT_FILES",
    "category_table",
    "method_table",
    "save_figures",
    "write_markdown",
    "write_plots",
]

PLOT_FILES = {
    "speedup": "speedup_by_category.png",
    "accepted_lengths": "accepted_lengths.png",
    "sage_alpha": "sage_alpha_vs_accepted.png",
    "visual_sweep": "visual_tokens_acceptance.png",
}


# ----------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------
def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds")


def _cpu_model() -> Optional[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "processor\t: arm")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=Path(__file__).resolve().parent,
                               capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except Exception:
        pass
    return None


def command_line() -> str:
    """The command as typed, as far as `sys.argv` tells (`python -m hf_adaptive_spec.bench` for this module)."""
    argv = list(sys.argv)
    if not argv:
        return ""
    if Path(argv[0]).resolve() in (Path(__file__).with_name("run.py").resolve(),
                                 Path(__file__).with_name("__main__.py").resolve()):
        return shlex.join(["python", "-m", "hf_adaptive_spec.bench"] + argv[1:])
    return shlex.join([Path(argv[0]).name] + argv[1:])



def sklearn_available() -> bool:
    """Whether scikit-learn is importable: stock assisted generation (transformers' `AssistedCandidateGenerator`)
    adapts its `assistant_confidence_threshold` only then (by an ROC curve of the drafts it saw)."""
    import importlib.util

    return importlib.util.find_spec("sklearn") is not None


def environment(device: torch.device, started: str) -> dict:
    import transformers

    from .. import __version__

    env = {
        "started": started,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_adaptive_spec": __version__,
        "git_commit": _git_commit(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        # stock assisted generation adapts its confidence threshold only when scikit-learn is importable
        "sklearn_available": sklearn_available(),
        # the speculative rounds' small-batch linear kernel (plain generate never uses it)
        "cpu_small_linear": device.type == "cpu" and cpu_linear.enabled(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def jsonable(value):
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    return repr(value)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def fmt(value, digits=2, suffix="") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _speedup_cell(summary, label) -> str:
    total = summary.get(f"speedup_vs_{label}")
    geomean = summary.get(f"speedup_vs_{label}_geomean")
    return "–" if total is None else f"{total:.2f}x ({geomean:.2f}x)"


def method_table(group: dict) -> list:
    """Markdown rows: one line per method of `group` (method -> summary), speeds, tau and the time split."""
    lines = [
        "| method | prompts | tokens/s | tau | vs plain | vs plain mode | vs stock best | vs stock default "
        "| accept rate | draft | tree | verify | accept | compact | failures |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, s in group.items():
        split = s.get("time_split") or {}
        cells = [name, str(s["prompts"]), fmt(s["tokens_per_s"]), fmt(s["tau"]),
                 "1.00x" if name == PLAIN else _speedup_cell(s, "plain"),
                 "1.00x" if name == PLAIN_MODE else _speedup_cell(s, "plain_mode"),
                 _speedup_cell(s, "stock_best") if name != STOCK_BEST else "1.00x",
                 _speedup_cell(s, "stock_default") if name != STOCK_DEFAULT else "1.00x",
                 fmt(s.get("acceptance_rate"))]
        cells += [fmt(100 * split[p], 0, "%") if split.get(p) is not None else "–"
                  for p in ("draft", "tree", "verify", "accept", "compact")]
        cells.append(f"**FAIL {s['failures']}**" if s["failures"] else "0")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def category_table(categories: dict, method_names: list) -> list:
    """Markdown rows: each method's speedup over plain per category (and over the plain mode, after a slash, where
    it ran)."""
    names = list(categories)
    lines = ["| method | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for method in method_names:
        if method == PLAIN:
            continue
        cells = []
        for c in names:
            s = categories[c].get(method)
            over_mode = None if s is None or method == PLAIN_MODE else s.get("speedup_vs_plain_mode")
            cells.append("–" if s is None or s["speedup_vs_plain"] is None else
                         f"{s['speedup_vs_plain']:.2f}x" + (f" / {over_mode:.2f}x" if over_mode else "")
                         + (" FAIL" if s["failures"] else ""))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines.append("| prompts | " + " | ".join(str(max(s["prompts"] for s in categories[c].values()))
                                            for c in names) + " |")
    return lines


def write_markdown(results: dict, path: Path) -> None:
    """``results.md``: setup, failures, then one method table (and a per-category table) per data set."""
    env, agg = results["environment"], results["aggregates"]
    methods = list(results["methods"])
    lines = [
        "# hf_adaptive_spec benchmark",
        "",
        f"- command: `{results['command']}`",
        f"- target: `{results['models']['target']}`; drafter: `{results['models']['drafter']}`"
        + (" (int8 dynamic)" if results["models"]["drafter_int8"] else "")
        + (f", with {results['models']['drafter_datastore']['repr']}"
           if results["models"].get("drafter_datastore") else ""),
        f"- greedy, max_new_tokens={results['settings']['max_new_tokens']}, warm-up runs per method: "
        f"{results['settings']['warmup']}, order of methods rotated per prompt",
        f"- {env['device']} ({env.get('gpu') or env['cpu_model']}), {env['threads']} threads"
        + ("; CPU small-batch linear kernel in the speculative rounds" if env.get("cpu_small_linear") else "")
        + f"; torch {env['torch']}, "
        f"transformers {env['transformers']}, hf_adaptive_spec {env['hf_adaptive_spec']} ({env['git_commit']}); "
        f"{env['started']} -> {env['finished']}",
    ]
    for name in (STOCK_DEFAULT, STOCK_BEST):
        if name in results["methods"]:
            lines.append(f"- {name}: `{json.dumps(results['methods'][name]['resolved'])}`"
                         + ("" if env["sklearn_available"] else " (scikit-learn absent: the threshold does not adapt)"))
    for name, m in results["methods"].items():
        if m["kind"] == "spec":
            lines.append(f"- {name}: `{json.dumps(m['resolved'])}`")
    lines += ["", "Speedups: ratio of summed seconds on the same prompts (geometric mean of per-prompt ratios in "
              "brackets). tau: tokens per target verification forward. Time split: fraction of the strategy's "
              "generate time.", ""]
    failures = results["failures"]
    if failures["count"]:
        lines += [f"## FAILURES: {failures['count']}", ""]
        lines += [f"- {f['method']} on {f['prompt_id']}: {f['reason']}" for f in failures["items"]]
        lines.append("")
    else:
        lines += ["Every output equals plain greedy token for token.", ""]
    lines += ["## All data sets", ""] + method_table(agg["overall"]) + [""]
    for dataset, group in agg["datasets"].items():
        lines += [f"## {dataset}", ""] + method_table(group) + [""]
        if len(agg["categories"][dataset]) > 1:
            lines += [f"### {dataset}: speedup over plain per category", ""]
            lines += category_table(agg["categories"][dataset], methods) + [""]
        grounded = bench_vision.grounded_table(group)
        if grounded:
            lines += [f"### {dataset}: grounded tokens (colours, shapes) vs the others", "",
                      "Tokens of the speculative runs by class; accepted: drafted and accepted (the rest the target "
                      "made: prefill, bonus and correction tokens); share: accepted / tokens.", ""]
            lines += grounded + [""]
    if results.get("visual_sweep"):
        swept = sorted({results["methods"][row["method"]]["strategy"] for row in results["visual_sweep"]
                        if row["method"] in results.get("methods", {})})
        lines += [f"## Visual-token sweep ({', '.join(swept)})", "",
                  "M visual tokens the drafter sees, chosen by the target's attention (laspec: per round; an "
                  "independent drafter: once after the prefill, or per round). tau and speedup over plain on every "
                  "data set; grounded / other: acceptance share on scene prompts; selection: visual-token selection "
                  "time per round and as a share of the run's time.", ""]
        lines += bench_vision.sweep_table(results["visual_sweep"]) + [""]
    plots = results.get("plots", {})
    if plots.get("files"):
        lines += ["## Plots", ""] + [f"![{name}]({file})" for name, file in plots["files"].items()] + [""]
    if plots.get("skipped"):
        lines += [f"Plots skipped: {'; '.join(plots['skipped'])}", ""]
    path.write_text("\n".join(lines))


def write_outputs(results: dict, records: list, out_dir: Path, plots: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    results["plots"] = write_plots(results, out_dir) if plots else {"files": {}, "skipped": ["--no-plots"]}
    results["files"] = {"json": "results.json", "markdown": "results.md", **results["plots"]["files"]}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    write_markdown(results, out_dir / "results.md")


def print_summary(results: dict, out_dir: Path) -> None:
    lines = ["", "All data sets:"] + method_table(results["aggregates"]["overall"])
    if results["failures"]["count"]:
        lines.append(f"FAILURES: {results['failures']['count']} runs (see results.md)")
        for item in results["failures"]["items"][:20]:
            lines.append(f"  {item['method']} {item['prompt_id']}: {item['reason']}")
    lines.append(f"wrote {out_dir / 'results.json'}, {out_dir / 'results.md'}"
                 + "".join(f", {out_dir / f}" for f in results["plots"]["files"].values()))
    print("\n".join(lines))


# ----------------------------------------------------------------------------
# Plots (matplotlib, Agg canvas: no pyplot, no global backend change)
# ----------------------------------------------------------------------------
def figure(width, height):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def save_figures(makers: list, out_dir: Path, filenames: dict) -> dict:
    """Run each `(kind, make)` of `makers` (`make()` -> a Figure, or None for no data) and save its PNG under
    `filenames[kind]`; returns ``{"files": {kind: filename}, "skipped": [reasons]}``. A failing plot is
    reported, never raised: a plot must never lose the measurements."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return {"files": {}, "skipped": ["matplotlib is not installed (pip install 'hf_adaptive_spec[bench]')"]}
    files, skipped = {}, []
    for kind, make in makers:
        try:
            fig = make()
        except Exception as exc:
            skipped.append(f"{kind}: {describe(exc)}")
            continue
        if fig is None:
            skipped.append(f"{kind}: no data")
            continue
        fig.savefig(out_dir / filenames[kind])
        files[kind] = filenames[kind]
    return {"files": files, "skipped": skipped}


def write_plots(results: dict, out_dir: Path) -> dict:
    """Write the PNGs; returns ``{"files": {kind: filename}, "skipped": [reasons]}``."""
    records = results["records"]
    plots = [("speedup", _plot_speedup), ("accepted_lengths", _plot_accepted_lengths),
             ("sage_alpha", _plot_sage_alpha)]
    if results.get("visual_sweep"):  # only when a sweep ran
        plots.append(("visual_sweep", _plot_visual_sweep))
    makers = [(kind, lambda plot=plot: plot(results, records)) for kind, plot in plots]
    return save_figures(makers, out_dir, PLOT_FILES)


def _plot_speedup(results, records):
    agg = results["aggregates"]
    groups = []  # (label, {method: summary})
    for dataset, categories in agg["categories"].items():
        for category, summary in categories.items():
            groups.append((dataset if category == dataset else f"{dataset}\n{category}", summary))
    if len(agg["datasets"]) > 1 or any(len(c) > 1 for c in agg["categories"].values()):
        groups.append(("all", agg["overall"]))
    methods = [m for m in results["methods"] if m != PLAIN]
    if not methods or not groups:
        return None
    fig = figure(max(7.0, 0.35 * len(groups) * len(methods) + 3.0), 4.2)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [(g[1].get(method) or {}).get("speedup_vs_plain") or 0.0 for g in groups]
        xs = [g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=method)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g[0] for g in groups], fontsize=8)
    ax.set_ylabel("speedup over plain greedy (x)")
    ax.set_title(f"{results['models']['target']} + {results['models']['drafter']}, "
                 f"{results['settings']['max_new_tokens']} new tokens", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def _plot_accepted_lengths(results, records):
    strategies = [m for m, info in results["methods"].items() if info["kind"] == "spec"]
    lengths = {m: [x for r in records if r["method"] == m for x in r.get("accepted_lengths", [])] for m in strategies}
    lengths = {m: v for m, v in lengths.items() if v}
    if not lengths:
        return None
    fig = figure(3.2 * len(lengths) + 0.6, 3.4)
    top = max(max(v) for v in lengths.values())
    for i, (method, values) in enumerate(lengths.items()):
        ax = fig.add_subplot(1, len(lengths), i + 1)
        ax.hist(values, bins=[b - 0.5 for b in range(top + 2)], density=True, rwidth=0.85)
        ax.set_xticks(range(top + 1))
        tau = results["aggregates"]["overall"][method]["tau"]
        ax.set_title(f"{method}: tau {fmt(tau)}, {len(values)} rounds", fontsize=9)
        ax.set_xlabel("accepted draft tokens per round")
        if i == 0:
            ax.set_ylabel("fraction of rounds")
    fig.tight_layout()
    return fig


def _plot_visual_sweep(results, records):
    models = results["models"]
    title = f"laspec: acceptance against M\n{Path(models['target']).name} + {Path(models['drafter']).name}"
    return bench_vision.plot_visual_sweep(results["visual_sweep"], figure, title)


def _plot_sage_alpha(results, records):
    pairs = [(a, n) for r in records if r["method"] == "sage" and r.get("sage_alphas")
             for a, n in zip(r["sage_alphas"], r.get("accepted_lengths", []))]
    if not pairs:
        return None
    import random

    jitter = random.Random(0)
    alphas = [a for a, _ in pairs]
    accepted = [n + jitter.uniform(-0.15, 0.15) for _, n in pairs]
    fig = figure(5.5, 4.0)
    ax = fig.add_subplot(1, 1, 1)
    ax.scatter(alphas, accepted, s=6, alpha=0.35)
    bins = 10  # mean accepted length per alpha decile
    centers, means = [], []
    for b in range(bins):
        low, high = b / bins, (b + 1) / bins
        inside = [n for a, n in pairs if low <= a < high or (b == bins - 1 and a == 1.0)]
        if inside:
            centers.append((low + high) / 2)
            means.append(sum(inside) / len(inside))
    ax.plot(centers, means, color="crimson", marker="o", label="mean per alpha bin")
    ax.set_xlabel("SAGE confidence alpha of the round")
    ax.set_ylabel("accepted draft tokens (jittered)")
    ax.set_title(f"sage: alpha vs accepted length, {len(pairs)} rounds", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
