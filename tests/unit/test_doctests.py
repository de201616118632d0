"""The ``>>>`` examples in the package's docstrings run: an example that stops being true fails here.

Modules are found from the source (a new example runs without being listed anywhere) and imported
only when their test runs, so collecting this file imports nothing of the package but its root.
"""

from __future__ import annotations

import doctest
import importlib
import os
from pathlib import Path

import pytest

import passerelle

PACKAGE = Path(passerelle.__file__).parent


def _prompts(source: str) -> int:
    return sum(1 for line in source.splitlines() if line.lstrip().startswith(">>>"))


def modules_with_examples() -> dict[str, int]:
    """Module name → how many ``>>>`` prompts its source holds."""
    found: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        prompts = _prompts(path.read_text(encoding="utf-8"))
        if prompts:
            parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = prompts
    return found


MODULES = modules_with_examples()


def test_the_examples_are_found():
    assert len(MODULES) >= 16
    assert {"passerelle.chunks", "passerelle.proxy.protocols", "passerelle.tenants.quota"} <= set(MODULES)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_examples_hold(name: str):
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder().find(module)
    # Every prompt in the file is one doctest sees: a ``>>>`` outside a docstring it reads (a
    # comment, a nested function's docstring) would otherwise never run, and never fail.
    assert sum(len(t.examples) for t in tests) == MODULES[name]
    report: list[str] = []
    runner = doctest.DocTestRunner(verbose=False)
    environ = dict(os.environ)
    for test in tests:
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
    assert dict(os.environ) == environ, "an example changed the environment of the process running the tests"
