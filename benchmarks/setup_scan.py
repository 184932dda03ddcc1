"""What preflight's checkpoint scan (featcal/setup_checks.py: NaN/inf, task-vector norms and signatures) costs
against only reading the same tensors, side by side in one invocation.

    python -m benchmarks.setup_scan --out benchmarks/results/setup_scan.md

Synthetic float32 checkpoints (a base and `--experts` experts of BERT-base-like shapes: a 30522 × 768 embedding
read by row blocks, and 6 blocks of 768 × 3072 and 768 × 768 matrices), written to a temporary directory and read
from the page cache, so the figures are the scan's compute on top of the copy out of the cache; a disk read adds
the same bytes to both rows. Median of `--repeats`, the two passes interleaved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from featcal.setup_checks import row_blocks, scan_checkpoints
from flows.pipeline import machine
from storage.checkpoint import CanonicalCheckpoint


class _Names:
    """What CanonicalCheckpoint needs of an adapter: names as stored, one probe tensor."""
    file_prefixes, file_renames, probe_key = ("",), (), "embeddings.weight"


def _shapes() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"embeddings.weight": (30522, 768), "classifier.weight": (3, 768)}
    for layer in range(6):
        for name, shape in (("q", (768, 768)), ("k", (768, 768)), ("v", (768, 768)), ("o", (768, 768)),
                            ("up", (3072, 768)), ("down", (768, 3072)), ("norm", (768,))):
            shapes[f"layer.{layer}.{name}.weight"] = shape
    return shapes


def _write(root: Path, experts: int) -> dict[str, CanonicalCheckpoint]:
    g = torch.Generator().manual_seed(0)
    base = {n: 0.02 * torch.randn(s, generator=g) for n, s in _shapes().items()}
    out = {}
    for owner, scale in [("base", 0.0), *((f"experts.t{i}", 1e-3) for i in range(experts))]:
        (root / owner).mkdir()
        save_file({n: t + scale * torch.randn(t.shape, generator=g) for n, t in base.items()},
                  root / owner / "model.safetensors")
        out[owner] = CanonicalCheckpoint(root / owner, _Names())
    return out


def _read_only(ckpts: dict[str, CanonicalCheckpoint]) -> None:
    for ckpt in ckpts.values():
        for name in ckpt.names():
            for rows in row_blocks(ckpt, name):
                ckpt.get(name, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = _write(Path(tmp), args.experts)
        base, experts = ckpts.pop("base"), ckpts
        mib = sum(p.stat().st_size for p in Path(tmp).rglob("*.safetensors")) / 2**20
        times: dict[str, list[float]] = {"read only": [], "scan": []}
        for _ in range(args.repeats):
            start = time.perf_counter()
            _read_only({"base": base, **experts})
            times["read only"].append(time.perf_counter() - start)
            start = time.perf_counter()
            scan_checkpoints(base, experts, lambda n: n.startswith("classifier."))
            times["scan"].append(time.perf_counter() - start)
    read, scan = (statistics.median(times[k]) for k in ("read only", "scan"))
    lines = [
        "# Preflight's checkpoint scan against reading the same tensors",
        "",
        f"Machine: {machine()}; torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f} "
        f"(shared host: compare the rows, not the absolute figures). A base and {args.experts} experts, "
        f"float32, {mib:.0f} MiB in all, from the page cache; median of {args.repeats}, interleaved.",
        "",
        "| pass | seconds | MiB/s | × read only |",
        "|---|---:|---:|---:|",
        f"| read only (every tensor, by the same row blocks) | {read:.2f} | {mib / read:.0f} | 1.00 |",
        f"| scan (finite check and per-tensor ‖θ_t − θ0‖², ‖θ0‖² in float64) | {scan:.2f} | {mib / scan:.0f} | "
        f"{scan / read:.2f} |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
