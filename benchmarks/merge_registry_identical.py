"""Today's merges before and after the merge registry (issue 52 item 1): the same bytes on the tiny example's models.

The merge code as it was before the registry (featcal/merging.py at commit ce9c2da) is loaded from git into a
temporary module and run beside the current one on every floating tensor of the tiny example's BERT and CLIP base
and experts, for each method it had (task_arithmetic, average, ties with both ties_merge, dare_linear, dare_ties with
both), whole and by blocks of rows where the method allows them (the path a large embedding takes, forced here with
blocks of 256 entries). Every merged tensor is compared byte for byte.

    python -m benchmarks.merge_registry_identical --example /tmp/example \
        --out benchmarks/results/merge_registry_identical.md

(`--example`: a directory `featcal_bench.example.build_tiny_example` built, or builds there.)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import load_file

from benchmarks.common import ROOT, command_line, commit_of, cpu_line
from featcal import merging
from featcal.config import MergeConfig
from featcal_bench.example import build_tiny_example

BEFORE = "ce9c2da"  # the last commit before the registry
CONFIGS = [MergeConfig(method="task_arithmetic", scaling=0.3), MergeConfig(method="average"),
           MergeConfig(method="ties", scaling=0.7, ties_top_k=0.2, ties_merge="sum"),
           MergeConfig(method="ties", scaling=0.5, ties_top_k=0.37, ties_merge="mean"),
           MergeConfig(method="dare_linear", scaling=0.4, density=0.3, seed=7),
           MergeConfig(method="dare_ties", scaling=0.3, density=0.5, ties_merge="sum"),
           MergeConfig(method="dare_ties", scaling=0.6, density=0.7, ties_merge="mean", seed=3)]
BLOCK = 256  # entries per block of rows in the chunked comparison


def old_merging(directory: Path) -> ModuleType:
    """featcal/merging.py as it was at BEFORE, imported under another name."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:featcal/merging.py"], capture_output=True,
                            text=True, check=True).stdout
    path = directory / "merging_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("merging_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["merging_before"] = module
    spec.loader.exec_module(module)
    return module


def matching(expert: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The expert's copy of the base's tensor `name`: an expert with a head stores its body under a prefix
    (`bert.`, `vision_model.`)."""
    found = [k for k in expert if k == name or k.endswith("." + name)]
    if len(found) != 1:
        raise KeyError(f"tensor {name}: {len(found)} matches in the expert")
    return expert[found[0]]


def compare(old: ModuleType, arch: Path, cfg: MergeConfig) -> tuple[int, int, int]:
    """(tensors compared whole, of them by blocks of rows, tensors whose bytes differ) for one model and method."""
    base = load_file(arch / "base" / "model.safetensors")
    tasks = sorted(p.name for p in (arch / "experts").iterdir())
    experts = [load_file(arch / "experts" / t / "model.safetensors") for t in tasks]
    whole = chunked = differ = 0
    for name, theta0 in base.items():
        copies = [matching(e, name) for e in experts]
        if not theta0.is_floating_point():
            continue  # integer tensors are kept
        shape = tuple(theta0.shape)
        rows = shape[0] if shape else 1
        results = []
        for module in (old, merging):
            masks = module.drop_masks(cfg, tasks, name, shape) if cfg.method.startswith("dare") else None
            kept = None if masks is None else (lambda t, masks=masks, rows=rows: masks(t, 0, rows))
            results.append(module.merged_tensor(theta0, lambda copies=copies: iter(copies), cfg, kept))
            block = module.chunk_rows(shape, cfg, max_elements=BLOCK)
            if block is not None:
                results.append(module.merged_rows(shape, theta0.dtype, lambda a, b, theta0=theta0: theta0[a:b],
                                                  lambda a, b, copies=copies: (c[a:b] for c in copies), cfg, block,
                                                  masks))
        whole += 1
        chunked += int(len(results) == 4)
        first = results[0].numpy().tobytes()
        differ += int(any(r.numpy().tobytes() != first for r in results[1:]) or len(results) not in (2, 4))
    return whole, chunked, differ


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--example", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    example = build_tiny_example(args.example)
    torch.set_num_threads(1)
    lines = ["# Today's merges before and after the merge registry (`benchmarks/merge_registry_identical.py`)", "",
             f"Machine: {cpu_line()}. Date: {datetime.date.today()}. Command: `{command_line()}`. Code: "
             f"{commit_of(ROOT)}, against featcal/merging.py at {BEFORE}.", "",
             "Every floating body tensor of the tiny example's base and experts, merged by the code before the "
             f"registry and by the registry; `by rows`: tensors also merged by blocks of rows ({BLOCK} entries a "
             "block) by both, where the method allows it. `differ`: tensors whose merged bytes are not all the same "
             "(old whole, new whole, and, by rows, old and new).", "",
             "| model | method | settings | tensors | by rows | differ |", "|---|---|---|---|---|---|"]
    total = 0
    with tempfile.TemporaryDirectory() as tmp:
        old = old_merging(Path(tmp))
        for arch in ("bert", "clip"):
            for cfg in CONFIGS:
                whole, chunked, differ = compare(old, example / arch, cfg)
                total += differ
                settings = ", ".join(f"{k}={v}" for k, v in cfg.model_dump(exclude_unset=True).items()
                                     if k != "method")
                lines.append(f"| {arch} | {cfg.method} | {settings} | {whole} | {chunked} | {differ} |")
    lines += ["", f"Tensors whose bytes differ, over all rows: {total}."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if total:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
