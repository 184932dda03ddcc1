"""`featcal plan`: what a run will do and roughly what it needs, without computing anything."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

from featcal.adapters import Adapter
from featcal.calibration_methods import calibration_method
from featcal.config import RunConfig
from featcal.devices import activation_dtype, bf16_warning, resolve_device
from featcal.hub import local_dir
from featcal.modeling import Skeleton, calibrated_modules, is_norm, linear_dims
from featcal.statistics import expert_side_form, row_form_pays
from featcal_kernels.bf16 import cpu_has_native_bf16
from flows.pipeline import stage_count
from storage.checkpoint import CanonicalCheckpoint
from storage.lora import config_directory
from tasks.preflight import hub_inputs, preflight
from tasks.resident import resident_bytes, resident_choice, tokens_per_example

GIB = 1024**3


def plan(cfg: RunConfig) -> dict[str, Any]:
    hub = hub_inputs(cfg)  # fetched (or found in the cache) and pinned; preflight then finds them in the cache
    adapter, notices, degenerate = preflight(cfg, quiet=True)  # its warning, notices and set-ups are lines of the plan
    skeleton = Skeleton.from_checkpoint(config_directory(local_dir(cfg.experts[cfg.tasks[0]]), local_dir(cfg.base)))
    size = _sizes(cfg, adapter, skeleton)
    device = resolve_device(cfg.runtime.device)
    resident, why = resident_choice(cfg, adapter)
    return {
        "architecture": adapter.architecture,
        "blocks": adapter.num_blocks(),
        "modules_per_block": list(size["modules"]),
        "tasks": {t: {"expert": cfg.experts[t], "examples": cfg.calibration.examples_per_task,
                      "foreign_examples": cfg.foreign_examples} for t in cfg.tasks},
        "tokens_per_example_max": tokens_per_example(cfg, adapter),
        "head_side": adapter.head_side_path() if cfg.featcal.calibrate_head_side else None,
        "stages": stage_count(len(cfg.tasks), adapter.num_blocks(), cfg.runtime.solve_groups,
                              cfg.evaluation.enabled, cfg.featcal.calibrate_head_side),
        "estimated_disk_gib": round(size["disk"] / GIB, 3),
        "estimated_peak_ram_gib": round(size["peak_ram"] / GIB + 1.0, 3),
        "keeps_freed_memory": cfg.runtime.keep_freed_memory,
        "resident": resident,
        "resident_reason": why,
        "device": str(device),
        "precision": cfg.runtime.precision,
        "estimated_peak_device_gib": None if device.type == "cpu" else round(size["on_device"] / GIB, 3),
        "warning": bf16_warning(device, cfg.runtime.precision, cpu_has_native_bf16()),
        "notices": notices,
        "hub_inputs": {r.field: r.pinned for r in hub},
        "hub_cache_gib": round(sum(r.size for r in hub) / GIB, 3),
        "hub_download_gib": round(sum(r.downloaded for r in hub) / GIB, 3),
        "setup_warnings": degenerate,
    }


def _statistics_bytes(cfg: RunConfig, modules: dict[str, Any], rows: int) -> int:
    """One task's float64 statistics of one block, at most (modules that read the same input share theirs): C_ss per
    module, and for FeatCal the expert side as the Gram stage keeps it, C_se or the product P_t. A module whose input
    width no other module of the block has reads its input alone and keeps its rows where the Gram stage finds that
    pays: `rows` rows of x_s, its target and weight (float32 at most). Where widths repeat (q/k/v, gate/up share one
    input, whose rows they would share), the Gram form is assumed: the larger."""
    statistics_plan = calibration_method(cfg.featcal, foreign_weights=cfg.calibration.shared_inputs.weights).statistics
    keeps_expert = statistics_plan.expert_side
    takes_rows = statistics_plan.keeps_rows(cfg.runtime.row_statistics)
    linear = [linear_dims(m) for m in modules.values() if not is_norm(m)]
    linear_in = [d_in for d_in, _ in linear]

    def module_stats(d_in: int, d_out: int) -> int:
        if takes_rows and linear_in.count(d_in) == 1 and row_form_pays(rows, len(cfg.tasks), d_in, [d_out]):
            return 4 * rows * (d_in + d_out + 1)
        expert = 0 if not keeps_expert else (d_in * d_out if expert_side_form(rows, d_in, d_out, 1) == "product"
                                             else d_in * d_in)
        return 8 * (d_in * d_in + expert)

    return sum(module_stats(d_in, d_out) for d_in, d_out in linear)


def _sizes(cfg: RunConfig, adapter: Adapter, skeleton: Skeleton) -> dict[str, Any]:
    """The block's calibrated modules, and the run's disk, peak RAM and peak device memory estimates in bytes."""
    tokens, hidden = tokens_per_example(cfg, adapter), adapter.text_or_vision_config().hidden_size
    modules = calibrated_modules(skeleton.block_template(0))
    linear_in = [linear_dims(m)[0] for m in modules.values() if not is_norm(m)]
    base = CanonicalCheckpoint(local_dir(cfg.base), adapter)
    # On disk, as the checkpoint stores them (a bf16 checkpoint's merged, calibrated and solved blocks are bf16 too).
    stored = {name: math.prod(base.shape(name)) * base.dtype(name).itemsize for name in base.names()}
    block_disk = sum(v for name, v in stored.items() if name.startswith(adapter.block_prefix(0)))
    # In memory, as the stages hold them: float32 (the skeleton's modules).
    block_bytes = sum(p.numel() * 4 for p in skeleton.block_template(0).parameters())
    embeddings = adapter.embedding_modules()
    embed_bytes = sum(p.numel() * 4 for m in embeddings for p in skeleton.body.get_submodule(m).parameters())
    embed_stored = sum(v for name, v in stored.items() if any(name.startswith(f"{m}.") for m in embeddings))
    # a task's stored examples: its own and, with shared inputs, the foreign ones its stages read as well
    n, bs, T = cfg.calibration.examples_per_task + cfg.foreign_examples, cfg.calibration.batch_size, len(cfg.tasks)
    act = activation_dtype(cfg.runtime.precision).itemsize  # bytes of one stored activation / forward value
    boundary = n * tokens * hidden * act  # one side of one boundary
    # foreign rows keep sums of their own beside the own rows'
    stats = _statistics_bytes(cfg, modules, n * tokens) * (2 if cfg.foreign_examples else 1)
    chunk = bs * tokens * max([hidden, *linear_in]) * act * (2 + len(modules))
    # The prepare stage loads one side's embedding at a time: its float32 parameters and, while they fill, the stored
    # tensors (an LLM's embedding is the largest thing a stage holds).
    prepare_ram = embed_bytes + embed_stored
    blocks_ram = 3 * block_bytes + stats + 2 * chunk
    # With runtime.keep_freed_memory the heap still holds what the prepare stage freed when the blocks need theirs
    # (Llama-3.2-3B shape, bf16: 4.90 GiB measured where the larger of the two gave 4.14).
    peak_ram = blocks_ram + prepare_ram if cfg.runtime.keep_freed_memory else max(blocks_ram, prepare_ram)
    if resident_choice(cfg, adapter)[0]:  # the boundaries kept in memory, and a layer's merged and calibrated blocks
        peak_ram += resident_bytes(cfg, adapter) + 2 * block_bytes
    disk = (2 * sum(stored.values()) + (0 if cfg.runtime.activation_store else 2 * 2 * T * boundary) + T * stats
            + adapter.num_blocks() * block_disk)
    # On a GPU: two blocks at the run's precision, one task's float64 Gram sums, two chunks; the solves move to the
    # CPU when the device lacks room for theirs (featcal/devices.py).
    on_device = 2 * block_bytes * act // 4 + stats + 2 * chunk
    return {"modules": modules, "disk": disk, "peak_ram": peak_ram, "on_device": on_device}


class NotEnoughDisk(RuntimeError):
    """Less free space under the run directory than the plan says the run still needs."""


def check_free_space(p: dict[str, Any], run_dir: Path) -> None:
    """Refuse to start when the run directory's file system has less room than the plan's estimate, less what
    the run directory already holds (a resumed run has written part of it)."""
    existing = Path(run_dir)
    while not existing.exists():
        existing = existing.parent
    held = sum(f.stat().st_size for f in Path(run_dir).rglob("*") if f.is_file()) if Path(run_dir).is_dir() else 0
    needed = p["estimated_disk_gib"] * GIB - held
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise NotEnoughDisk(f"{run_dir}: {_size(free)} free on its file system, the run needs about {_size(needed)} "
                            f"more (`featcal plan` estimate {p['estimated_disk_gib']} GiB, {_size(held)} already "
                            "written); free some space or choose another --run-dir (--skip-disk-check starts anyway)")


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 1024**2:.1f} MiB"


def render(p: dict[str, Any]) -> str:
    lines = [
        f"architecture      {p['architecture']}",
        f"blocks            {p['blocks']}  (modules per block: {', '.join(p['modules_per_block'])})"
        + (f", then the head side ({p['head_side']})" if p["head_side"] else ""),
        "tasks             " + ", ".join(f"{t} ({v['examples']} ex" + (
            f" + {v['foreign_examples']} foreign: calibration.shared_inputs" if v.get("foreign_examples") else "")
            + ")" for t, v in p["tasks"].items()),
        f"tokens/example    ≤ {p['tokens_per_example_max']}",
        f"stages            {p['stages']}",
        f"disk (estimate)   {p['estimated_disk_gib']} GiB  (merged + calibrated checkpoints, solved blocks, 2 live "
        "boundaries, one block's stats per task)",
        f"RAM (estimate)    {p['estimated_peak_ram_gib']} GiB  (3 blocks, one block's Grams, 2 chunks, "
        + ("and the prepare stage's embeddings, which runtime.keep_freed_memory keeps" if p["keeps_freed_memory"]
           else "or the prepare stage's embeddings")
        + (", the resident boundaries and 2 blocks" if p["resident"] else "") + ", +1 GiB runtime)",
        f"resident path     {p['resident_reason']}",
        *([f"hub inputs        {len(p['hub_inputs'])}: {p['hub_cache_gib']} GiB in the cache, "
           f"{p['hub_download_gib']} GiB downloaded for this plan (before it, the log said how much)"]
          if p["hub_inputs"] else []),
        f"device            {p['device']}, {p['precision']}" + (
            "" if p["estimated_peak_device_gib"] is None
            else f"  (peak device memory estimate {p['estimated_peak_device_gib']} GiB: 2 blocks, Grams, 2 chunks)"),
        *([f"warning           {p['warning']}"] if p["warning"] else []),
        *(f"notice            {notice}" for notice in p["notices"]),
        *(f"warning           {line}" for line in p["setup_warnings"]),
    ]
    return "\n".join(lines)
