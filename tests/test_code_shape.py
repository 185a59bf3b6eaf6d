"""The shape issue 33 set for the package, kept: no module over 450 lines
but the flag declarations, and no function outside a Typer command's
signature with more than 8 parameters (``self``/``cls`` not counted)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bulkinfer"
MAX_LINES = 450
LONG_ALLOWED = {"cli/options.py"}  # every flag of every command, declared once
MAX_PARAMETERS = 8


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_450_lines_but_the_flag_declarations() -> None:
    long = {
        str(path.relative_to(PACKAGE)): lines
        for path in _modules()
        if (lines := path.read_text().count("\n")) > MAX_LINES
    }
    assert set(long) <= LONG_ALLOWED, long


def _is_command(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(
        isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "command"
        for d in node.decorator_list
    )


def _parameters(args: ast.arguments) -> int:
    names = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    count = len(names) + (args.vararg is not None) + (args.kwarg is not None)
    return count - (bool(names) and names[0].arg in ("self", "cls"))


def test_no_function_but_a_typer_command_takes_more_than_8_parameters() -> None:
    wide = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({_parameters(node.args)})"
        for path in _modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and not _is_command(node)
        and _parameters(node.args) > MAX_PARAMETERS
    ]
    assert wide == []
