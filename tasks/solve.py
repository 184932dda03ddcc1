"""The solve stage: one solve group of block `layer`, each module solved from every task's statistics."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file

from featcal.adapters import CLIPVisionAdapter
from featcal.calibration_methods import CalibrationMethod, ModuleData, calibration_method
from featcal.devices import release_freed_memory, solve_device
from featcal.modeling import as_out_in, calibrated_modules, is_norm, linear_dims, norm_scale_offset
from featcal.statistics import READERS, module_keys, shared_inputs
from storage.atomic import atomic_path
from storage.checkpoint import CanonicalCheckpoint, read_header, read_metadata, read_tensor, save_tensors
from storage.lora import LoraCheckpoint
from tasks.context import RunContext
from tasks.gram import STATS_ALPHA
from tasks.merge import MERGED, head_file

log = logging.getLogger("featcal")


def _task_stats(ctx: RunContext, layer: int, members: tuple[str, ...],
                device: torch.device | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The statistics of `members` (one module, or modules that read one input, solved as one map with their outputs
    stacked) on `device`, task after task in task order, read without mmap: one task's at a time. The input's sums
    are read once; each member's own (P_t, row targets) sit side by side along their output axis, in member order."""
    for task in ctx.tasks:
        path = ctx.run / ctx.run.stats(task, layer)
        header, start = read_header(path)
        keys = [module_keys(list(header), m) for m in members]
        parts = {part for ks in keys for part in ks.values()}
        if {"pt", "yt"} & parts:  # P_t and the row form's targets hold α: another α's are not this run's
            summed_for = read_metadata(path).get(STATS_ALPHA)
            if summed_for != repr(ctx.cfg.featcal.alpha):
                kept = "P_t was summed" if "pt" in parts else "row targets were taken"
                raise ValueError(f"{path}: module {READERS.join(members)}'s {kept} for featcal.alpha {summed_for}, "
                                 f"the run asks {ctx.cfg.featcal.alpha}; rerun its Gram stage")
        read = functools.partial(_read_stat, path, header, start, device)
        shared = {key: part for key, part in keys[0].items() if all(key in ks for ks in keys)}
        own = [{part: key for key, part in ks.items() if key not in shared} for ks in keys]
        yield {**{part: read(key) for key, part in shared.items()},
               **{part: torch.cat([read(mine[part]) for mine in own], dim=-1) for part in own[0]}}


def _read_stat(path: Path, header: dict[str, Any], start: int, device: torch.device | None, key: str) -> torch.Tensor:
    return read_tensor(path, header[key], start).to(device)


def solve_groups(modules: dict[str, torch.nn.Module], groups: int) -> list[list[str]]:
    """A block's modules in `groups` lists of about equal solve cost, each in block order.

    A linear map costs about in² · (in + out) (its Gram products and its Cholesky), a norm its width; the
    costliest module goes first to the least loaded group (ties: the lower group), so the split is fixed."""
    if not 1 <= groups <= len(modules):
        raise ValueError(f"runtime.solve_groups must be between 1 and {len(modules)} (the calibrated modules of a "
                         f"block), got {groups}")
    order = list(modules)

    def cost(name: str) -> int:
        m = modules[name]
        if is_norm(m):
            return int(cast(torch.Tensor, m.weight).shape[0])  # nn.Module's attributes are typed Tensor | Module
        d_in, d_out = linear_dims(m)
        return d_in ** 2 * (d_in + d_out)

    members: list[list[str]] = [[] for _ in range(groups)]
    load = [0] * groups
    for name in sorted(order, key=lambda n: (-cost(n), order.index(n))):
        g = min(range(groups), key=lambda i: (load[i], i))
        members[g].append(name)
        load[g] += cost(name)
    return [sorted(m, key=order.index) for m in members]


