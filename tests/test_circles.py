"""No import circles among our modules, inside a package or across packages.

The layering test (tests/test_layering.py) keeps packages in order; within one package modules can still import each
other in a ring, often closed by an import inside a function. A ring means none of its modules can be read, tested
or moved without all the others, and a top-level one breaks at import time depending on which module comes first.
Every import counts: top-level, inside functions, under `if TYPE_CHECKING`. `from a import b` points at module
`a.b` where that is a module, else at `a` (the module whose name it reads).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_layering import LAYERS, ROOT, imported_names


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module → the modules of ours it imports."""
    files = {module_name(p, root): p for package in LAYERS for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for _, module, names in imported_names(path, root):
            submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in files]
            targets.update(submodules)
            if module in files and (not names or len(submodules) < len(names)):
                targets.add(module)
        graph[name] = targets - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted, by first name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_circles():
    found = circles(import_graph())
    if found:
        pytest.fail(f"{len(found)} import circle(s):\n" + "\n".join(" ↔ ".join(c) for c in found), pytrace=False)


def test_the_check_finds_a_planted_circle(tmp_path):
    """A ring of three closed by an import inside a function, a pair through `from package import module`, and a
    pair through a name read from a package's __init__ are found; a chain and a self-import are not."""
    files = {
        "featcal_bench/__init__.py": "",
        "featcal_bench/a.py": "from featcal_bench import b\n",
        "featcal_bench/b.py": "import featcal_bench.c\n",
        "featcal_bench/c.py": "def f():\n    from featcal_bench.a import run\n",
        "flows/__init__.py": "from flows.cli import main\n",
        "flows/cli.py": "from flows import VERSION\n",
        "tasks/__init__.py": "",
        "tasks/x.py": "from tasks import y\n",
        "tasks/y.py": "from . import x\n",
        "featcal/__init__.py": "",
        "featcal/p.py": "from featcal import q\nimport featcal.p\n",
        "featcal/q.py": "import storage.atomic\n",
        "storage/atomic.py": "import os\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert circles(import_graph(tmp_path)) == [
        ["featcal_bench.a", "featcal_bench.b", "featcal_bench.c"],
        ["flows", "flows.cli"],
        ["tasks.x", "tasks.y"],
    ]
