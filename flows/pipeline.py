"""The calibration pipeline's order of stages, their cache keys, and what is deleted when.

One function, `calibrate`, walks merge → prepare → (gram → solve → propagate) per block → assemble →
evaluate. How each stage is called is the runner's business: directly in this process (tests,
benchmarks) or as a Prefect task (flows/prefect_flow.py). Both paths share every line below.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import yaml

from featcal.calibration_methods import calibration_method
from featcal.config import RunConfig, digest_of
from featcal.config_diff import check_same_config
from featcal.data import on_accelerator
from featcal.devices import resolve_device
from featcal.evaluation import hms
from featcal.model_card import model_card
from featcal.modeling import calibrated_modules
from featcal.zeroshot import class_names
from flows import signals
from storage.atomic import read_json, write_bytes, write_json
from storage.checkpoint import MODEL_CARD
from storage.fingerprint import fingerprint
from storage.rundir import MissingOutput, Record, RunDir
from tasks import assemble, evaluate, gram, merge, prepare, propagate, solve
from tasks.assemble import CALIBRATED
from tasks.context import CONFIG_NAME, context
from tasks.head_refit import refits_heads
from tasks.merge import MERGED
from tasks.preflight import preflight
from tasks.record import StageFn, execute

log = logging.getLogger("featcal")

STAGES: dict[str, StageFn] = {
    "merge": merge.run,
    "prepare": prepare.prepare,
    "gram": gram.gram,
    "solve": solve.solve,
    "propagate": propagate.propagate,
    "assemble": assemble.run,
    "evaluate": evaluate.run,
}
SOURCE_PACKAGES = ("featcal", "tasks", "storage", "featcal_kernels")


def code_version() -> str:
    """Digest of the code every stage runs: any change to it invalidates every cached stage."""
    root = Path(__file__).resolve().parent.parent
    return code_digest(path for package in SOURCE_PACKAGES for path in (root / package).rglob("*.py"))


def code_digest(paths: Iterable[Path]) -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


@dataclass
class StageCall:
    kind: str
    stage: str
    label: str
    key: str
    needs: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)


# (run dir, stage call, its verified record or None) → record. The pipeline verifies once (hashing the
# outputs) and hands the verdict on, so a resumed run reads each finished output once, not once per layer.
Runner = Callable[[str, StageCall, Record | None], Record]


class Pending(Protocol):
    def result(self) -> Record: ...


# A runner that can run calls concurrently (on Dask workers) also gets a submitter: same arguments, returns at
# once with a handle. Only independent calls are submitted together (a block's Grams, its propagations, the
# prepares); their records are collected in call order, so every reduction downstream keeps its fixed order.
Submitter = Callable[[str, StageCall, Record | None], Pending]


def direct_runner(run_dir: str, call: StageCall, done: Record | None) -> Record:
    if done is not None:
        return done
    return execute(run_dir, call.stage, call.key, STAGES[call.kind], call.needs, call.params)


def stage_count(tasks: int, blocks: int, solve_groups: int, evaluate: bool, head_side: bool = False) -> int:
    """Stages of a run: merge, a prepare per task, per block a Gram per task and its solve groups, a propagation
    per task between blocks, assemble, and evaluate when enabled. The head side (featcal.calibrate_head_side) adds
    a Gram per task, one solve, and the last block's propagations."""
    return (1 + tasks + blocks * (tasks + solve_groups) + (blocks - 1) * tasks + 1 + int(evaluate)
            + (2 * tasks + 1) * int(head_side))


def keyed(settings: dict[str, Any]) -> dict[str, Any]:
    """A config section as stage keys hold it: fields added after runs were made (calibration.views,
    calibration.shared_inputs, featcal.lambda_choice) are left out while they are off, so those runs still resume
    from their cache."""
    off = {"views": lambda v: not v["count"], "shared_inputs": lambda v: v["weight"] == 0,
           "lambda_choice": lambda v: v == "lowest"}
    return {k: v for k, v in settings.items() if not (k in off and off[k](v))}


# The key of calibration.shared_inputs.pool's fingerprint among a pipeline's inputs.
SHARED_POOL = "calibration.shared_inputs.pool"


