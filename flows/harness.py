"""`featcal eval-harness`: a finished run's checkpoints scored by lm-evaluation-harness, folded into its report.

lm_eval is an optional extra (`featcal[harness]`), imported only when a model has to be scored. Each model's
scores are kept in `harness/<model>.json` with the checkpoint's content fingerprint and the settings they were
made under, so a rerun scores only the models whose checkpoint, tasks or task data changed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from featcal.config import RunConfig, config_from_dict
from featcal.devices import resolve_device
from featcal.hub import local_dir
from storage.atomic import read_json, remove, write_bytes, write_json
from storage.fingerprint import fingerprint
from storage.lora import is_lora_adapter
from storage.rundir import RunDir
from tasks.context import CONFIG_NAME

# lm_eval loads its data through `datasets`, which reads these once, when imported: offline unless the user
# has said otherwise (HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0 lets built-in tasks fetch their data).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

log = logging.getLogger("featcal")

DEFAULT_MODELS = ("calibrated", "merged", "experts")
SECTION = "## lm-evaluation-harness"
REPORT_OUTPUTS = ("report.json", "report.md")  # the evaluate stage's outputs this command extends
INSTALL = "pip install 'featcal[harness]'"
# What is kept of lm_eval's answer: the scores and what they were computed from, not its environment dump.
KEPT = ("results", "configs", "versions", "n-shot", "n-samples", "higher_is_better", "config", "date")

Scores = dict[str, dict[str, float]]  # task → metric → value


class HarnessError(ValueError):
    """Bad input to `featcal eval-harness`, reported in one line."""


def run_config(run_dir: Path) -> RunConfig:
    """The config a run was made with (its run.yaml), or why RUN_DIR is not a run directory."""
    if not run_dir.is_dir():
        raise HarnessError(f"{run_dir}: no such run directory")
    if not (run_dir / CONFIG_NAME).is_file():
        raise HarnessError(f"{run_dir} is not a featcal run directory (it has no {CONFIG_NAME})")
    return config_from_dict(yaml.safe_load((run_dir / CONFIG_NAME).read_text()), root=run_dir,
                            source=str(run_dir / CONFIG_NAME))


def checkpoints(run_dir: Path, cfg: RunConfig, models: list[str]) -> dict[str, Path]:
    """Model name (calibrated, merged, base, expert:TASK) → checkpoint directory, for the `--models` entries."""
    out: dict[str, Path] = {}
    for entry in models:
        if entry in ("calibrated", "merged"):
            if not (run_dir / entry).is_dir():
                raise HarnessError(f"{run_dir / entry} is missing: the run has not finished; finish it with "
                                   f"`featcal run CONFIG --run-dir {run_dir}` first")
            out[entry] = run_dir / entry
        elif entry == "base":
            out[entry] = Path(local_dir(cfg.base))
        elif entry == "experts":
            out.update({f"expert:{task}": Path(local_dir(cfg.experts[task])) for task in cfg.tasks})
        elif entry.startswith("expert:") and entry.removeprefix("expert:") in cfg.experts:
            out[entry] = Path(local_dir(cfg.experts[entry.removeprefix("expert:")]))
        else:
            raise HarnessError(f"--models: unknown entry {entry!r}; use calibrated, merged, base, experts or "
                               f"expert:TASK with TASK one of {', '.join(cfg.tasks)}")
    adapters = [name for name, path in out.items() if name.startswith("expert:") and is_lora_adapter(path)]
    if adapters:  # lm_eval loads a model by path; an expert = base + adapter is not one
        what = "is a LoRA adapter" if len(adapters) == 1 else "are LoRA adapters"
        raise HarnessError(f"--models: {', '.join(adapters)} {what}, which lm-evaluation-harness loads only with its "
                           "own peft= model argument; leave them out (--models calibrated,merged)")
    return out


def _lm_eval() -> ModuleType:
    """lm_eval with its Hugging Face backend, or one line saying what to install."""
    try:
        import lm_eval
        import lm_eval.models.huggingface  # noqa: F401  (needs accelerate: the [hf] extra of lm_eval)
        import lm_eval.tasks  # noqa: F401
    except ImportError as exc:
        raise HarnessError(f"lm-evaluation-harness is not installed (no module {exc.name!r}): {INSTALL}") from None
    return lm_eval


def task_manager(lm_eval: ModuleType, tasks: list[str], include_path: str | None) -> Any:
    """lm_eval's task registry for `tasks`. Indexing the ~15,000 built-in tasks takes seconds, so tasks that all
    come from --include-path are looked up there alone; a name found nowhere is refused before any model loads."""
    from lm_eval.tasks import TaskManager

    names = [t for t in tasks if not Path(t).is_file()]  # a YAML file given by path needs no registry entry
    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(names) <= set(local.all_subtasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in names if t not in manager.all_tasks]
    if unknown:
        where = f" nor in {include_path}" if include_path else " (--include-path DIR adds task YAMLs)"
        raise HarnessError(f"--tasks: {', '.join(map(repr, unknown))}: not a task, group or tag of "
                           f"lm-evaluation-harness {metadata.version('lm_eval')}{where}, nor a YAML file")
    return manager


def scores_of(results: dict[str, dict[str, Any]]) -> Scores:
    """lm_eval's per-task results as {task: {metric: value}}: its "acc,none" keys named "acc" (other filters kept,
    "exact_match,strict-match"), and only numbers (a stderr it could not compute is the string "N/A")."""
    return {task: {key.removesuffix(",none"): float(value) for key, value in entry.items()
                   if "," in key and isinstance(value, int | float)}
            for task, entry in results.items()}


def _local_files(value: Any) -> list[str]:
    """The paths on disk in a dataset_path, data_files (a path, a list, or split → paths) or data_dir value."""
    if isinstance(value, str):
        return [value] if Path(value).exists() else []
    if isinstance(value, dict):
        value = list(value.values())
    return [p for item in value for p in _local_files(item)] if isinstance(value, list) else []


def data_inputs(configs: dict[str, dict[str, Any]], memo: Path) -> dict[str, str]:
    """Fingerprints of the local data the tasks read: a task's data edited in place must not be reused."""
    paths: set[str] = set()
    for cfg in configs.values():
        kwargs = cfg.get("dataset_kwargs") or {}
        for value in (cfg.get("dataset_path"), kwargs.get("data_files"), kwargs.get("data_dir")):
            paths.update(_local_files(value))
    return {p: fingerprint(p, memo) for p in sorted(paths)}


