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
from featcal.evaluation import hms
from featcal.model_card import model_card
from featcal.modeling import calibrated_modules
from featcal.zeroshot import class_names
from flows import signals
from storage.atomic import read_json, write_bytes, write_json
from storage.checkpoint import MODEL_CARD
from storage.fingerprint import fingerprint
from storage.rundir import MissingOutput, Record, RunDir
from tasks import assemble, calibration, evaluate, merge
from tasks.assemble import CALIBRATED
from tasks.context import CONFIG_NAME, context
from tasks.merge import MERGED
from tasks.preflight import preflight
from tasks.record import StageFn, execute

log = logging.getLogger("featcal")

STAGES: dict[str, StageFn] = {
    "merge": merge.run,
    "prepare": calibration.prepare,
    "gram": calibration.gram,
    "solve": calibration.solve,
    "propagate": calibration.propagate,
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
    featcal.lambda_choice) are left out while they are off, so those runs still resume from their cache."""
    off = {"views": lambda v: not v["count"], "lambda_choice": lambda v: v == "lowest"}
    return {k: v for k, v in settings.items() if not (k in off and off[k](v))}


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
        # Zero-shot heads are made by the merge stage, from the CLIPModel, the prompts and each task's class names.
        self.head_inputs: list[Any] = []
        if self.cfg.zero_shot is not None:
            self.inputs["zero_shot"] = fingerprint(self.cfg.zero_shot.clip_model, memo)
            self.head_inputs = [self.cfg.slice("zero_shot"), self.inputs["zero_shot"],
                                {t: class_names(self.cfg, t) for t in self.cfg.tasks}]
        self.solve_groups = [calibration.solve_groups(calibrated_modules(self.ctx.skeleton.block_template(layer)),
                                                      self.ctx.solve_group_count(layer))
                             for layer in range(self.ctx.calibrated_blocks)]
        self.visited: set[str] = set()  # the stages of this config, for the manifest and what is dropped
        self.progress = Progress(stage_count(len(self.ctx.tasks), self.ctx.num_blocks, self.cfg.runtime.solve_groups,
                                             self.cfg.evaluation.enabled, self.cfg.featcal.calibrate_head_side))

    def key(self, *parts: Any) -> str:
        return digest_of([self.code, *parts])

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
        if not self.cfg.runtime.keep_activations:
            self.run.release(rel, record["outputs"][rel], reuse)

    def stages(self) -> dict[str, Record]:
        cfg, run, tasks, L = self.cfg, self.run, self.ctx.tasks, self.ctx.num_blocks
        last = self.ctx.calibrated_blocks - 1  # L - 1, or L: the head side (featcal.calibrate_head_side)
        cal = cfg.slice("calibration")["calibration"]
        # bf16 activations are other activations; the device is not in any key: a run may resume elsewhere.
        precision = cfg.runtime.precision
        merged = self.call(StageCall("merge", "merge", "merge", self.key(
            "merge", cfg.slice("merge"), self.inputs["base"], [self.inputs[f"expert/{t}"] for t in tasks],
            *self.head_inputs, *([self.inputs["merge"]] if "merge" in self.inputs else []))))
        merged_digest = merged["outputs"]["merged"]
        # (record, rel) of the current block boundary per task and side: S (merged) and E (expert).
        side: dict[tuple[str, str], tuple[Record, str]] = {}
        prepared = dict(zip(tasks, self.call_all([StageCall("prepare", f"prepare/{t}", f"prepare · {t}", self.key(
            "prepare", t, keyed({k: v for k, v in cal.items() if k != "data"}), cal["data"][t], precision,
            self.inputs[f"calibration/{t}"], self.inputs[f"expert/{t}"], merged_digest),
            needs={"merged": "merge"}, params={"task": t}) for t in tasks]), strict=True))
        for t in tasks:
            for s in ("merged", "expert"):
                side[t, s] = (prepared[t], run.acts(t, 0, s))
        # An encoder–decoder's encoder output per task and side, (record, rel), read by every decoder block.
        memory: dict[tuple[str, str], tuple[Record, str]] = {}

        def read(*boundaries: tuple[Record, str]) -> tuple[list[str], dict[str, str]]:
            """The digests of `boundaries` (for a key) and their producers (for `needs`)."""
            return [rec["outputs"][rel] for rec, rel in boundaries], {rel: rec["stage"] for rec, rel in boundaries}

        blocks: list[dict[str, Record]] = []  # per block: {solve group's file: its record}
        featcal_cfg = cfg.slice("featcal")["featcal"]
        # The head side changes no transformer block's solve: switching it on reruns only the stages it adds.
        solve_cfg = keyed({k: v for k, v in featcal_cfg.items() if k != "calibrate_head_side"})
        plan = calibration_method(cfg.featcal).statistics
        # The Gram then also sums held-out rows, fold by fold.
        held_out = [plan.held_out_every, plan.held_out_folds] if plan.held_out_every else []
        adapter = self.ctx.adapter
        for layer in range(last + 1):
            # With the head side, the last transformer block's Gram also writes E_t(L): not the same stage.
            hands_on = ["head side"] if layer == L - 1 and last == L else []
            gram_calls = []
            for t in tasks:
                cross = [memory[t, s] for s in ("merged", "expert")] if adapter.reads_encoder(layer) else []
                digests, needs = read(side[t, "merged"], side[t, "expert"], *cross)
                gram_calls.append(StageCall("gram", f"gram/l{layer:02d}/{t}", f"block {layer:02d} · gram · {t}", self.key(
                    "gram", layer, t, *digests, merged_digest, precision,
                    self.inputs[f"expert/{t}"], featcal_cfg["pooled_token_weight"], featcal_cfg["method"],
                    featcal_cfg["alpha"], *held_out, *hands_on,
                    *(["rows"] if plan.keeps_rows(cfg.runtime.row_statistics) else [])),
                    needs={**needs, run.inputs(t): prepared[t]["stage"], "merged": "merge"},
                    params={"task": t, "layer": layer}))
            grams = dict(zip(tasks, self.call_all(gram_calls), strict=True))
            groups = self.solve_groups[layer]
            solved = self.call_all([StageCall(
                "solve", solve_stage(layer, g, len(groups)),
                f"block {layer:02d} · solve" + (f" · {g + 1}/{len(groups)}" if len(groups) > 1 else ""), self.key(
                    "solve", layer, [grams[t]["outputs"][run.stats(t, layer)] for t in tasks], solve_cfg,
                    merged_digest, self.inputs["base"], [self.inputs[f"expert/{t}"] for t in tasks],
                    *([modules] if len(groups) > 1 else []),
                    *(["mixed"] if cfg.runtime.solve_precision == "mixed" else [])),  # float64 keys stay as they were
                needs={**{run.stats(t, layer): grams[t]["stage"] for t in tasks}, "merged": "merge"},
                params={"layer": layer, "group": g, "groups": len(groups)}) for g, modules in enumerate(groups)])
            parts = {run.block(layer, g, len(groups)): rec for g, rec in enumerate(solved)}
            blocks.append(parts)
            for t in tasks:  # spares for the next block's statistics, as large
                self.release(grams[t], run.stats(t, layer), reuse=layer < last)
            part_digests = [rec["outputs"][rel] for rel, rec in parts.items()]
            prop_calls = []
            for t in tasks if layer < last else []:
                cross = [memory[t, "merged"]] if adapter.reads_encoder(layer) else []
                digests, needs = read(side[t, "merged"], *cross)
                prop_calls.append(StageCall("propagate", f"propagate/l{layer:02d}/{t}",
                                            f"block {layer:02d} · propagate · {t}", self.key(
                    "propagate", layer, t, *digests, *part_digests, precision),
                    needs={**needs, **{rel: rec["stage"] for rel, rec in parts.items()},
                           run.inputs(t): prepared[t]["stage"]},
                    params={"task": t, "layer": layer}))
            props = dict(zip([c.params["task"] for c in prop_calls], self.call_all(prop_calls), strict=True))
            for t in tasks:
                (s_rec, s_rel), (e_rec, e_rel) = side[t, "merged"], side[t, "expert"]
                if adapter.ends_stack(layer):  # the encoder's output; the decoder starts from prepare's boundary
                    memory[t, "merged"] = (props[t], run.encoder_output(t, "merged"))
                    memory[t, "expert"] = (grams[t], run.encoder_output(t, "expert"))
                if layer + 1 in adapter.stack_starts():
                    for s in ("merged", "expert"):
                        side[t, s] = (prepared[t], run.acts(t, layer + 1, s))
                elif layer < last:
                    side[t, "merged"] = (props[t], run.acts(t, layer + 1, "merged"))
                    side[t, "expert"] = (grams[t], run.acts(t, layer + 1, "expert"))
                self.release(s_rec, s_rel)
                self.release(e_rec, e_rel)
        for t in tasks:  # the model inputs (and encoder outputs) were read by every Gram and propagation, now all done
            self.release(prepared[t], run.inputs(t))
            for s in ("merged", "expert"):
                if (t, s) in memory:
                    self.release(*memory[t, s])
        run.drop_spares()  # every Gram stage has written its statistics
        block_digests = [rec["outputs"][rel] for parts in blocks for rel, rec in parts.items()]
        out = {"merge": merged, "assemble": self.call(StageCall("assemble", "assemble", "assemble calibrated checkpoint",
                                                                self.key("assemble", merged_digest, block_digests),
                                                                needs={rel: rec["stage"] for parts in blocks
                                                                       for rel, rec in parts.items()}))}
        if cfg.evaluation.enabled:
            out["evaluate"] = self.call(StageCall("evaluate", "evaluate", "evaluate", self.key(
                "evaluate", out["assemble"]["outputs"]["calibrated"], merged_digest, cfg.slice("evaluation"),
                cal["seed"], cal["max_length"], self.inputs, *([self.warnings] if self.warnings else [])),
                needs={"calibrated": "assemble", "merged": "merge"},
                params={"warnings": self.warnings} if self.warnings else {}))
        return out

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
        write_json(run / "manifest.json", {**manifest, "status": "complete", "finished_at": time.time(), "stages": stages})
        return records


def _mark_ended(run: RunDir, manifest: dict[str, Any], exc: BaseException) -> None:
    """The manifest of a run that did not finish: `stopped` (a signal) or `failed`, with the one-line reason."""
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