def solve_stage(layer: int, group: int, groups: int) -> str:
    return f"solve/l{layer:02d}" if groups == 1 else f"solve/l{layer:02d}/g{group}"


class Progress:
    """Stage-level progress with elapsed time and an ETA, in the log (and so in the terminal and the UI)."""

    def __init__(self, total: int):
        self.total, self.done, self.started = total, 0, time.perf_counter()

    def step(self, call: StageCall, record: Record, fresh: bool) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.started
        eta = elapsed / self.done * (self.total - self.done)
        how = f"{record['seconds']:.1f}s" if fresh else "cached"
        log.info("[%3d/%d] %-32s %8s  elapsed %s  ETA %s", self.done, self.total, call.label, how,
                 hms(elapsed), hms(eta))


class Pipeline:
    def __init__(self, run_dir: Path, runner: Runner, on_stage: Callable[[StageCall, Record], None] | None = None,
                 submit: Submitter | None = None, warnings: list[str] | None = None):
        self.run_dir = str(run_dir)
        self.warnings = warnings or []  # degenerate set-ups preflight found: the report lists them
        self.ctx = context(run_dir)
        self.run = self.ctx.run  # with the run's activation store
        self.cfg: RunConfig = self.ctx.cfg
        self.runner = runner
        self.submit = submit
        self.on_stage = on_stage
        self.code = code_version()
        memo = self.run / "records" / "fingerprints.json"
        self.inputs = {"base": fingerprint(self.cfg.base, memo)}
        self.inputs.update({f"expert/{t}": fingerprint(p, memo) for t, p in self.cfg.experts.items()})
        if self.cfg.merge.path is not None:  # a merge made elsewhere (merge.method given) is θ_m: its bytes key the run
            self.inputs["merge"] = fingerprint(self.cfg.merge.path, memo)
        for section, sources in (("calibration", self.cfg.calibration.data), ("evaluation", self.cfg.evaluation.data)):
            self.inputs.update({f"{section}/{t}": fingerprint(s.path, memo) for t, s in sources.items()})
        pool = self.cfg.calibration.shared_inputs.pool
        if pool is not None and self.cfg.calibration.shared_inputs.weights:
            self.inputs[SHARED_POOL] = fingerprint(pool.path, memo)
        # Zero-shot heads are made by the merge stage, from the CLIPModel, the prompts and each task's class names.
        self.head_inputs: list[Any] = []
        if self.cfg.zero_shot is not None:
            self.inputs["zero_shot"] = fingerprint(self.cfg.zero_shot.clip_model, memo)
            self.head_inputs = [self.cfg.slice("zero_shot"), self.inputs["zero_shot"],
                                {t: class_names(self.cfg, t) for t in self.cfg.tasks}]
        self.solve_groups = [solve.solve_groups(calibrated_modules(self.ctx.skeleton.block_template(layer)),
                                                      self.ctx.solve_group_count(layer))
                             for layer in range(self.ctx.calibrated_blocks)]
        self.visited: set[str] = set()  # the stages of this config, for the manifest and what is dropped
        self.progress = Progress(stage_count(len(self.ctx.tasks), self.ctx.num_blocks, self.cfg.runtime.solve_groups,
                                             self.cfg.evaluation.enabled, self.cfg.featcal.calibrate_head_side))

    def key(self, kind: str, **fields: Any) -> str:
        """A stage's cache key: the code, its kind and its named fields. A field left out (an option while it is off,
        say) keeps the keys of the configs that never set it."""
        return digest_of({"code": self.code, "stage": kind, **fields})

    def call(self, call: StageCall) -> Record:
        signals.at_stage(call.label, self.progress.done, self.progress.total)
        done = self.run.verified(call.stage, call.key)
        record = self.runner(self.run_dir, call, done)
        self._finished(call, record, fresh=done is None)
        return record

    def call_all(self, calls: list[StageCall]) -> list[Record]:
        """Independent calls: one after the other, or submitted together when the runner can run them at once."""
        if self.submit is None or not calls:
            return [self.call(c) for c in calls]
        done = [self.run.verified(c.stage, c.key) for c in calls]
        for c, d in zip(calls, done, strict=True):
            if d is None:
                self.run.require(c.needs)  # a missing input rewinds here, before anything is sent to a worker
        todo = [c.label for c, d in zip(calls, done, strict=True) if d is None] or [calls[0].label]
        signals.at_stage(todo[0] + (f" and {len(todo) - 1} more at once" if len(todo) > 1 else ""),
                         self.progress.done, self.progress.total)
        pending = [self.submit(self.run_dir, c, d) for c, d in zip(calls, done, strict=True)]
        records = [p.result() for p in pending]
        for c, r, d in zip(calls, records, done, strict=True):
            self._finished(c, r, fresh=d is None)
        return records

    def _finished(self, call: StageCall, record: Record, fresh: bool) -> None:
        self.visited.add(call.stage)
        self.progress.step(call, record, fresh=fresh)
        if self.on_stage is not None:
            self.on_stage(call, record)

    def release(self, record: Record, rel: str, reuse: bool = False) -> None:
        """`rel` has had its last reader: deleted (unless runtime.keep_activations), and let go from memory."""
        if self.ctx.resident is not None:
            self.ctx.resident.drop(rel)
        if not self.cfg.runtime.keep_activations:
            self.run.release(rel, record["outputs"][rel], reuse)

    def stages(self) -> dict[str, Record]:
        """Every stage of the run in order, each called (or found cached) as soon as its inputs are recorded."""
        merged = self.call(self._merge_call())
        walk = BlockWalk(self, merged["outputs"]["merged"])
        walk.prepare()
        for layer in range(self.ctx.calibrated_blocks):
            walk.block(layer)
        refit = refits_heads(self.ctx)  # the head refit reads the model inputs once more, in assemble
        if not refit:
            walk.release_inputs()
        self.run.drop_spares()  # every Gram stage has written its statistics
        out = {"merge": merged, "assemble": self.call(self._assemble_call(walk, refit))}
        if refit:
            walk.release_inputs()
        if self.cfg.evaluation.enabled:
            out["evaluate"] = self.call(self._evaluate_call(out["assemble"], walk.merged_digest))
        return out

    def _merge_call(self) -> StageCall:
        inputs, tasks = self.inputs, self.ctx.tasks
        fields: dict[str, Any] = {"merge": self.cfg.slice("merge"), "base": inputs["base"],
                                  "experts": [inputs[f"expert/{t}"] for t in tasks]}
        if self.head_inputs:  # zero-shot heads: their config, CLIP model and class names
            fields["zero_shot"] = self.head_inputs
        if "merge" in inputs:
            fields["given_merge"] = inputs["merge"]
        return StageCall("merge", "merge", "merge", self.key("merge", **fields))

    def _assemble_call(self, walk: BlockWalk, refit: bool) -> StageCall:
        parts = {rel: rec for block in walk.solved for rel, rec in block.items()}
        fields: dict[str, Any] = {"merged": walk.merged_digest,
                                  "blocks": [rec["outputs"][rel] for rel, rec in parts.items()]}
        needs = {rel: rec["stage"] for rel, rec in parts.items()}
        if refit:  # each task's head refitted on its stored inputs, to its expert's logits
            fc = self.cfg.featcal
            inputs = {self.run.inputs(t): walk.prepared[t] for t in self.ctx.tasks}
            fields["head_refit"] = {"setting": fc.head_refit, "lambda_grid": fc.lambda_grid,
                                    "holdout": [fc.holdout_every, fc.holdout_folds],
                                    "inputs": [rec["outputs"][rel] for rel, rec in inputs.items()],
                                    "experts": [self.inputs[f"expert/{t}"] for t in self.ctx.tasks]}
            needs.update({rel: rec["stage"] for rel, rec in inputs.items()})
        return StageCall("assemble", "assemble", "assemble calibrated checkpoint", self.key("assemble", **fields),
                         needs=needs)

    def _evaluate_call(self, assembled: Record, merged_digest: str) -> StageCall:
        cal = self.cfg.slice("calibration")["calibration"]
        fields: dict[str, Any] = {"calibrated": assembled["outputs"]["calibrated"], "merged": merged_digest,
                                  "evaluation": self.cfg.slice("evaluation"), "seed": cal["seed"],
                                  "max_length": cal["max_length"], "inputs": self.inputs}
        if self.warnings:
            fields["warnings"] = self.warnings
        return StageCall("evaluate", "evaluate", "evaluate", self.key("evaluate", **fields),
                         needs={"calibrated": "assemble", "merged": "merge"},
                         params={"warnings": self.warnings} if self.warnings else {})

    def run_all(self, max_rewinds: int = 64) -> dict[str, Record]:
        for _ in range(max_rewinds):
            try:
                records = self.stages()
                signals.at_stage(None, self.progress.done, self.progress.total)
                return records
            except MissingOutput as exc:
                log.warning("%s: running them again", exc)
                for producer in exc.producers:
                    self.run.invalidate(producer)
                self.progress = Progress(self.progress.total)
        raise RuntimeError(f"gave up after {max_rewinds} attempts to rebuild missing intermediates in {self.run.root}")