def solve(ctx: RunContext, layer: int, group: int = 0, groups: int = 1) -> tuple[list[str], dict[str, Any]]:
    """The modules of solve group `group` (of `groups`) of block `layer`, each solved by the run's calibration method
    (featcal/calibration_methods.py) from the tasks' statistics summed in task order; the group's file holds every
    parameter of its modules, solved or kept (a part the method leaves keeps the merged value)."""
    if not ctx.cfg.runtime.keep_freed_memory:
        release_freed_memory()
    fc = ctx.cfg.featcal
    method = calibration_method(fc, ctx.cfg.runtime.solve_precision, ctx.cfg.calibration.shared_inputs.weights)
    weights = (_task_weights(ctx, layer, fc.task_weight_power, fc.task_weights) if method.weighs_tasks
               else [1.0] * len(ctx.tasks))
    merged = ctx.checkpoint(MERGED).with_prefix(ctx.adapter.block_prefix(layer))
    modules = calibrated_modules(ctx.skeleton.block_template(layer))
    solved: dict[str, torch.Tensor] = {}
    damping: dict[str, float] = {}
    grown: dict[str, float] = {}
    solved_on: set[str] = set()  # float64 solves: on the run's device when it has room, else the CPU
    reports: dict[str, dict[str, Any]] = {}  # per-module facts the method reports (a chosen λ, ...), by kind
    row_form, inputs = _block_layout(ctx, layer, modules)
    for members in _solve_units(ctx, layer, solve_groups(modules, groups)[group], merged, inputs, method):
        for name in members:
            solved.update({k: merged[k] for k in _part_names(name).values() if k in merged})
        data, stored = _module_data(ctx, layer, members, modules, merged, tuple(weights), solved_on,
                                    members[0] in row_form)
        result = method.solve_norm(data) if is_norm(modules[members[0]]) else method.solve_linear(data)
        if result is None:
            continue
        solved.update(stored(result.tensors))
        if "unresolved" in result.report:
            log.warning("block %d module %s: %s", layer, READERS.join(members),
                        unresolved_warning(result.report["unresolved"]))
        for name in members:
            for kind, value in result.report.items():
                reports.setdefault(kind, {})[name] = value
            if result.damping is None:
                continue
            damping[name] = result.damping
            if result.eps is not None and result.damping > result.eps:
                grown[name] = result.damping
                log.warning("block %d module %s: Cholesky needed damping %.3g (asked %.3g)", layer, name,
                            result.damping, result.eps)
    rel = ctx.run.block(layer, group, groups)
    with atomic_path(ctx.run / rel) as tmp:
        save_tensors(solved, tmp)
    info: dict[str, Any] = {"method": fc.method, "modules": len(damping), "damping_grown": grown,
                            "solved_on": sorted(solved_on)}
    if fc.task_weight_power or fc.task_weights:
        info["task_weights"] = dict(zip(ctx.tasks, weights, strict=True))
    info.update(reports)
    return [rel], info


def unresolved_warning(unresolved: dict[str, Any]) -> str:
    """The warning for a solve that left directions unresolved (featcal.closed_form.unresolved_directions), naming the
    tasks whose own inputs span fewer directions than the module reads."""
    width, ranks = unresolved["width"], unresolved["task_ranks"]
    short = ", ".join(f"{task} (rank {rank})" for task, rank in ranks.items() if rank < width) or "none alone"
    return (f"{unresolved['directions']} of its {width} input directions are within the fp32 rounding of the tasks' "
            f"Grams and featcal.lambda does not lift them: its weights along them are rounding noise, not fitted "
            f"(tasks spanning fewer than {width}: {short}); raise featcal.lambda (at 1e-4 that noise is ~1e-4 of the "
            "weights) or calibrate on more varied inputs (a decoder's greedy targets repeating one token do this)")


def _part_names(module: str) -> dict[str, str]:
    """A module's weight and bias names within its block."""
    return {part: f"{module}.{part}" if module else part for part in ("weight", "bias")}


