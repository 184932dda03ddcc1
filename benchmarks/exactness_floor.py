"""How close single-expert calibration (average merge of one expert, α 1, λ → 0) comes to the expert on the tiny test
models, boundary by boundary, and where the rest comes from (issue 54 item 4; docs/design.md §2, exactness).

Rows: each decoder of the tests (Gemma2 also at its config's own init, 0.02, where the tests widen it to 0.1) at the
default ε = 1e-8 and at ε = 1e-14 (λ 1e-9 and 1e-15); the tiny T5 on a random target column; the tiny T5 on its own
greedy targets (one token repeated) at λ 1e-9 to 1e-4 with the anchor on the expert (ρ 1), with how many solves
reported directions left to rounding. Then Gemma2's block-1 o_proj at its default init solved again from the same
inputs, with float64 products, the Gram stage's fp32 ones, and fp32 ones whose expert side is the difference
D = Σ x_s(x_e − x_s)ᵀ; and the attention branch's size against the residual stream (Llama's o_proj output, Gemma2's
post-attention norm output).

    python -m benchmarks.exactness_floor [--out benchmarks/results/exactness_floor.md]
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import Gemma2Config, T5ForConditionalGeneration

from benchmarks.common import command_line, commit_of, cpu_line
from featcal.adapters import adapter_for
from featcal.modeling import task_model
from featcal_kernels import dual_gram
from flows.pipeline import run_pipeline
from storage.checkpoint import CanonicalCheckpoint
from storage.rundir import RunDir
from tests import test_decoders as decoders
from tests import test_decoders_gpt2_gemma as gpt2_gemma
from tests import test_t5 as t5
from tests.t5_fixture import t5_config
from tests.test_decoders_gpt2_gemma import _module_io

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def models_of(arch: str, init: float | None = None) -> Iterator[Callable[[str], torch.nn.Module]]:
    """tests.test_decoders' `_build` building `arch` (GPT-2 and Gemma2 from their test file; Gemma2 at `init`)."""
    saved_model, saved_case = decoders._model, gpt2_gemma.CASES.get("gemma2")
    if arch in gpt2_gemma.CASES:
        decoders._model = gpt2_gemma._model
    if init is not None:
        cls_name, make = gpt2_gemma.CASES["gemma2"]

        def at_init() -> Gemma2Config:
            config = make()
            config.initializer_range = init
            return config

        gpt2_gemma.CASES["gemma2"] = (cls_name, at_init)
    try:
        yield decoders._model
    finally:
        decoders._model = saved_model
        if saved_case is not None:
            gpt2_gemma.CASES["gemma2"] = saved_case


def unresolved_solves(run_dir: Path) -> int:
    run, count, layer = RunDir(run_dir), 0, 0
    while (record := run.record(f"solve/l{layer:02d}")) is not None:
        count += len(record["info"].get("unresolved", {}))
        layer += 1
    return count


def decoder_row(arch: str, init: float | None, eps: float, work: Path) -> str:
    lam = 1e-9 if eps >= 1e-8 else 1e-15
    with models_of(arch, init) as model:
        cfg = decoders._build(work, arch, experts=1, merge={"method": "average"},
                              featcal={"lambda": lam, "rho": 2.2, "alpha": 1.0, "eps": eps})
        start = time.perf_counter()
        run_pipeline(cfg, work / "run")
        wall = time.perf_counter() - start
        adapter = adapter_for(model(arch).config)
    expert = task_model(cfg.experts["task0"])
    calibrated = task_model(cfg.experts["task0"], CanonicalCheckpoint(work / "run" / "calibrated", adapter))
    batch = decoders._batch(decoders._rows(0))
    real = batch["attention_mask"].bool()
    with torch.inference_mode():
        got, want = calibrated(**batch).logits[real], expert(**batch).logits[real]
    boundaries = decoders._deviations(calibrated, expert, batch)
    name = arch if init is None else f"{arch} (init {init:g})"
    return (f"| {name} | {lam:g} | {eps:g} | {' / '.join(f'{d:.2e}' for d in boundaries)} | "
            f"{float((got - want).norm() / want.norm()):.2e} | {unresolved_solves(work / 'run')} | {wall:.1f} |")


def t5_row(targets: bool, lam: float, rho: float, work: Path) -> str:
    cfg = t5._build(work, experts=1, targets=(0,) if targets else (), merge={"method": "average"},
                    featcal={"lambda": lam, "rho": rho, "alpha": 1.0})
    start = time.perf_counter()
    run_pipeline(cfg, work / "run")
    wall = time.perf_counter() - start
    adapter = adapter_for(T5ForConditionalGeneration(t5_config()).config)
    expert = task_model(cfg.experts["task0"])
    calibrated = task_model(cfg.experts["task0"], CanonicalCheckpoint(work / "run" / "calibrated", adapter))
    rows = t5._rows(0, targets=True)
    boundaries = t5._deviations(calibrated, expert, t5._teacher_forced(cfg.experts["task0"], rows, rows["target"]))
    name = f"T5, {'column' if targets else 'greedy'} targets"
    return (f"| {name} | {lam:g} | {rho:g} | {' / '.join(f'{d:.2e}' for d in boundaries)} | "
            f"{unresolved_solves(work / 'run')} | {wall:.1f} |")


