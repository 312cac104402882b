"""Code shape of the core packages and of serving/: no function or method longer than MAX_LINES (from its `def`
line to its last line, decorators excluded), so each hot path reads as a few named steps; one builder of draft
trees (no `DraftTree` made outside `trees/`); the loop and the drafters call only what every strategy has."""

import ast
from pathlib import Path

import pytest

import hf_adaptive_spec

MAX_LINES = 80
PACKAGE = Path(hf_adaptive_spec.__file__).parent
CORE = ("decoding", "adapters", "strategies", "drafters", "cost", "ops", "trees")
LIMITED = CORE + ("serving",)  # the packages the line limit holds in


def _functions(node: ast.AST, prefix: str = ""):
    """`(qualified name, first line, length in lines)` of every function under `node`, nested ones included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + child.name, child.lineno, child.end_lineno - child.lineno + 1
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


@pytest.mark.parametrize("package", LIMITED)
def test_no_function_over_the_line_limit(package):
    files = sorted((PACKAGE / package).rglob("*.py"))
    assert files, f"no Python files under {PACKAGE / package}"
    too_long = [
        f"{name} ({path.relative_to(PACKAGE.parent)}:{line}): {length} lines"
        for path in files
        for name, line, length in _functions(ast.parse(path.read_text(), filename=str(path)))
        if length > MAX_LINES
    ]
    assert not too_long, f"functions over {MAX_LINES} lines:\n" + "\n".join(too_long)


def test_the_limit_is_measured_from_the_def_line():
    source = "class A:\n    @property\n    def f(self):\n        x = 1\n\n        return x\n"
    assert list(_functions(ast.parse(source))) == [("A.f", 3, 4)]


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _calls_of(tree: ast.AST, name: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if called == name:
                yield node.lineno


def test_draft_trees_are_made_in_the_trees_package_only():
    """Every `DraftTree` comes from `trees.build` (and the tree's own methods, the branches and the host backend
    inside `trees/`): a drafter, strategy or the loop that made one itself would be a second builder."""
    outside = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path, tree in _sources()
               if path.parent.name != "trees" for line in _calls_of(tree, "DraftTree")]
    assert not outside, "DraftTree made outside trees/: " + ", ".join(outside)
    assert any(True for _ in _calls_of(ast.parse("DraftTree(tokens=t)"), "DraftTree"))  # the check sees a call


def test_the_loop_and_drafters_call_only_what_every_strategy_has():
    """decoding/ and drafters/ read a strategy through the base class's interface only (no method that one
    strategy alone defines: such wiring belongs behind a strategy hook)."""
    from hf_adaptive_spec.strategies.base import Strategy

    allowed = {name for name in dir(Strategy) if not name.startswith("__")} | {"config"}
    used = []
    for folder in ("decoding", "drafters"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute))
                        and (getattr(node.value, "id", None) or getattr(node.value, "attr", None))
                        in ("strategy", "strategy_object")):
                    used.append((node.attr, f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"))
    assert used, "no strategy attribute read: the check found nothing to check"
    foreign = [f"{name} ({where})" for name, where in used if name not in allowed]
    assert not foreign, "strategy attributes beyond the base interface: " + ", ".join(foreign)