# A boundary as a later stage reads it: (its producer's record, its output name).
Boundary = tuple[Record, str]


class BlockWalk:
    """The calibration stages of one pass of `Pipeline.stages`: prepare, then per block its Grams, solve groups and
    propagations, tracking where each task's current boundary (merged side S, expert side E) and encoder output
    come from, and releasing each once every stage that reads it is done."""

    def __init__(self, pipeline: Pipeline, merged_digest: str):
        self.p, self.merged_digest = pipeline, merged_digest
        self.run, self.tasks, self.adapter = pipeline.run, pipeline.ctx.tasks, pipeline.ctx.adapter
        self.last = pipeline.ctx.calibrated_blocks - 1  # L - 1, or L: the head side (featcal.calibrate_head_side)
        # bf16 activations are other activations; the device is not in any key: a run may resume elsewhere.
        self.precision = pipeline.cfg.runtime.precision
        self.prepared: dict[str, Record] = {}
        self.side: dict[tuple[str, str], Boundary] = {}  # (task, "merged" | "expert") → the current boundary
        self.memory: dict[tuple[str, str], Boundary] = {}  # an encoder–decoder's encoder output, per task and side
        self.solved: list[dict[str, Record]] = []  # per block: {solve group's file: its record}
        featcal_cfg = pipeline.cfg.slice("featcal")["featcal"]
        self.featcal = featcal_cfg
        # The head side changes no transformer block's solve: switching it on reruns only the stages it adds.
        # Nor does the head refit, done at assembly.
        self.solve_cfg = keyed({k: v for k, v in featcal_cfg.items() if k not in ("calibrate_head_side", "head_refit")})
        self.plan = calibration_method(pipeline.cfg.featcal,
                                       foreign_weights=pipeline.cfg.calibration.shared_inputs.weights).statistics

    def prepare(self) -> None:
        cal = self.p.cfg.slice("calibration")["calibration"]
        settings = keyed({k: v for k, v in cal.items() if k != "data"})
        calls = [StageCall("prepare", f"prepare/{t}", f"prepare · {t}", self.p.key(
            "prepare", task=t, calibration=self._prepare_settings(t, settings), data=cal["data"][t],
            precision=self.precision, data_bytes=self.p.inputs[f"calibration/{t}"],
            expert=self.p.inputs[f"expert/{t}"], merged=self.merged_digest), needs={"merged": "merge"},
            params=self._prepare_params(t, self._prepare_settings(t, settings))) for t in self.tasks]
        self.prepared = dict(zip(self.tasks, self.p.call_all(calls), strict=True))
        for t in self.tasks:
            for s in ("merged", "expert"):
                self.side[t, s] = (self.prepared[t], self.run.acts(t, 0, s))

    def _prepare_settings(self, t: str, settings: dict[str, Any]) -> dict[str, Any]:
        """The calibration settings task `t`'s inputs depend on: with shared inputs, which foreign rows it stores (the
        other tasks' data and the pool, with their bytes), not the weight the solve gives them."""
        if "shared_inputs" not in settings:
            return settings
        cal, shared = self.p.cfg.slice("calibration")["calibration"], settings["shared_inputs"]
        foreign = {u: [cal["data"][u], self.p.inputs[f"calibration/{u}"]] for u in self.tasks if u != t}
        if shared["pool"] is not None:
            foreign[SHARED_POOL] = [shared["pool"], shared["pool_examples"], self.p.inputs[SHARED_POOL]]
        return {**settings, "shared_inputs": foreign}

    def _prepare_params(self, t: str, settings: dict[str, Any]) -> dict[str, Any]:
        """The prepare stage's arguments; with runtime.input_cache, the key of the task's entry there: what the model
        inputs depend on (the data, its settings, the base's tokenizer or processor, for an encoder–decoder the
        expert, whose greedy output may make the targets, and for images whether an accelerator preprocesses them),
        not the merge or the precision. Not in the stage's key:
        the inputs are the same whether copied or prepared."""
        if self.p.cfg.runtime.input_cache is None:
            return {"task": t}
        source = self.p.cfg.slice("calibration")["calibration"]["data"][t]
        fields: dict[str, Any] = {"code": self.p.code, "calibration": settings,
                                  "data": {k: v for k, v in source.items() if k != "path"},
                                  "data_bytes": self.p.inputs[f"calibration/{t}"], "base": self.p.inputs["base"],
                                  "architecture": self.adapter.architecture}
        if self.adapter.has_decoder:
            fields["expert"] = self.p.inputs[f"expert/{t}"]
        if "pixel_values" in self.adapter.model_input_names() and on_accelerator(
                resolve_device(self.p.cfg.runtime.device)):
            fields["image_ops"] = "tensor ops on the device"  # may be a level or two from Pillow's (pixels.py)
        return {"task": t, "inputs_key": digest_of(fields)}

    def block(self, layer: int) -> None:
        grams = dict(zip(self.tasks, self.p.call_all([self._gram_call(layer, t) for t in self.tasks]), strict=True))
        groups = self.p.solve_groups[layer]
        solved = self.p.call_all([self._solve_call(layer, grams, g, groups) for g in range(len(groups))])
        parts = {self.run.block(layer, g, len(groups)): rec for g, rec in enumerate(solved)}
        self.solved.append(parts)
        for t in self.tasks:  # spares for the next block's statistics, as large
            self.p.release(grams[t], self.run.stats(t, layer), reuse=layer < self.last)
        calls = [self._propagate_call(layer, t, parts) for t in (self.tasks if layer < self.last else [])]
        props = dict(zip([c.params["task"] for c in calls], self.p.call_all(calls), strict=True))
        for t in self.tasks:
            self._advance(layer, t, grams[t], props.get(t))

    def _read(self, *boundaries: Boundary) -> tuple[list[str], dict[str, str]]:
        """The digests of `boundaries` (for a key) and their producers (for `needs`)."""
        return [rec["outputs"][rel] for rec, rel in boundaries], {rel: rec["stage"] for rec, rel in boundaries}

    def _gram_call(self, layer: int, t: str) -> StageCall:
        cross = [self.memory[t, s] for s in ("merged", "expert")] if self.adapter.reads_encoder(layer) else []
        digests, needs = self._read(self.side[t, "merged"], self.side[t, "expert"], *cross)
        fc, plan = self.featcal, self.plan
        fields: dict[str, Any] = {
            "layer": layer, "task": t, "boundaries": digests, "merged": self.merged_digest,
            "precision": self.precision, "expert": self.p.inputs[f"expert/{t}"],
            "pooled_token_weight": fc["pooled_token_weight"], "method": fc["method"], "alpha": fc["alpha"]}
        if plan.held_out_every:  # the Gram then also sums held-out rows, fold by fold
            fields["held_out"] = [plan.held_out_every, plan.held_out_folds]
        if layer == self.p.ctx.num_blocks - 1 and self.last == self.p.ctx.num_blocks:
            fields["head_side"] = True  # the last transformer block's Gram also writes E_t(L): not the same stage
        if plan.keeps_rows(self.p.cfg.runtime.row_statistics):
            fields["rows"] = True
        return StageCall("gram", f"gram/l{layer:02d}/{t}", f"block {layer:02d} · gram · {t}",
                         self.p.key("gram", **fields),
                         needs={**needs, self.run.inputs(t): self.prepared[t]["stage"], "merged": "merge"},
                         params={"task": t, "layer": layer})

    def _solve_call(self, layer: int, grams: dict[str, Record], g: int, groups: list[list[str]]) -> StageCall:
        run, inputs = self.run, self.p.inputs
        fields: dict[str, Any] = {
            "layer": layer, "statistics": [grams[t]["outputs"][run.stats(t, layer)] for t in self.tasks],
            "featcal": self.solve_cfg, "merged": self.merged_digest, "base": inputs["base"],
            "experts": [inputs[f"expert/{t}"] for t in self.tasks]}
        if len(groups) > 1:
            fields["modules"] = groups[g]
        if self.p.cfg.runtime.solve_precision == "mixed":  # float64 keys stay as they were
            fields["solve_precision"] = "mixed"
        shared = self.p.cfg.calibration.shared_inputs
        if shared.weights:  # the foreign rows' weight: a solve's choice, not the Gram's
            fields["shared_weight"] = shared.weights
        label = f"block {layer:02d} · solve" + (f" · {g + 1}/{len(groups)}" if len(groups) > 1 else "")
        return StageCall("solve", solve_stage(layer, g, len(groups)), label, self.p.key("solve", **fields),
                         needs={**{run.stats(t, layer): grams[t]["stage"] for t in self.tasks}, "merged": "merge"},
                         params={"layer": layer, "group": g, "groups": len(groups)})

    def _propagate_call(self, layer: int, t: str, parts: dict[str, Record]) -> StageCall:
        cross = [self.memory[t, "merged"]] if self.adapter.reads_encoder(layer) else []
        digests, needs = self._read(self.side[t, "merged"], *cross)
        return StageCall("propagate", f"propagate/l{layer:02d}/{t}", f"block {layer:02d} · propagate · {t}",
                         self.p.key("propagate", layer=layer, task=t, boundaries=digests,
                                    blocks=[rec["outputs"][rel] for rel, rec in parts.items()],
                                    precision=self.precision),
                         needs={**needs, **{rel: rec["stage"] for rel, rec in parts.items()},
                                self.run.inputs(t): self.prepared[t]["stage"]},
                         params={"task": t, "layer": layer})

    def _advance(self, layer: int, t: str, gram: Record, prop: Record | None) -> None:
        """Task `t`'s boundaries after block `layer`, and block `layer`'s released."""
        run, (s_rec, s_rel), (e_rec, e_rel) = self.run, self.side[t, "merged"], self.side[t, "expert"]
        if self.adapter.ends_stack(layer):  # the encoder's output; the decoder starts from prepare's boundary
            assert prop is not None  # an encoder's last block is never the last calibrated block
            self.memory[t, "merged"] = (prop, run.encoder_output(t, "merged"))
            self.memory[t, "expert"] = (gram, run.encoder_output(t, "expert"))
        if layer + 1 in self.adapter.stack_starts():
            for s in ("merged", "expert"):
                self.side[t, s] = (self.prepared[t], run.acts(t, layer + 1, s))
        elif prop is not None:
            self.side[t, "merged"] = (prop, run.acts(t, layer + 1, "merged"))
            self.side[t, "expert"] = (gram, run.acts(t, layer + 1, "expert"))
        self.p.release(s_rec, s_rel)
        self.p.release(e_rec, e_rel)

    def release_inputs(self) -> None:
        """The model inputs (and encoder outputs), read by every Gram and propagation, now all done."""
        for t in self.tasks:
            self.p.release(self.prepared[t], self.run.inputs(t))
            for s in ("merged", "expert"):
                if (t, s) in self.memory:
                    self.p.release(*self.memory[t, s])


