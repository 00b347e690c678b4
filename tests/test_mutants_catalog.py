"""The curated mutants of `make mutants` (tools/mutants_catalog.py) still apply to this tree:
each edit's text occurs exactly once in its file and changes it, names are unique, and every
named test file (and test, for a file::test id) exists -- so a refactor that moves the code
fails here, in `make test`, instead of leaving a mutant that tests nothing."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from mutants_catalog import MUTANTS  # noqa: E402


def test_names_are_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("m", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_applies_and_names_existing_tests(m):
    for path, old, new in m.edits:
        text = (ROOT / path).read_text()
        assert text.count(old) == 1 and old != new, (path, old)
        if path.endswith(".py"):
            ast.parse(text.replace(old, new))  # a mutant must be a bug, not a syntax error
    assert m.tests
    for t in m.tests:
        file, _, test = t.partition("::")
        assert (ROOT / file).is_file(), t
        if test:
            names = {n.name for n in ast.walk(ast.parse((ROOT / file).read_text())) if isinstance(n, ast.FunctionDef)}
            assert test.split("[")[0] in names, t
