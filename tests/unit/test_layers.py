"""The package's layering, checked from the source: lower layers never import higher ones, and no
two modules import each other, directly or round a circle (imports under TYPE_CHECKING and inside
functions count too).

    errors, paths, chunks, endpoints, procfs, backoff  <  config  <  upstream, observe  <  runtimes, tenants
        <  scheduling  <  proxy  <  batches  <  server  <  testing  <  cli  <  __main__

``bench`` is a client of a gateway, not a part of it: it imports only itself and the base (the
base modules import no other part of passerelle, so that holds all the way down; ``chunks`` is
there so that the relay and the benchmark share one definition of a content chunk; ``endpoints``
so that the configuration, the route table, the protocols and the catalogue share one list of
the inference endpoints).
"""

from __future__ import annotations

import ast
from pathlib import Path

import passerelle

ROOT = Path(passerelle.__file__).parent

LAYER = {
    "errors": 0, "paths": 0, "chunks": 0, "endpoints": 0, "procfs": 0, "backoff": 0, "__init__": 0, "config": 0.5,
    "upstream": 1, "observe": 1,
    "runtimes": 2, "tenants": 2,
    "scheduling": 3,
    "proxy": 4,
    "batches": 4.5,
    "server": 5,
    "testing": 5.5, "cli": 6, "__main__": 7,
}


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"] if rel.name == "__init__" else list(rel.parts)
        out[".".join(["passerelle", *parts])] = path
    return out


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t != "passerelle":
                found.add(t)
    return found


def group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, name, set(mods)) for name, path in mods.items()}


def test_every_module_has_a_layer():
    assert {group(m) for m in modules()} - {"bench"} <= set(LAYER)


def test_lower_layers_never_import_higher_ones():
    wrong = []
    for mod, deps in graph().items():
        g = group(mod)
        for dep in deps:
            d = group(dep)
            if g == d:
                continue
            if g == "bench":  # a client of the gateway: itself and the base only
                allowed = LAYER.get(d, 99) == 0
            elif d == "bench":  # only the command line starts a benchmark
                allowed = g == "cli"
            else:
                allowed = LAYER[d] < LAYER[g]
            if not allowed:
                wrong.append(f"{mod} imports {dep}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circles():
    g = graph()
    state: dict[str, int] = {}
    circles: list[str] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(g.get(node, ())):
            if state.get(dep) == 1:
                circles.append(" -> ".join([*trail[trail.index(dep):], dep]))
            elif dep not in state:
                visit(dep, [*trail, dep])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert not circles, "\n".join(circles)