def _module_data(ctx: RunContext, layer: int, members: tuple[str, ...], modules: dict[str, torch.nn.Module],
                 merged: dict[str, torch.Tensor], weights: tuple[float, ...], solved_on: set[str],
                 rows: bool) -> tuple[ModuleData, Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]]:
    """`members` of block `layer` (one module, or linear maps that read one input, as one map with their outputs
    stacked) as a method's solve reads them, and how solved tensors go back to the checkpoint's names, layout and
    dtype. A linear map's tensors move to its solve's device (noted in `solved_on`), its weight as [out, in] (Conv1D
    stores [in, out]); a norm's stay on the CPU, γ as offset + the stored weight (Gemma's (1 + w) norms)."""
    prefix = ctx.adapter.block_prefix(layer)
    base, experts = ctx.checkpoint("base"), [ctx.checkpoint(t) for t in ctx.tasks]
    names = [_part_names(m) for m in members]
    first = modules[members[0]]
    if is_norm(first):
        device = None
        off = norm_scale_offset(first)

        def solve_layout(part: str, tensors: list[torch.Tensor]) -> torch.Tensor:
            return tensors[0] + off if part == "weight" else tensors[0]

        def stored(solved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {names[0][part]: (t - off if part == "weight" else t).to(merged[names[0][part]].dtype)
                    for part, t in solved.items()}
    else:
        outs = [linear_dims(modules[m])[1] for m in members]
        device = solve_device(ctx.device, linear_dims(first)[0], sum(outs))
        solved_on.add(str(device))

        def solve_layout(part: str, tensors: list[torch.Tensor]) -> torch.Tensor:
            laid = [as_out_in(modules[m], t) if part == "weight" else t for m, t in zip(members, tensors, strict=True)]
            return (laid[0] if len(laid) == 1 else torch.cat(laid)).to(device)

        def stored(solved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            out = {}
            for part, stacked in solved.items():
                for m, own, t in zip(members, names, stacked.split(outs), strict=True):
                    t = as_out_in(modules[m], t) if part == "weight" else t
                    out[own[part]] = t.to("cpu", merged[own[part]].dtype).contiguous()
            return out

    data = ModuleData(
        where=prefix + READERS.join(members), tasks=tuple(ctx.tasks), task_weights=weights,
        has_bias=names[0]["bias"] in merged,
        stats=lambda: _task_stats(ctx, layer, members, device),
        merged=lambda part: solve_layout(part, [merged[n[part]] for n in names]),
        base=lambda part: solve_layout(part, [base.get(prefix + n[part]) for n in names]),
        expert=lambda t, part: solve_layout(part, [experts[t].get(prefix + n[part]) for n in names]),
        head=_head(ctx, layer, members[0], experts, device), rows=rows)
    return data, stored


def _block_layout(ctx: RunContext, layer: int, modules: Iterable[str]) -> tuple[set[str], list[tuple[str, ...]]]:
    """From the statistics files of block `layer` (one header read per task): those of `modules` whose rows (row
    form), not sums, every task keeps; and the inputs that several of them read, each as its readers in block order
    (q, k and v; gate and up), where every task's file keeps the input's sums once for them all."""
    headers = [list(read_header(ctx.run / ctx.run.stats(task, layer))[0]) for task in ctx.tasks]
    rows = {m for m in modules if all("xs" in module_keys(keys, m).values() for keys in headers)}
    return rows, sorted(set.intersection(*(shared_inputs(keys) for keys in headers)))


def _solve_units(ctx: RunContext, layer: int, names: list[str], merged: dict[str, torch.Tensor],
                 inputs: list[tuple[str, ...]], method: CalibrationMethod) -> list[tuple[str, ...]]:
    """`names` (a solve group of block `layer`, in block order) as the units the solve takes one at a time: the
    linear maps that read one input, where the method solves them as one map (their system matrix is one: one
    Cholesky factor instead of one each, the input's sums read once), each other module alone. Readers with and
    without a bias go alone, as does the module that feeds a head metric."""
    joined: dict[str, tuple[str, ...]] = {}
    if method.joins_readers:
        for readers in inputs:
            present = tuple(m for m in names if m in readers)
            biased = {_part_names(m)["bias"] in merged for m in present}
            heads = [m for m in present if _feeds_head_metric(ctx, layer, m)]
            if len(present) > 1 and len(biased) == 1 and not heads:
                joined.update(dict.fromkeys(present, present))
    return list(dict.fromkeys(joined.get(name, (name,)) for name in names))  # a joined unit once, at its first member


def _feeds_head_metric(ctx: RunContext, layer: int, name: str) -> bool:
    return bool(ctx.cfg.featcal.head_metric) and layer == ctx.num_blocks - 1 and name == ctx.adapter.head_input_module()


def _head(ctx: RunContext, layer: int, name: str, experts: list[CanonicalCheckpoint | LoraCheckpoint],
          device: torch.device | None) -> Callable[[int], torch.Tensor] | None:
    """Task t's head map for module `name` of block `layer` where featcal.head_metric weighs its error, else None:
    from the task's expert, or from the merged checkpoint where every task reads the merged head (causal LMs)."""
    if not _feeds_head_metric(ctx, layer, name):
        return None
    if ctx.adapter.head_is_merged:
        shared = ctx.adapter.head_map(ctx.checkpoint(MERGED)).to(device)
        return lambda t: shared
    if ctx.cfg.zero_shot is not None:  # head-less experts: the merge wrote each task's head from its class names
        merged, clip = ctx.checkpoint(MERGED), ctx.adapter
        if not isinstance(clip, CLIPVisionAdapter):  # preflight allows zero_shot for CLIP vision towers only
            raise TypeError(f"zero_shot: a {clip.architecture}; expected a CLIPVisionModel")
        return lambda t: clip.zero_shot_head_map(load_file(ctx.run / MERGED / head_file(ctx.tasks[t])),
                                                 merged).to(device)
    return lambda t: ctx.adapter.head_map(experts[t]).to(device)


def _task_weights(ctx: RunContext, layer: int, power: float, given: dict[str, float]) -> list[float]:
    """c_t ∝ d_t^power with mean 1, d_t = task t's relative output drift of the uncalibrated merged block (measured
    by its Gram stage): power > 0 leans towards the tasks the merge moved most, < 0 protects
    those it served well; then times the task's `given` weight (featcal.task_weights)."""
    if power == 0:
        return [given.get(task, 1.0) for task in ctx.tasks]
    drift = []
    for task in ctx.tasks:
        record = ctx.run.record(f"gram/l{layer:02d}/{task}")
        if record is None:
            raise ValueError(f"featcal.task_weight_power: block {layer} has no Gram record for task {task}")
        drift.append(max(float(record["info"]["drift_out_uncalibrated"]), 1e-12) ** power)
    mean = sum(drift) / len(drift)
    return [d / mean * given.get(task, 1.0) for d, task in zip(drift, ctx.tasks, strict=True)]

