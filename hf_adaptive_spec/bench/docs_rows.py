"""The general table kinds of `bench-docs`: ``rows`` (records picked out of any results JSON) and ``headline``
(one row per named run: tau and the speedups, ranges over several runs). The grammar is in the docstring of
`hf_adaptive_spec.bench.docs`."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

__all__ = ["headline_table", "pick", "rows_table"]

_NONE = "–"
_AGGREGATES = ("first", "mean", "min", "max", "sum", "range", "list", "listmean")


def pick(data, path: str):
    """The value at the dotted key path `path` of `data` (list items by index); `.` alone is `data` itself."""
    for key in [] if path in ("", ".") else path.split("."):
        if isinstance(data, list):
            data = data[int(key)]
        elif isinstance(data, dict) and key in data:
            data = data[key]
        else:
            return None
    return data


def _records(data, path: str) -> list:
    found = pick(data, path)
    if isinstance(found, dict):
        return [dict(value, _key=key) if isinstance(value, dict) else {"_key": key, "_value": value}
                for key, value in found.items()]
    if not isinstance(found, list):
        raise ValueError(f"the key path {path!r} holds no list or mapping of records.")
    return found


def _equal(value, wanted: str) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(wanted) == value
        except ValueError:
            return False
    return str(value) == wanted


def _matches(record: dict, condition: str) -> bool:
    """`condition`: `key=v1,v2` terms joined by `&`; every term must hold."""
    for term in filter(None, condition.split("&")):
        key, _, wanted = term.partition("=")
        if not any(_equal(pick(record, key), value) for value in wanted.split(",")):
            return False
    return True


def _format(value, template: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return _NONE
    if isinstance(value, bool):
        return "yes" if value else "no"
    return template.format(value)


def format_range(values: list, template: str) -> str:
    """`lo-hi` of the known values in `template` (its suffix written once), or one value where they agree."""
    known = [value for value in values if value is not None]
    if not known:
        return _NONE
    low, high = _format(min(known), template), _format(max(known), template)
    if low == high:
        return low
    suffix = re.search(r"[^0-9]*$", high).group()
    return (low[:-len(suffix)] if suffix and low.endswith(suffix) else low) + "-" + high


def _aggregate(values: list, how: str, template: str) -> str:
    known = [value for value in values if value is not None]
    if how == "first":
        return _format(values[0] if values else None, template)
    if how == "range":
        return format_range(values, template)
    if how in ("list", "listmean"):
        listed = ", ".join(_format(value, template) for value in values)
        if how == "listmean" and known:
            listed += f" (mean {_format(sum(known) / len(known), template)})"
        return listed or _NONE
    if not known:
        return _NONE
    return _format({"mean": sum(known) / len(known), "min": min(known), "max": max(known),
                    "sum": sum(known)}[how], template)


def _column_values(group: list, expression: str) -> list:
    """The values of `FIELD[@WHERE]` or `FIELD[@WHERE]/FIELD[@WHERE]` over the group's records (a ratio pairs the
    records that each side's condition selects, in order)."""
    sides = []
    for side in expression.split("/"):
        field, _, condition = side.partition("@")
        sides.append([pick(record, field) for record in group if _matches(record, condition)])
    if len(sides) == 1:
        return sides[0]
    top, bottom = sides
    return [a / b if isinstance(a, (int, float)) and b else None for a, b in zip(top, bottom)]


def _column(spec: str) -> tuple:
    """`HEADER=EXPRESSION[|AGGREGATE][:FORMAT]` -> (header, expression, aggregate, template)."""
    header, _, rest = spec.partition("=")
    if not rest:
        raise ValueError(f"a rows column needs 'HEADER=FIELD[|AGGREGATE][:FORMAT]', got {spec!r}.")
    rest, _, fmt = rest.partition(":")
    expression, _, how = rest.partition("|")
    how = how or "first"
    if how not in _AGGREGATES:
        raise ValueError(f"unknown aggregate {how!r}: valid are {', '.join(_AGGREGATES)}.")
    template = fmt if "{" in fmt else "{:" + fmt + "}" if fmt else "{}"
    return header, expression, how, template


