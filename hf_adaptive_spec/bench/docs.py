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
``--arrivals`` run's ``arrivals.json``, ``arrivals``; from a ``--memory`` run's ``memory.json``, ``memory`` (and
``memory phases``: the peak within each phase of the speculative calls, and after the prefill), and
from a ``--cold`` run's ``cold.json``, ``cold`` (the tables those modes print). Everything between the markers
is replaced; the prose around them is the author's.

Two general kinds draw any other table. Their arguments are split as a shell splits words (quote what holds
spaces), and a marker may run over several lines.

``rows KEYPATH [where:CONDITION] [by:FIELD,...] [rule:RULE] COLUMN...`` takes the records at ``KEYPATH`` (dotted
keys, list items by index: ``runs``, ``aggregates.datasets.mtbench``; a mapping gives one record per entry, its
key as ``_key``), keeps those that meet every ``where:`` (``key=v1,v2`` terms joined by ``&``; numbers compare
as numbers), and writes one row per record, or per group of records equal in the ``by:`` fields (in order of
first appearance). Each ``COLUMN`` is ``HEADER=VALUE[|AGGREGATE][:FORMAT]``: ``VALUE`` a dotted field of the
record, optionally ``FIELD@CONDITION`` (only the group's records that meet it) or ``A@C1/B@C2`` (the ratio of
paired records, in order: a run over the baseline of the same pass); ``AGGREGATE`` over the group's values:
``first`` (the default), ``mean``, ``min``, ``max``, ``sum``, ``pooled`` (a ratio's sum of first sides over
its sum of second sides: ``tau_num/tau_den|pooled``), ``range`` (``lo-hi``, the format's suffix once), ``list``
(comma-separated) or ``listmean`` (the list and its mean); ``FORMAT`` a format spec (``.2f``) or a template
(``{:.2f}x``, ``{:.0%}``). ``~CONDITION`` after a numeric aggregate (``first`` to ``pooled``) divides the
group's figure by the same figure of the first group holding a record that meets ``CONDITION``: speed against
a default row. A ``KEYPATH`` in brackets (``[environment]``; ``[.]`` the whole file) is one record, the mapping
it names. Missing values print ``–``, booleans ``yes`` / ``no``. ``rule:`` sets the alignment line (default:
right-aligned where a format is given). Example, one row per rate of a served run with the latency of
``laspec`` over ``off`` pass by pass::

    <!-- bench-table: benchmarks/served/served.json rows runs where:arrivals=poisson by:rate
         "rate=rate" "off s=latency_s.mean@method=off|mean:.2f"
         "vs off=latency_s.mean@method=laspec/latency_s.mean@method=off|listmean:{:.2f}x" -->

A ``rows`` marker with no results file before it reads several: each ``from:FILE[#KEYPATH][=LABEL]`` (relative
to the Markdown file) adds the records at ``KEYPATH`` of ``FILE`` (default: the marker's ``KEYPATH``), each
carrying ``LABEL`` (default: ``FILE``) as ``_label`` and its ``|``-separated parts as ``_labels`` (``_labels.0``,
``_labels.1``: one column each). Example, one row per run of a setting, nodes per round pooled over its prompts
and its speed over plain against the default's::

    <!-- bench-table: rows records by:_label
         from:benchmarks/a/results.json=default "from:benchmarks/b/results.json=every node" "setting=_label"
         "nodes=spec_stats.drafted_tokens@method=laspec/spec_stats.rounds@method=laspec|pooled:.1f"
         "vs default=time_s@method=plain/time_s@method=laspec|pooled~_label=default:{:.2f}x" -->

``headline HEADER | HEADER ...`` (no results file before it; the README's results table) takes one row per
following line of the marker, ``FILES SCOPE METHOD | CELL | CELL ...``: ``FILES`` one results file or several
joined by commas (named runs whose figures become ``lo-hi`` ranges), ``SCOPE`` a data set, ``all`` (a bench
run's every data set) or ``levels`` (every level of a load sweep), ``METHOD`` the method whose tau, speedup over
plain and over the plain mode fill the columns after the cells, and the date and machine the last. A cell may
quote another method's figures of the same runs: ``{stock_default.speedup}``, ``{chain.mode}``, ``{sage.tau}``.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from . import vision as bench_vision
from .cold import cold_table
from .concurrency_report import arrivals_table, sweep_tables
from .docs_rows import headline_table, rows_table
from .memory import memory_table, phase_table
from .report import category_table, method_table

__all__ = ["refresh", "render_table"]

_BLOCK = re.compile(r"(<!-- bench-table: (?P<spec>[^>]*?)\s+-->\n)(?P<body>.*?)(<!-- /bench-table -->)", re.DOTALL)


def render_table(results: dict, kind: str, dataset: str | None = None, *arguments: str) -> list:
    """The Markdown lines of one table of a results file (see the module docstring)."""
    if kind == "rows":
        return rows_table(results, [dataset, *arguments] if dataset is not None else list(arguments))
    if arguments:
        raise ValueError(f"the {kind!r} table takes at most one argument, got {[dataset, *arguments]}.")
    if kind == "memory":
        if dataset not in (None, "phases"):
            raise ValueError(f"the memory table takes no argument or 'phases', got {dataset!r}.")
        return (phase_table if dataset == "phases" else memory_table)(results["records"]).split("\n")
    if kind == "cold":
        return cold_table(results).rstrip("\n").split("\n")
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
                     "categories DATASET, grounded DATASET, sweep, load throughput|tau|sizes, arrivals, memory [phases], cold, "
                     "rows.")


def refresh(path, check: bool = False) -> list:
    """Regenerate every marked table of the Markdown file `path` from its results file.

    Returns the specs of the tables whose text changed; with `check`, the file is left as it is (a non-empty
    answer then means the file is stale).
    """
    path = Path(path)
    text = path.read_text()
    changed = []

    def replace(match) -> str:
        text = match.group("spec")
        if text.startswith("headline"):
            first, *lines = text.split("\n")
            spec = ["headline", *lines[:1]]
            body = "\n".join(headline_table(path, first[len("headline"):], lines)) + "\n"
        else:
            spec = shlex.split(text)
            if spec[:1] == ["rows"]:
                body = "\n".join(rows_table(None, spec[1:], path)) + "\n"
                if body != match.group("body"):
                    changed.append(" ".join(spec[:3]))
                return match.group(1) + body + match.group(4)
            if len(spec) < 2:
                raise ValueError(f"{path}: a bench-table marker needs 'RESULTS_JSON KIND [ARGUMENTS]', got {spec}.")
            source = path.parent / spec[0]
            if not source.is_file():
                raise FileNotFoundError(f"{path}: no results file {source} (marker {' '.join(spec)}).")
            body = "\n".join(render_table(json.loads(source.read_text()), *spec[1:])) + "\n"
        if body != match.group("body"):
            changed.append(" ".join(spec[:4]))
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
