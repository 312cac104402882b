"""Code shape of the core packages and of serving/: no function or method longer than MAX_LINES (from its `def`
line to its last line, decorators excluded), so each hot path reads as a few named steps."""

import ast
from pathlib import Path

import pytest

import hf_adaptive_spec

MAX_LINES = 80
PACKAGE = Path(hf_adaptive_spec.__file__).parent
CORE = ("decoding", "adapters", "strategies", "drafters", "cost", "ops")
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