def rows_table(results, arguments: list) -> list:
    """Markdown lines: the ``rows`` kind (see `hf_adaptive_spec.bench.docs`)."""
    if not arguments:
        raise ValueError("a rows table needs a key path and columns.")
    records = _records(results, arguments[0])
    by, rule, columns = [], None, []
    for argument in arguments[1:]:
        if argument.startswith("where:"):
            records = [record for record in records if _matches(record, argument[6:])]
        elif argument.startswith("by:"):
            by = argument[3:].split(",")
        elif argument.startswith("rule:"):
            rule = argument[5:]
        else:
            columns.append(_column(argument))
    if not columns:
        raise ValueError("a rows table needs at least one column 'HEADER=FIELD'.")
    groups: dict = {}
    for index, record in enumerate(records):
        key = tuple(json.dumps(pick(record, field)) for field in by) if by else index
        groups.setdefault(key, []).append(record)
    lines = ["| " + " | ".join(header for header, *_ in columns) + " |",
             rule or "|" + "".join("---:|" if template != "{}" else "---|" for *_, template in columns)]
    for group in groups.values():
        lines.append("| " + " | ".join(_aggregate(_column_values(group, expression), how, template)
                                       for _, expression, how, template in columns) + " |")
    return lines


_FIGURES = {"tau": ("tau", "{:.2f}"), "speedup": ("speedup_vs_plain", "{:.2f}x"),
            "mode": ("speedup_vs_plain_mode", "{:.2f}x")}


def _run_figures(results: dict, scope: str, method: str) -> dict:
    """tau and the two speedups of `method` in one results file: `scope` is a data set of a bench run, `all`
    (every data set), or `levels` (every level of a load sweep)."""
    if scope == "levels":
        found = [r for r in results["records"] if r["method"] == method and not r.get("error")]
        return {name: [r.get(key) for r in found] for name, (key, _) in _FIGURES.items()}
    aggregates = results["aggregates"]
    group = aggregates["overall"] if scope == "all" else aggregates["datasets"].get(scope, {})
    summary = group.get(method)
    return {name: [summary.get(key)] if summary else [] for name, (key, _) in _FIGURES.items()}


def _machine(results: dict) -> str:
    environment = results.get("environment") or {}
    model = str(environment.get("cpu_model") or "unknown machine")
    model = "Intel Xeon" if "Xeon" in model else model
    threads = environment.get("threads")
    return f"{model}, {threads} cores" if threads else model


def headline_table(markdown: Path, headers: str, lines: list) -> list:
    """Markdown lines: the ``headline`` kind (see `hf_adaptive_spec.bench.docs`)."""
    table = ["| " + headers.strip() + " | tau | vs plain | vs plain mode | measured |",
             "|" + "---|" * len(headers.split("|")) + "---:|---:|---:|---|"]
    cache: dict = {}
    for line in filter(str.strip, lines):
        source, *cells = [part.strip() for part in line.split("|")]
        files, scope, method = shlex.split(source)
        runs = []
        for name in files.split(","):
            path = markdown.parent / name
            if not path.is_file():
                raise FileNotFoundError(f"{markdown}: no results file {path} (headline row {line!r}).")
            runs.append(cache.setdefault(path, json.loads(path.read_text())))

        def figures(name: str, which: str) -> str:
            values = [v for run in runs for v in _run_figures(run, scope, name)[which]]
            return format_range(values, _FIGURES[which][1])

        def fill(cell: str) -> str:
            out, rest = "", cell
            while "{" in rest:
                head, _, rest = rest.partition("{")
                field, _, rest = rest.partition("}")
                name, _, which = field.rpartition(".")  # a method name may hold dots
                out += head + figures(name, which)
            return out + rest

        dates = sorted({str((run.get("environment") or {}).get("started", ""))[:10] for run in runs})
        machines = list(dict.fromkeys(_machine(run) for run in runs))
        measured = f"{' and '.join(dates)}, {' / '.join(machines)}"
        table.append("| " + " | ".join([*(fill(cell) for cell in cells), figures(method, "tau"),
                                        figures(method, "speedup"), figures(method, "mode"), measured]) + " |")
    return table
