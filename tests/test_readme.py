"""README.md as a newcomer reads it: every shell and Python block runs as written, and every figure in its tables
comes from the file its row links.

Blocks run in order in one scratch directory laid out like the repository's root (`configs/`, and `examples/tiny`
the session's tiny example, so `featcal example build examples/tiny` finds it built), with `featcal` on PATH and
the session's Prefect server, as a reader who copies them one after the other would. A block that cannot run here
(placeholder paths, a whole install) is marked by the line `<!-- illustrative: WHY -->` just above it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.llm_fixture import tiny_llama_run
from tests.prefect_helpers import cli_env

pytest_plugins = ("tests.prefect_server",)

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
RUNNABLE = {"bash": ["bash", "-e", "-o", "pipefail"], "python": [sys.executable]}
ILLUSTRATIVE = re.compile(r"^<!-- illustrative: \S.*-->$")
FENCE = re.compile(r"^```(\w*)\s*$")
# A figure's numbers: 61.4, 1.9e-06, 29 and 103 of 29–103, 1.47 of 1.47×; signs and units are left out.
NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")
LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(?:#[^)]*)?\)")


@dataclass(frozen=True)
class Block:
    line: int
    language: str
    code: str
    illustrative: bool


def blocks(text: str) -> list[Block]:
    """Every fenced block of a markdown text, with whether the line above marks it illustrative."""
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        found.append(Block(i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                           bool(ILLUSTRATIVE.match(above.strip()))))
        i = end + 1
    return found


def unmarked(found: list[Block]) -> list[str]:
    """Blocks the test can neither run nor skip: a language it does not run, without the illustrative mark."""
    return [f"line {b.line}: a ```{b.language or '(no language)'} block; make it bash or python, or mark it "
            "`<!-- illustrative: WHY -->`" for b in found if b.language not in RUNNABLE and not b.illustrative]


def failures(found: list[Block], workdir: Path, env: dict[str, str], timeout: float = 600) -> list[str]:
    """Run each runnable, unmarked block in order in `workdir`; one line per block that exits non-zero."""
    problems = []
    for b in found:
        if b.illustrative or b.language not in RUNNABLE:
            continue
        done = subprocess.run([*RUNNABLE[b.language], "-"], input=b.code, cwd=workdir, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
        if done.returncode != 0:
            problems.append(f"line {b.line}: ```{b.language} block exited {done.returncode}:\n{done.stdout[-3000:]}")
    return problems


def table_rows(text: str) -> list[tuple[int, dict[str, str], str]]:
    """(line, {header: cell}, whole row) of every markdown table row with a `figure` column."""
    rows, header = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(line) <= set("|-: "):
            rows.append((number, dict(zip(header, cells, strict=False)), line))
    return [r for r in rows if any("figure" in h for h in r[1])]


def unsupported_figures(text: str, root: Path) -> list[str]:
    """One line per number in a table's figure column that none of the files its row links contains."""
    problems = []
    for number, cells, line in table_rows(text):
        figure = next(v for k, v in cells.items() if "figure" in k)
        sources = [root / target for target in LINK.findall(line) if not re.match(r"^[a-z]+:", target)]
        held = {n for s in sources if s.is_file() for n in NUMBER.findall(s.read_text(encoding="utf-8"))}
        figure_text = re.sub(r"`[^`]*`", "", figure)  # a config key in code (`head_metric: 1`) is no figure
        missing = [n for n in NUMBER.findall(figure_text) if n not in held]
        if missing:
            names = ", ".join(str(s.relative_to(root)) for s in sources) or "no file"
            problems.append(f"README.md:{number}: {', '.join(missing)} not in {names}")
    return problems


