"""docs/usage.md's layout table against the package on disk, and the results files docs/benchmarks.md renders.

The layout table has one row per folder of `hf_adaptive_spec/` (its first cell `` `decoding/` ``), naming each
module of that folder by its stem in backticks (`` `loop` ``), and rows whose first cell names top-level modules
by file name (`` `clock.py` ``). In a folder's row every lowercase name in backticks is one of its modules and a
name ending in ``/`` one of its subfolders; other code (`SpecStats`, `prepare()`, `--memory`) is written so that it
cannot be read as one.
"""

import json
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_adaptive_spec"
SKIPPED = {"__init__.py", "__main__.py"}
MODULE = re.compile(r"[a-z_][a-z0-9_]*")


def _layout_rows() -> list:
    """(first cell, description) of every row of the table under "## Layout" in docs/usage.md."""
    text = (ROOT / "docs" / "usage.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) == 2 and cells[0] != "folder" and not set(cells[0]) <= set("-: "):
            rows.append((cells[0], cells[1]))
    assert rows, "docs/usage.md has no layout table under '## Layout'."
    return rows


def _package_modules() -> set:
    """Every module file of the package, relative to it (`decoding/loop.py`), but `__init__` / `__main__` and the
    shipped checkpoints' folder."""
    return {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
            if path.name not in SKIPPED and "__pycache__" not in path.parts
            and path.relative_to(PACKAGE).parts[0] != "checkpoints"}


def _table_entries() -> tuple:
    """(the module files the table names, the entries that name nothing on disk)."""
    named, missing = set(), []
    for first, description in _layout_rows():
        for entry in re.findall(r"`([^`]+)`", first):
            path = PACKAGE / entry
            if entry.endswith("/"):
                if not path.is_dir():
                    missing.append(entry)
                    continue
                for word in re.findall(r"`([^`]+)`", description):
                    if word.endswith("/"):
                        if not (path / word).is_dir():
                            missing.append(entry + word)
                    elif MODULE.fullmatch(word):
                        if (path / f"{word}.py").is_file():
                            named.add(entry + word + ".py")
                        else:
                            missing.append(f"{entry}{word}.py")
            elif path.is_file() or path.is_dir():
                named.add(entry)
            else:
                missing.append(entry)
    return named, missing


def test_every_module_of_the_package_has_its_place_in_the_layout_table():
    named, _ = _table_entries()
    absent = sorted(_package_modules() - named)
    assert not absent, f"docs/usage.md's layout table does not name {absent} (add each to its folder's row)."


def test_every_entry_of_the_layout_table_exists():
    _, missing = _table_entries()
    assert not missing, f"docs/usage.md's layout table names what is not in hf_adaptive_spec/: {missing}."


def _cited_results() -> set:
    """The results files that docs/benchmarks.md's bench-table markers read, relative to docs/."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    files = set()
    for spec in re.findall(r"<!-- bench-table: (.*?)\s+-->", text, re.DOTALL):
        words = shlex.split(spec)
        if words[0] == "headline":
            continue
        if words[0] != "rows":
            files.add(words[0])
        files |= {word[5:].partition("=")[0].partition("#")[0] for word in words if word.startswith("from:")}
    return files


def _provenance(results: dict) -> tuple:
    """(command, git commit) a results file records: at its top or in its settings."""
    for place in (results, results.get("settings") or {}):
        environment = place.get("environment") or {}
        if place.get("command") or environment.get("git_commit"):
            return place.get("command"), environment.get("git_commit")
    return None, None


def test_every_results_file_the_benchmarks_page_renders_records_a_command_and_a_clean_commit():
    unclean = {}
    for name in sorted(_cited_results()):
        command, commit = _provenance(json.loads((ROOT / "docs" / name).read_text()))
        if not command or not commit or commit.endswith("+dirty"):
            unclean[name] = (command, commit)
    assert not unclean, f"docs/benchmarks.md renders results without a command or from a dirty tree: {unclean}."