def machine() -> str:
    """What a benchmark ran on, for the header of its output."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "prefect", "zarr", "safetensors", "datasets", "numpy", "featcal"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def write_model_cards(cfg: RunConfig, run: RunDir) -> None:
    """A README.md in `merged/` and `calibrated/`, from the run's records and report (featcal/model_card.py).

    Not a stage: it costs nothing, reads the evaluation that finishes after both checkpoints, and is rewritten
    by every run, cached or not; no output digest covers it (storage/rundir.py), so writing it changes no cache
    key and a rerun stays a cache hit."""
    examples = {t: rec["info"]["examples"] for t in cfg.tasks if (rec := run.record(f"prepare/{t}"))}
    report = read_json(run / "report.json") if cfg.evaluation.enabled and (run / "report.json").is_file() else None
    for checkpoint in (MERGED, CALIBRATED):
        architecture = (read_json(run / checkpoint / "config.json").get("architectures") or [None])[0]
        text = model_card(cfg.redacted(), checkpoint, architecture, examples, report)
        write_bytes(run / checkpoint / MODEL_CARD, text.encode())


def run_pipeline(cfg: RunConfig, run_dir: str | Path, runner: Runner = direct_runner,
                 on_stage: Callable[[StageCall, Record], None] | None = None,
                 submit: Submitter | None = None, reuse: bool = False) -> dict[str, Record]:
    """Lock the run directory, validate, run (or resume) every stage, and write the manifest.

    A run directory belongs to one config: one holding a run of another is refused, untouched, unless `reuse`
    (featcal/config_diff.py). After a complete run the directory holds this config's stages only: the records and
    outputs of any other are deleted. A run that fails or is stopped after it started says so in its manifest.
    Ctrl-C or SIGTERM stops it within seconds (flows/signals.py); rerunning resumes."""
    run = RunDir(run_dir)
    if not reuse:
        check_same_config(cfg, run.root)
    warnings = preflight(cfg).warnings
    # Inside a Prefect flow too: the flow engine installs its own SIGTERM handler, this takes it back.
    with signals.stop_on_signals(), run.lock():
        # Credentials as placeholders (featcal/secrets.py): stages restore them from memory, never from this file.
        resolved = yaml.safe_dump(cfg.redacted(), sort_keys=False).encode()
        if not (run / CONFIG_NAME).is_file() or (run / CONFIG_NAME).read_bytes() != resolved:
            write_bytes(run / CONFIG_NAME, resolved)
        manifest: dict[str, Any] = {"config_fingerprint": cfg.fingerprint()}
        try:
            pipeline = Pipeline(run.root, runner, on_stage, submit, warnings)
            manifest.update(code_version=pipeline.code, versions=versions(), inputs=pipeline.inputs, status="running",
                            started_at=time.time(), **({"warnings": warnings} if warnings else {}))
            write_json(run / "manifest.json", manifest)
            records = pipeline.run_all()
            write_model_cards(cfg, run)
            dropped = run.drop_stages_except(pipeline.visited)
            if dropped:
                log.info("dropped %d stage(s) of another config: %s", len(dropped), ", ".join(dropped))
        except BaseException as exc:
            _mark_ended(run, manifest, exc)
            raise
        stages, targets = {}, {}
        for stage, rec in run.stage_records().items():
            stages[stage] = {"key": rec["key"], "seconds": rec["seconds"], "outputs": rec["outputs"]}
            if "decoder_targets" in rec.get("info", {}):  # an encoder–decoder's: a data column or greedy output
                targets[stage.split("/", 1)[1]] = rec["info"]["decoder_targets"]
        if targets:
            manifest["decoder_targets"] = targets
        write_json(run / "manifest.json",
                   {**manifest, "status": "complete", "finished_at": time.time(), "stages": stages})
        return records


def _mark_ended(run: RunDir, manifest: dict[str, Any], exc: BaseException) -> None:
    """The manifest of a run that did not finish: `stopped` (a signal) or `failed`, with the one-line reason."""
    ended: dict[str, Any]
    if isinstance(exc, (signals.Stopped, KeyboardInterrupt)):
        ended = {"status": "stopped", "reason": f"stopped by {exc if isinstance(exc, signals.Stopped) else 'SIGINT'}"}
    else:
        first = (str(exc).strip().splitlines() or [""])[0]
        ended = {"status": "failed", "reason": f"{type(exc).__name__}: {first}" if first else type(exc).__name__}
    ended["finished_at"] = time.time()
    try:
        write_json(run / "manifest.json", {**manifest, **ended})
    except OSError as err:  # a full disk, say: the run's own error is the one to report
        exc.add_note(f"manifest.json could not be marked {ended['status']}: {err}")