@pytest.fixture(scope="module")
def workdir(tiny_example, tmp_path_factory) -> Path:
    """A scratch directory laid out as the README's commands expect the repository's root."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(REPO / "configs", root / "configs")
    (root / "examples").mkdir()
    (root / "examples" / "tiny").symlink_to(tiny_example, target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def reader_env(prefect_server, tmp_path_factory) -> dict[str, str]:
    """`featcal` on PATH as the installed command is (this checkout's code), next to the venv's other commands."""
    bin_dir = tmp_path_factory.mktemp("bin")
    shim = bin_dir / "featcal"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m featcal_bench.cli "$@"\n')
    shim.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return cli_env(prefect_server, PATH=path, PYTHONPATH=str(REPO))


def test_every_readme_block_runs_as_written_or_is_marked(workdir, reader_env):
    found = blocks(README.read_text(encoding="utf-8"))
    assert {b.language for b in found if not b.illustrative} == {"bash", "python"}
    problems = unmarked(found) + failures(found, workdir, reader_env)
    assert not problems, "README blocks that do not run as written:\n" + "\n".join(problems)
    assert (workdir / "runs" / "ex1" / "calibrated" / "config.json").is_file()


def test_the_mergekit_block_runs_as_written_on_a_tiny_llama(tmp_path, reader_env):
    """The README's MergeKit block, unchanged, at its own placeholder paths: a tiny Llama base and two experts there,
    `config.yaml` over them; MergeKit's DARE-TIES merge is then what FeatCal calibrates."""
    block = next(b for b in blocks(README.read_text(encoding="utf-8")) if "mergekit-yaml" in b.code)
    tiny_llama_run(tmp_path, base="path/to/base", experts=("path/to/expert1", "path/to/expert2"), config="config.yaml")
    assert failures([replace(block, illustrative=False)], tmp_path, reader_env) == []
    merged = load_file(tmp_path / "out" / "model.safetensors")
    base, expert = (load_file(tmp_path / "path" / "to" / d / "model.safetensors") for d in ("base", "expert1"))
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(merged[name], base[name]) and not torch.equal(merged[name], expert[name])
    run = tmp_path / "runs" / "mk"
    assert (run / "calibrated" / "config.json").is_file()
    assert torch.equal(load_file(run / "merged" / "model.safetensors")[name], merged[name])  # MergeKit's, as given


def test_a_broken_or_unmarked_block_is_reported(tmp_path):
    text = ("# Page\n\n```bash\ntrue\n```\n\n```bash\nls no-such-file\n```\n\n<!-- illustrative: a placeholder -->\n"
            "```bash\nfeatcal run path/to/config.yaml\n```\n\n```yaml\nbase: path/to/base\n```\n\n"
            "```python\nraise SystemExit(3)\n```\n")
    found = blocks(text)
    assert [(b.line, b.language, b.illustrative) for b in found] == [
        (3, "bash", False), (7, "bash", False), (12, "bash", True), (16, "yaml", False), (20, "python", False)]
    assert unmarked(found) == ["line 16: a ```yaml block; make it bash or python, or mark it "
                               "`<!-- illustrative: WHY -->`"]
    problems = failures(found, tmp_path, dict(os.environ))
    assert [p.split(":", 1)[0] for p in problems] == ["line 7", "line 20"]
    assert "exited 2" in problems[0] and "no-such-file" in problems[0] and "exited 3" in problems[1]


def test_every_figure_in_the_readme_is_in_the_file_it_cites():
    text = README.read_text(encoding="utf-8")
    assert len(table_rows(text)) >= 10  # the status table and the benchmarks table are both read
    problems = unsupported_figures(text, REPO)
    assert not problems, "README figures their files do not hold:\n" + "\n".join(problems)


def test_a_figure_its_file_does_not_hold_is_reported(tmp_path):
    (tmp_path / "r.md").write_text("| run | accuracy |\n|---|---:|\n| TA | 61.4 |\n| FeatCal | 67.7 |\n"
                                   "ratio 1.9e-06, 29–103 %\n")
    text = ("| what | figure | file |\n|---|---|---|\n"
            "| held | 61.4 → 67.7; 1.9e-06; 29–103 %; `head_metric: 1` | [r](r.md) |\n"
            "| stale | 61.4 → 67.8 | [r](r.md) |\n"
            "| rounded | 1.9e-6 | [r](r.md) |\n"
            "| uncited | 61.4 | none |\n\n"
            "| other table | its values |\n|---|---|\n| 12.3 | 4.5 |\n")
    assert unsupported_figures(text, tmp_path) == [
        "README.md:4: 67.8 not in r.md",
        "README.md:5: 1.9e-6 not in r.md",
        "README.md:6: 61.4 not in no file",
    ]


def test_the_shipped_example_config_plans_without_a_notice(workdir, capsys, fresh_console):
    """configs/example.yaml, the first config a reader plans, asks for nothing its model cannot take (no text cut)."""
    from featcal_bench.cli import main

    assert main(["plan", str(workdir / "configs" / "example.yaml")]) == 0
    out = capsys.readouterr().out
    assert "stages" in out and "notice" not in out and "warning" not in out, out
