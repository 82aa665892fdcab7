"""The house layout holds: no import cycles among modules, every module opens with its one-line job, data flows one
way (tasks know nothing of systems, systems nothing of tasks or the harness), the harness's rooms stay apart."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("harness", "systems", "tasks")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts}


def imports_of(name: str) -> set[str]:
    """The project modules `name` imports anywhere in its body (lazy imports count: a cycle is a cycle)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in MODULES and t != name}
    return out


GRAPH = {name: imports_of(name) for name in MODULES}


def test_no_import_cycles():
    """Tarjan's strongly connected components over explicit imports: every component is a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("harness")))
def test_every_harness_module_opens_with_its_job(name):
    doc = ast.get_docstring(ast.parse(MODULES[name].read_text()))
    assert doc and doc.splitlines()[0].strip(), f"{MODULES[name]}: no one-line docstring saying what it is for"
    assert len(doc.splitlines()[0]) <= 120


def test_data_flows_one_way():
    reaches = {n: {i.split(".")[0] for i in deps} for n, deps in GRAPH.items()}
    assert not [n for n in MODULES if n.startswith("tasks") and reaches[n] & {"systems", "harness"}]
    assert not [n for n in MODULES if n.startswith("systems") and reaches[n] & {"tasks", "harness"}]


def test_rooms_stay_apart():
    """Reporting, measuring and integrations never reach into the experiments; no experiment into another's helpers
    (an accuracy kind builds on the accuracy package, nothing else)."""
    for name, deps in GRAPH.items():
        room = name.split(".")[1] if name.count(".") >= 1 else ""
        if room in ("reporting", "measuring", "integrations", "running"):
            assert not [d for d in deps if d.startswith("harness.experiments")], name
        if name.startswith("harness.experiments."):
            kind = name.split(".")[2]
            foreign = [d for d in deps if d.startswith("harness.experiments.")
                       and d.split(".")[2] not in (kind, "accuracy")]
            assert not foreign, f"{name} imports another kind's helpers: {foreign}"


def test_files_stay_small():
    big = {n: len(p.read_text().splitlines()) for n, p in MODULES.items() if n.startswith("harness")}
    assert not {n: lines for n, lines in big.items() if lines > 400}
