"""Tables in the docs regenerated from the bench's JSON: `hf-adaptive-spec bench-docs`.

A Markdown file marks each generated table with the results file it comes from (relative to the Markdown file)
and what to draw from it::

    <!-- bench-table: benchmarks/scenes/results.json methods scenes -->
    | method | prompts | ... |
    <!-- /bench-table -->

Kinds: ``methods [DATASET]`` (the method table of one data set, or of all), ``categories DATASET`` (speedup over
plain per category), ``grounded DATASET`` (grounded-token acceptance) and ``sweep`` (the visual-token sweep):
the same tables the bench writes in its ``results.md``; from a ``--load-sweep``'s ``load_sweep.json``,
``load throughput``, ``load tau`` and ``load sizes`` (the tables of its ``load_sweep.md``), and from an
``--arrivals`` run's ``arrivals.json``, ``arrivals``. Everything between the markers is replaced; the prose
around them is the author's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from . import vision as bench_vision
from .concurrency_report import arrivals_table, sweep_tables
from .report import category_table, method_table

__all__ = ["refresh", "render_table"]

_BLOCK = re.compile(r"(<!-- bench-table: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /bench-table -->)", re.DOTALL)


def render_table(results: dict, kind: str, dataset: str | None = None) -> list:
    """The Markdown lines of one table of a bench `results.json` (see the module docstring)."""
    if kind == "arrivals":
        return arrivals_table(results)
    if kind == "load":
        tables = sweep_tables(results)
        if dataset not in tables:
            raise ValueError(f"unknown load table {dataset!r}: valid are {', '.join(tables)}.")
        return tables[dataset]
    aggregates = results["aggregates"]
    if kind != "sweep" and dataset is not None and dataset not in aggregates["datasets"]:
        raise ValueError(f"the results hold no data set {dataset!r} (they hold {', '.join(aggregates['datasets'])}).")
    if kind == "methods":
        return method_table(aggregates["overall"] if dataset is None else aggregates["datasets"][dataset])
    if kind == "categories" and dataset is not None:
        return category_table(aggregates["categories"][dataset], list(results["methods"]))
    if kind == "grounded" and dataset is not None:
        return bench_vision.grounded_table(aggregates["datasets"][dataset])
    if kind == "sweep":
        if not results.get("visual_sweep"):
            raise ValueError("the results hold no visual-token sweep (bench --visual-tokens).")
        return bench_vision.sweep_table(results["visual_sweep"], aggregates.get("overall"))
    raise ValueError(f"unknown table {kind!r}{' ' + dataset if dataset else ''}: valid are methods [DATASET], "
                     "categories DATASET, grounded DATASET, sweep, load throughput|tau|sizes, arrivals.")


def refresh(path, check: bool = False) -> list:
    """Regenerate every marked table of the Markdown file `path` from its results file.

    Returns the specs of the tables whose text changed; with `check`, the file is left as it is (a non-empty
    answer then means the file is stale).
    """
    path = Path(path)
    text = path.read_text()
    changed = []

    def replace(match) -> str:
        spec = match.group("spec").split()
        if len(spec) not in (2, 3):
            raise ValueError(f"{path}: a bench-table marker needs 'RESULTS_JSON KIND [DATASET]', got {spec}.")
        source = path.parent / spec[0]
        if not source.is_file():
            raise FileNotFoundError(f"{path}: no results file {source} (marker {' '.join(spec)}).")
        body = "\n".join(render_table(json.loads(source.read_text()), *spec[1:])) + "\n"
        if body != match.group("body"):
            changed.append(" ".join(spec))
        return match.group(1) + body + match.group(4)

    new = _BLOCK.sub(replace, text)
    if changed and not check:
        path.write_text(new)
    return changed


def add_arguments(parser):
    parser.add_argument("files", nargs="*", default=["docs/benchmarks.md"], help="Markdown files (default: "
                        "docs/benchmarks.md)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    return parser


def run(args) -> int:
    stale = {str(file): refresh(file, check=args.check) for file in args.files}
    for file, specs in stale.items():
        for spec in specs:
            print(f"{file}: {'stale' if args.check else 'regenerated'}: {spec}")
    return 1 if args.check and any(stale.values()) else 0
