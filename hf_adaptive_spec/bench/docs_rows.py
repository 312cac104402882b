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
_AGGREGATES = ("first", "mean", "min", "max", "sum", "pooled", "range", "list", "listmean")
_NUMERIC = ("first", "mean", "min", "max", "sum", "pooled")


def pick(data, path: str):
    """The value at the dotted key path `path` of `data` (list items by index); `.` alone is `data` itself."""
    for key in [] if path in ("", ".") else path.split("."):
        if isinstance(data, list):
            try:
                data = data[int(key)]
            except (ValueError, IndexError):
                return None
        elif isinstance(data, dict) and key in data:
            data = data[key]
        else:
            return None
    return data


def _records(data, path: str) -> list:
    """The records at `path`: a list's items, a mapping's entries (key as ``_key``), or, for a path in brackets
    (``[environment]``, ``[.]``), the one mapping it names."""
    if path.startswith("[") and path.endswith("]"):
        found = pick(data, path[1:-1])
        if not isinstance(found, dict):
            raise ValueError(f"the key path {path!r} holds no mapping to take as one record.")
        return [found]
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


def _reduce(values: list, how: str):
    """The one number a numeric aggregate makes of the group's values (``pooled`` has made it already)."""
    known = [value for value in values if value is not None]
    if how in ("first", "pooled"):
        return values[0] if values else None
    if not known:
        return None
    if how in ("min", "max"):  # strings too: the earliest and latest ISO dates
        return min(known) if how == "min" else max(known)
    return sum(known) / len(known) if how == "mean" else sum(known)


def _aggregate(values: list, how: str, template: str) -> str:
    if how == "range":
        return format_range(values, template)
    if how in ("list", "listmean"):
        known = [value for value in values if value is not None]
        listed = ", ".join(_format(value, template) for value in values)
        if how == "listmean" and known:
            listed += f" (mean {_format(sum(known) / len(known), template)})"
        return listed or _NONE
    if how == "first":
        return _format(values[0] if values else None, template)
    return _format(_reduce(values, how), template)


def _column_values(group: list, expression: str, pooled: bool = False) -> list:
    """The values of `FIELD[@WHERE]` or `FIELD[@WHERE]/FIELD[@WHERE]` over the group's records (a ratio pairs the
    records that each side's condition selects, in order). `pooled`: the ratio's one value, the sum of the first
    side's numbers over the sum of the second side's."""
    sides = []
    for side in expression.split("/"):
        field, _, condition = side.partition("@")
        sides.append([pick(record, field) for record in group if _matches(record, condition)])
    if len(sides) == 1:
        if pooled:
            raise ValueError(f"the pooled aggregate takes a ratio 'A/B', got {expression!r}.")
        return sides[0]
    top, bottom = sides
    if pooled:
        above, below = (sum(value for value in side if _number(value)) for side in sides)
        return [above / below if below and any(map(_number, top)) else None]
    return [a / b if _number(a) and _number(b) and b else None for a, b in zip(top, bottom)]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _column(spec: str) -> tuple:
    """`HEADER=EXPRESSION[|AGGREGATE][~CONDITION][:FORMAT]` -> (header, expression, aggregate, relative,
    template)."""
    header, _, rest = spec.partition("=")
    if not rest:
        raise ValueError(f"a rows column needs 'HEADER=FIELD[|AGGREGATE][:FORMAT]', got {spec!r}.")
    rest, _, fmt = rest.partition(":")
    rest, _, relative = rest.partition("~")
    expression, _, how = rest.partition("|")
    how = how or "first"
    if how not in _AGGREGATES:
        raise ValueError(f"unknown aggregate {how!r}: valid are {', '.join(_AGGREGATES)}.")
    if relative and how not in _NUMERIC:
        raise ValueError(f"a column relative to a row ('~{relative}') takes one of {', '.join(_NUMERIC)}, "
                         f"not {how!r}.")
    template = fmt if "{" in fmt else "{:" + fmt + "}" if fmt else "{}"
    return header, expression, how, relative, template


def _labelled(record, label: str) -> dict:
    record = dict(record) if isinstance(record, dict) else {"_value": record}
    record["_label"], record["_labels"] = label, [part.strip() for part in label.split("|")]
    return record


def _from_files(markdown: Path, path: str, terms: list) -> list:
    """The records of every ``from:FILE[#KEYPATH][=LABEL]`` term, each with its file's label."""
    records, cache = [], {}
    for term in terms:
        source, _, label = term.partition("=")
        name, _, keypath = source.partition("#")
        file = markdown.parent / name
        if not file.is_file():
            raise FileNotFoundError(f"{markdown}: no results file {file} (rows term {term!r}).")
        if file not in cache:
            cache[file] = json.loads(file.read_text())
        records += [_labelled(record, label or name) for record in _records(cache[file], keypath or path)]
    return records


def rows_table(results, arguments: list, markdown: Path | None = None) -> list:
    """Markdown lines: the ``rows`` kind (see `hf_adaptive_spec.bench.docs`). `results` None: the records come
    from the ``from:`` terms, files relative to the Markdown file `markdown`."""
    if not arguments:
        raise ValueError("a rows table needs a key path and columns.")
    sources = [argument[5:] for argument in arguments[1:] if argument.startswith("from:")]
    if results is None:
        if not sources:
            raise ValueError("a rows table without a results file before it needs 'from:FILE[=LABEL]' terms.")
        records = _from_files(Path(markdown or "."), arguments[0], sources)
    elif sources:
        raise ValueError("a rows table reads the results file before it or its 'from:' files, not both.")
    else:
        records = _records(results, arguments[0])
    by, rule, columns = [], None, []
    for argument in arguments[1:]:
        if argument.startswith("from:"):
            continue
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

    def number(group: list, expression: str, how: str):
        return _reduce(_column_values(group, expression, how == "pooled"), how)

    def cell(group: list, expression: str, how: str, relative: str, template: str) -> str:
        if not relative:
            return _aggregate(_column_values(group, expression, how == "pooled"), how, template)
        base = next((other for other in groups.values() if any(_matches(r, relative) for r in other)), None)
        value, below = number(group, expression, how), number(base, expression, how) if base else None
        return _format(value / below if _number(value) and _number(below) and below else None, template)

    lines = ["| " + " | ".join(header for header, *_ in columns) + " |",
             rule or "|" + "".join("---:|" if template != "{}" else "---|" for *_, template in columns)]
    for group in groups.values():
        lines.append("| " + " | ".join(cell(group, *column[1:]) for column in columns) + " |")
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
