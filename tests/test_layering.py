"""Imports run one way: storage and featcal_kernels < featcal < tasks < flows < featcal_bench.

A module may import its own package and the layers below it, never one above: an upward import makes the lower
package unusable without the upper one and, sooner or later, a cycle. storage and featcal_kernels share the
bottom layer but may not import each other either: neither does today, and file I/O and the numeric kernels have
no reason to need one another. benchmarks/ and tests/ sit outside the rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Package → layer, bottom first.
LAYERS = {"storage": 0, "featcal_kernels": 0, "featcal": 1, "tasks": 2, "flows": 3, "featcal_bench": 4}


def imported_names(path: Path, root: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, absolute module name, names taken from it) of every import in the file, those inside functions and
    relative ones too; the names are empty for a plain `import a.b`."""
    parts = path.relative_to(root).with_suffix("").parts
    package = parts[:-1]  # the package a relative import starts from (an __init__'s is its own directory)
    found: list[tuple[int, str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = tuple(alias.name for alias in node.names)
            if node.level:  # `from ..x import y` in package a.b → a.x
                base = list(package[: len(package) - node.level + 1])
                found.append((node.lineno, ".".join(base + ([node.module] if node.module else [])), names))
            else:
                found.append((node.lineno, node.module or "", names))
    return found


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, those inside functions and relative ones too."""
    return [(line, module) for line, module, _ in imported_names(path, root)]


def upward_imports(root: Path = ROOT) -> list[str]:
    """One line per import that climbs a layer or crosses between the two bottom packages."""
    problems = []
    for package, layer in LAYERS.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, name in imported_modules(path, root):
                target = name.split(".")[0]
                if target in LAYERS and target != package and LAYERS[target] >= layer:
                    problems.append(f"{path.relative_to(root)}:{line} imports {name} "
                                    f"(layer {package} may not import layer {target})")
    return problems


def test_imports_run_one_way():
    problems = upward_imports()
    if problems:
        pytest.fail(f"{len(problems)} upward import(s):\n" + "\n".join(problems), pytrace=False)


def test_the_check_finds_upward_imports_wherever_they_are(tmp_path):
    """A top-level upward import, one inside a function, one under `if TYPE_CHECKING`, and a crossing between the
    bottom packages are all found; downward and same-package imports pass."""
    files = {
        "storage/__init__.py": "import featcal_kernels.gram\nfrom storage.atomic import digest\n",
        "storage/sub/__init__.py": "def f():\n    from featcal.adapters import Adapter\n",
        "tasks/merge.py": "import storage.atomic, torch\nfrom featcal import merging\n"
                          "if TYPE_CHECKING:\n    import flows.pipeline as p\n",
        "flows/cli.py": "from tasks import merge\nimport featcal_bench\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert upward_imports(tmp_path) == [
        "storage/__init__.py:1 imports featcal_kernels.gram (layer storage may not import layer featcal_kernels)",
        "storage/sub/__init__.py:2 imports featcal.adapters (layer storage may not import layer featcal)",
        "tasks/merge.py:4 imports flows.pipeline (layer tasks may not import layer flows)",
        "flows/cli.py:2 imports featcal_bench (layer flows may not import layer featcal_bench)",
    ]


def test_relative_imports_resolve_to_their_package(tmp_path):
    (tmp_path / "featcal" / "bench").mkdir(parents=True)
    (tmp_path / "featcal" / "bench" / "__init__.py").write_text("from . import build\nfrom .tasks import x\n")
    (tmp_path / "featcal" / "bench" / "run.py").write_text("from .. import merging\nfrom ..data import load\n")
    assert imported_modules(tmp_path / "featcal" / "bench" / "__init__.py", tmp_path) == [
        (1, "featcal.bench"), (2, "featcal.bench.tasks")]
    assert imported_modules(tmp_path / "featcal" / "bench" / "run.py", tmp_path) == [
        (1, "featcal"), (2, "featcal.data")]