def reusable(path: Path, checkpoint: str, settings: dict[str, Any], memo: Path) -> dict[str, Any] | None:
    """A model's kept result, if made from the same checkpoint content, settings and task data."""
    try:
        kept = read_json(path)
    except (OSError, json.JSONDecodeError):
        return None
    if kept.get("fingerprint") != checkpoint or kept.get("settings") != settings:
        return None
    if any(fingerprint(p, memo) != digest for p, digest in kept.get("data", {}).items()):
        return None
    return kept


def markdown(summary: dict[str, dict[str, Scores]], settings: dict[str, Any]) -> str:
    """The report section: one row per task and metric, one column per model, "value ± stderr"."""
    models = list(summary)
    rows = list(dict.fromkeys((task, metric) for scores in summary.values() for task, metrics in scores.items()
                              for metric in metrics if "_stderr" not in metric.partition(",")[0]))
    limit = f", at most {settings['limit']:g} rows per task" if settings["limit"] is not None else ""
    lines = [SECTION, "", f"lm-evaluation-harness {settings['lm_eval']}: {', '.join(settings['tasks'])}{limit}; "
             "± is the harness's standard error.", "",
             "| task | metric | " + " | ".join(models) + " |", "|---" * (len(models) + 2) + "|"]
    for task, metric in rows:
        name, sep, flt = metric.partition(",")
        cells = []
        for model in models:
            metrics = summary[model].get(task, {})
            stderr = metrics.get(f"{name}_stderr{sep}{flt}")
            cells.append("–" if metric not in metrics else
                         f"{metrics[metric]:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else ""))
        lines.append(f"| {task} | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def without_section(text: str) -> str:
    """report.md without a section this command wrote before (up to the next `## ` heading)."""
    lines = text.splitlines()
    if SECTION not in lines:
        return text
    start = lines.index(SECTION)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[:start] + lines[end:]).rstrip("\n") + "\n"


def fold_into_report(run: RunDir, summary: dict[str, dict[str, Scores]], section: str) -> Path:
    """Add the scores to report.json and the section to report.md, or write harness.md when the run has no report.

    The evaluate stage's record names report.json and report.md by digest; an intact report is re-recorded with
    its new digests, so a resumed `featcal run` keeps it (with this section) instead of evaluating again."""
    if not (run / "report.json").is_file():
        write_bytes(run / "harness.md", section.encode())
        return run / "harness.md"
    record = run.record("evaluate")
    outputs = record["outputs"] if record else {}
    intact = bool(outputs) and all(run.exists(rel) and run.digest(rel) == outputs[rel]
                                   for rel in REPORT_OUTPUTS if rel in outputs)
    write_json(run / "report.json", {**read_json(run / "report.json"), "harness": summary})
    text = without_section((run / "report.md").read_text()) if (run / "report.md").is_file() else ""
    write_bytes(run / "report.md", (text.rstrip("\n") + "\n\n" + section).lstrip("\n").encode())
    remove(run / "harness.md")
    if intact and record is not None:
        run.save_record({**record, "outputs": {**outputs, **{rel: run.digest(rel) for rel in REPORT_OUTPUTS
                                                             if rel in outputs}}})
    return run / "report.md"


def _scored(lm_eval: ModuleType, manager: Any, checkpoint: Path, settings: dict[str, Any], batch_size: int,
            device: str) -> dict[str, Any]:
    """lm_eval's answer for one checkpoint, in its own dtype, read from disk only."""
    answer = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(checkpoint), "dtype": "auto", "local_files_only": True},
        tasks=settings["tasks"], task_manager=manager, limit=settings["limit"], batch_size=batch_size,
        device=device, log_samples=False)
    return {key: answer[key] for key in KEPT if key in answer}


