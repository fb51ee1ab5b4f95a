"""House rule on size: no module under ``baft/`` over 500 lines, no class over 350.

A file or class past these sizes holds more than one responsibility; split it by what
its parts own rather than raising the limits. The failure lists every offender with its
size, largest first.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "baft"

MAX_FILE_LINES = 500
MAX_CLASS_LINES = 350


def _sizes() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``(files, classes)``: every module and class under ``baft/`` as (lines, name)."""
    files, classes = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(PACKAGE.parent).as_posix()
        files.append((len(text.splitlines()), rel))
        for node in ast.walk(ast.parse(text, rel)):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                classes.append((lines, f"{rel}:{node.lineno} class {node.name}"))
    return files, classes


def test_no_file_or_class_over_the_limit() -> None:
    files, classes = _sizes()
    assert files, f"no module found under {PACKAGE}"
    big_files = sorted((s for s in files if s[0] > MAX_FILE_LINES), reverse=True)
    big_classes = sorted((s for s in classes if s[0] > MAX_CLASS_LINES), reverse=True)
    offenders = [
        *(f"  {name}: {n} lines (file limit {MAX_FILE_LINES})" for n, name in big_files),
        *(f"  {name}: {n} lines (class limit {MAX_CLASS_LINES})" for n, name in big_classes),
    ]
    assert not offenders, "too large, split by responsibility:\n" + "\n".join(offenders)