def gemma_o_proj_lines(work: Path) -> list[str]:
    """Block 1's o_proj of default-init Gemma2, calibrated at λ, ε → 0, solved again from its inputs."""
    with models_of("gemma2", 0.02):
        cfg = decoders._build(work, "gemma2", experts=1, merge={"method": "average"},
                              featcal={"lambda": 1e-15, "rho": 2.2, "alpha": 1.0, "eps": 1e-14})
        run_pipeline(cfg, work / "run")
        adapter = adapter_for(decoders._model("gemma2").config)
    expert = task_model(cfg.experts["task0"])
    calibrated = task_model(cfg.experts["task0"], CanonicalCheckpoint(work / "run" / "calibrated", adapter))
    upstream = task_model(cfg.experts["task0"])
    upstream.model.layers[0].load_state_dict(calibrated.model.layers[0].state_dict())
    batch = decoders._batch(decoders._rows(0))
    o_proj = "model.layers.1.self_attn.o_proj"
    x_s, x_e = _module_io(upstream, o_proj, batch), _module_io(expert, o_proj, batch)
    w_t = expert.model.layers[1].self_attn.o_proj.weight.detach().double()
    gram = x_e.double().T @ x_e.double()
    eigen = torch.linalg.eigvalsh(gram / torch.linalg.matrix_norm(gram))

    def error(c_ss: torch.Tensor, c_se: torch.Tensor) -> float:
        weight = torch.linalg.solve(c_ss.double(), c_se.double() @ w_t.T).T
        return float((x_e.double() @ (weight - w_t).T).norm() / (x_e.double() @ w_t.T).norm())

    fp32 = dual_gram(x_s, x_e)
    pipeline_w = calibrated.model.layers[1].self_attn.o_proj.weight.detach().double()
    pipeline = float((x_e.double() @ (pipeline_w - w_t).T).norm() / (x_e.double() @ w_t.T).norm())
    return [
        f"- x_s against x_e (block 1's o_proj input, calibrated block 0 against the expert's): "
        f"{float((x_s - x_e).norm() / x_e.norm()):.2e} relative",
        f"- its Gram's eigenvalues over its Frobenius norm: smallest {float(eigen[0]):.1e}, "
        f"{int((eigen < 1e-6).sum())} of {len(eigen)} below 1e-6",
        f"- o_proj output error on x_e: pipeline's solve {pipeline:.2e}; at λ = 0 from float64 products "
        f"{error(x_s.double().T @ x_s.double(), x_s.double().T @ x_e.double()):.2e}, from the Gram kernel's fp32 "
        f"products {error(fp32.c_ss, fp32.c_se):.2e}, from fp32 C_ss and fp32 D = Σ x_s(x_e − x_s)ᵀ "
        f"{error(fp32.c_ss, fp32.c_ss.double() + dual_gram(x_s, x_e - x_s).c_se.double()):.2e}",
    ]


def branch_lines() -> list[str]:
    """The attention branch's size over the residual stream it is added to, per block, on the test rows."""
    lines = []
    batch = decoders._batch(decoders._rows(0))
    for arch, init, module in (("llama", None, "self_attn.o_proj"), ("gemma2", 0.02, "post_attention_layernorm"),
                               ("gemma2", None, "post_attention_layernorm")):
        with models_of(arch, init) as model:
            torch.manual_seed(0)
            built = model(arch)
        ratios = []
        for layer in (0, 1):
            residual: list[torch.Tensor] = []
            hook = built.model.layers[layer].register_forward_pre_hook(
                lambda m, a, kw, into=residual: into.append(a[0] if a else kw["hidden_states"]), with_kwargs=True)
            branch = _module_io(built, f"model.layers.{layer}.{module}", batch, output=True)
            hook.remove()
            ratios.append(float(branch.norm() / residual[0][batch["attention_mask"].bool()].norm()))
        name = arch if init is None else f"{arch} (init {init:g})"
        lines.append(f"- {name}: {' / '.join(f'{r:.2f}' for r in ratios)} (blocks 0 / 1)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "exactness_floor.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = iter(Path(tmp) / f"w{i}" for i in range(100))
        decoder_rows = [decoder_row(arch, init, eps, next(work))
                        for arch, init in (("llama", None), ("qwen2", None), ("gpt2", None), ("gemma2", None),
                                           ("gemma2", 0.02))
                        for eps in (1e-8, 1e-14)]
        t5_rows = [t5_row(True, 1e-9, 2.2, next(work))] + [t5_row(False, lam, 1.0, next(work))
                                                          for lam in (1e-9, 1e-7, 1e-6, 1e-4)]
        o_proj = gemma_o_proj_lines(next(work))
    lines = [
        "# Single-expert exactness: how close, and where the rest comes from",
        "",
        f"- machine: {cpu_line()}, 1 torch thread",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; code: {commit_of(ROOT)}",
        f"- command: `{command_line()}`",
        "",
        "Average merge of one expert, α 1, anchor ρ 2.2 (elsewhere), tiny models of the tests (2 blocks, hidden 32, "
        "16 rows); relative distance to the expert over real tokens at each boundary (embeddings, block 0, the last "
        "after the final norm) and of the logits. unresolved: solves that reported directions left to rounding.",
        "",
        "| model | λ | ε | boundaries | logits | unresolved | run s |",
        "|---|---:|---:|---|---:|---:|---:|",
        *decoder_rows,
        "",
        "T5 teacher-forced on a random target column (encoder boundaries 0–2, decoder 3–5); greedy targets repeat one "
        "token. Anchor ρ 1 for the greedy rows, so λ pulls towards the expert itself and what is left is rounding.",
        "",
        "| model | λ | ρ | boundaries | unresolved | run s |",
        "|---|---:|---:|---|---:|---:|",
        *t5_rows,
        "",
        "Gemma2 at its config's init (0.02), λ 1e-15, ε 1e-14, block 1's o_proj:",
        "",
        *o_proj,
        "",
        "Attention branch over the residual stream it is added to (Llama: o_proj's output; Gemma2: the "
        "post-attention norm's):",
        "",
        *branch_lines(),
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