def _models_scored(run: RunDir, cfg: RunConfig, models: dict[str, Path], settings: dict[str, Any],
                   include_path: str | None, batch_size: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """(model, its kept result) for each model: the result on disk when still valid, else a fresh one."""
    memo = run / "records" / "fingerprints.json"
    lm_eval = manager = None
    device = ""
    for n, (name, checkpoint) in enumerate(models.items(), start=1):
        path = run / "harness" / f"{name}.json"
        digest = fingerprint(checkpoint, memo)
        kept = reusable(path, digest, settings, memo)
        if kept is not None:
            log.info("harness [%d/%d] %s: reused %s (checkpoint, tasks and data unchanged)", n, len(models), name,
                     path.relative_to(run.root))
            yield name, kept
            continue
        if lm_eval is None:  # the first model to score: lm_eval, its task registry and the run's device
            lm_eval = _lm_eval()
            manager = task_manager(lm_eval, settings["tasks"], include_path)
            device = str(resolve_device(cfg.runtime.device))
        log.info("harness [%d/%d] %s: scoring %s on %s", n, len(models), name, checkpoint, device)
        started = time.perf_counter()
        answer = _scored(lm_eval, manager, checkpoint, settings, batch_size, device)
        seconds = time.perf_counter() - started
        kept = {"model": name, "checkpoint": str(checkpoint), "fingerprint": digest, "settings": settings,
                "data": data_inputs(answer.get("configs", {}), memo), "device": device, "batch_size": batch_size,
                "seconds": round(seconds, 2), "scores": scores_of(answer["results"]), "lm_eval": answer}
        write_json(path, kept)
        log.info("harness [%d/%d] %s: done in %.1fs", n, len(models), name, seconds)
        yield name, kept


def eval_harness(run_dir: str | Path, tasks: list[str], models: list[str] | None = None,
                 include_path: str | None = None, limit: float | None = None, batch_size: int = 1) -> str:
    """Score the run's models on lm-evaluation-harness `tasks` and fold the scores into its report; returns the
    report section written. The run directory is held (as `featcal run` holds it) throughout."""
    run_dir = Path(run_dir).resolve()
    cfg = run_config(run_dir)
    chosen = checkpoints(run_dir, cfg, list(models or DEFAULT_MODELS))
    if not tasks:
        raise HarnessError("--tasks: name at least one lm-evaluation-harness task")
    if include_path is not None and not Path(include_path).is_dir():
        raise HarnessError(f"--include-path {include_path}: no such directory")
    run = RunDir(run_dir)
    with run.lock():
        memo = run / "records" / "fingerprints.json"
        task_files = [p for p in (include_path, *tasks) if p and Path(p).exists()]
        try:
            version = metadata.version("lm_eval")
        except metadata.PackageNotFoundError:
            raise HarnessError(f"lm-evaluation-harness is not installed: {INSTALL}") from None
        settings = {"tasks": list(tasks), "limit": limit, "lm_eval": version,
                    "task_files": {str(Path(p).resolve()): fingerprint(p, memo) for p in task_files}}
        summary = {name: kept["scores"] for name, kept in _models_scored(run, cfg, chosen, settings, include_path,
                                                                         batch_size)}
        write_json(run / "harness.json", summary)
        section = markdown(summary, settings)
        where = fold_into_report(run, summary, section)
        log.info("harness: scores in %s, table in %s", run / "harness.json", where)
        return section
