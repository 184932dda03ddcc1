"""What the hub benchmarks (CLIP ViT-B/32, FLAN-T5 GLUE, MergeBench) share: a spec that reads models and data from
the hub or a local mirror laid out under their hub names, every source checked before any work (a mirror's paths
exist; hub ids fetched into, or found in, the local Hugging Face cache: featcal/hub.py), loads whose failure says in
one line which source and how to reach it, and the stage that copies each expert.

From the hub, every stage reads the snapshot directory of its repository in the cache, so a stage's key is the
content of what it reads, as with a mirror."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import datasets
from pydantic import ConfigDict, Field, field_validator

from featcal.config import digest_of
from featcal.hub import local_dir, resolve
from featcal_bench.layout import expert_dir
from featcal_bench.recipe import BuildOptions, Call, SavedSpec, Stage
from storage.atomic import atomic_path
from storage.fingerprint import fingerprint
from storage.rundir import Record

log = logging.getLogger("featcal")

MODELS_FLAG, DATA_FLAG = "--models-from", "--data-from"
T = TypeVar("T")
S = TypeVar("S", bound="MirroredSpec")


class MirrorMissing(FileNotFoundError):
    """A path the benchmark expects in a local mirror is not there."""


class MirroredSpec(SavedSpec):
    """A build of a hub benchmark: its tasks, split sizes, seed, and where models and data come from (the hub when
    `models_from` / `data_from` are None, else a local mirror). Subclasses name their spec file, known tasks, base
    model, each task's expert and dataset, and how to fill a mirror's dataset directory."""

    model_config = ConfigDict(extra="forbid")
    KNOWN_TASKS: ClassVar[Sequence[str]]
    BASE_MODEL: ClassVar[str]

    name: str
    tasks: list[str]
    calibration: int = Field(256, ge=1, description="calibration pool per task: a seeded subset of its train split")
    test_rows: int | None = Field(None, ge=1, description="a seeded subset of each test split; None: all of it")
    seed: int = 0
    models_from: str | None = None
    data_from: str | None = None

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, tasks: list[str]) -> list[str]:
        unknown = sorted(set(tasks) - set(cls.KNOWN_TASKS))
        if unknown or not tasks:
            raise ValueError(f"unknown or no tasks {unknown}; known: {sorted(cls.KNOWN_TASKS)}")
        return sorted(set(tasks))

    def model_source(self, hub_id: str) -> str:
        """Where `from_pretrained` reads hub model `hub_id`: its mirror directory, or its snapshot in the cache."""
        return str(Path(self.models_from) / hub_id) if self.models_from else local_dir(hub_id)

    def expert_id(self, task: str) -> str:
        """The hub id of the task's expert."""
        raise NotImplementedError

    def dataset_id(self, task: str) -> tuple[str, str | None]:
        """The hub id of the task's dataset and its configuration (None: its default)."""
        raise NotImplementedError

    def data_source(self, task: str) -> str:
        """Where the build reads the task's data: a mirror directory, or the dataset's snapshot in the cache."""
        return str(Path(self.data_from) / self.mirror_data_path(task)) if self.data_from else \
            local_dir(self.dataset_id(task)[0], "dataset")

    def mirror_data_path(self, task: str) -> str:
        """The task's dataset directory in a mirror, relative to its root."""
        return self.dataset_id(task)[0]

    def data_name(self, task: str) -> str:
        """How messages and records name the task's data: the mirror directory, or the hub id at its commit."""
        dataset, config = self.dataset_id(task)
        if self.data_from:
            return self.data_source(task)
        return f"{dataset}@{Path(self.data_source(task)).name}" + (f" ({config})" if config else "")

    def data_fill(self, task: str) -> str:
        """How to fill the task's dataset directory in a mirror."""
        raise NotImplementedError

    def check_mirror(self) -> None:
        """Every path the build will read from a mirror exists: checked before any work, the first missing one named
        with its flag and how to fill it."""
        wanted = [
            (self.models_from, MODELS_FLAG, self.model_source(h), f"`huggingface-cli download {h} --local-dir DIR`")
            for h in [self.BASE_MODEL, *(self.expert_id(t) for t in self.tasks)]
        ]
        wanted += [(self.data_from, DATA_FLAG, self.data_source(t), self.data_fill(t)) for t in self.tasks]
        check_paths(wanted)
        # Hub sources: fetched now (or found in the cache offline), each checked to hold what the build reads. The
        # builds re-save every model with save_pretrained, so a repository holding only pytorch_model.bin is converted.
        fetched = [] if self.models_from else [resolve(h, f"model {h}", convert_bin=True) for h in [
            self.BASE_MODEL, *(self.expert_id(t) for t in self.tasks)]]
        fetched += [] if self.data_from else [resolve(self.dataset_id(t)[0], f"data of {t}", "dataset",
                                                      self.dataset_id(t)[1]) for t in self.tasks]
        hub = [r for r in fetched if r is not None]  # resolve gives None only for a local path
        if hub:
            log.info("%d hub sources: %.3f GiB in the cache, %.3f GiB downloaded now", len(hub),
                     sum(r.size for r in hub) / 1024**3, sum(r.downloaded for r in hub) / 1024**3)


def check_paths(wanted: Sequence[tuple[str | None, str, str, str]]) -> None:
    """Each (mirror root, its flag, path, how to fill it) whose root is given exists; else the first missing one is
    named, in one line, with its flag and how to fill it."""
    missing = [(root, flag, path, fill) for root, flag, path, fill in wanted if root and not Path(path).is_dir()]
    if missing:
        root, flag, path, fill = missing[0]
        more = f" ({len(missing) - 1} more path(s) missing)" if len(missing) > 1 else ""
        raise MirrorMissing(f"{flag} {root}: {path} does not exist; expected the hub's {Path(path).relative_to(root)} "
                            f"there ({fill}){more}")


def preset_spec(preset: S, models_from: str | None = None, data_from: str | None = None,
                tasks: list[str] | None = None, test_rows: int | None = None) -> S:
    """`preset` with the command line's choices; a bad choice, or a mirror path that is missing, is named now, in one
    line, before any work."""
    known = preset.KNOWN_TASKS
    unknown = sorted(set(tasks or []) - set(known))
    if unknown:
        raise ValueError(f"--tasks: {unknown} are not tasks of {preset.name}; its tasks are {sorted(known)}")
    if test_rows is not None and test_rows < 1:
        raise ValueError(f"--test-rows: expected at least 1 row per task, got {test_rows}")
    roots = {"models_from": models_from, "data_from": data_from}
    spec = preset.model_copy(update={
        **{k: str(Path(v).resolve()) if v else None for k, v in roots.items()}, "test_rows": test_rows,
        **({"tasks": sorted(set(tasks))} if tasks else {})})
    spec.check_mirror()
    return spec


def from_source(load: Callable[[], T], source: str, mirrored: bool, flag: str) -> T:
    """`load()`, with a failure turned into one line naming the source and how to reach it."""
    try:
        return load()
    except Exception as exc:
        reach = f"a {flag} mirror path" if mirrored else "its snapshot in the Hugging Face cache"
        raise ValueError(
            f"{source}: cannot load it from {reach}: {str(exc).splitlines()[0] if str(exc) else exc!r}"
        ) from exc


def pretrained(cls: Any, spec: MirroredSpec, hub_id: str) -> Any:
    """`cls.from_pretrained` of hub model `hub_id`, from the mirror when the spec has one."""
    source = spec.model_source(hub_id)
    return from_source(lambda: cls.from_pretrained(source, local_files_only=True), source, bool(spec.models_from),
                       MODELS_FLAG)


def write_pretrained(bench: Path, name: str, spec: MirroredSpec, hub_id: str, model_cls: Any,
                     *processor_classes: Any) -> tuple[list[str], dict[str, Any]]:
    """A build stage: hub model `hub_id` with its tokenizer or processors, re-saved by this transformers as
    bench/name (outputs, info)."""
    model = pretrained(model_cls, spec, hub_id)
    with atomic_path(bench / name) as tmp:
        model.save_pretrained(tmp)
        for cls in processor_classes:
            pretrained(cls, spec, hub_id).save_pretrained(tmp)
    return [name], {"source": spec.model_source(hub_id), "parameters": sum(p.numel() for p in model.parameters())}


def dataset_split(
    source: str, config: str | None, split: str, mirrored: bool, splits: Sequence[str]
) -> datasets.Dataset:
    """Split `split` of dataset directory `source`: a `save_to_disk` directory, or a hub dataset's snapshot (in a
    mirror or the cache) read by `load_dataset` with configuration `config`; `splits` are the ones the benchmark
    reads, named when the split is not there."""
    if mirrored and (Path(source) / "dataset_dict.json").is_file():  # written by save_to_disk
        loaded = from_source(lambda: datasets.load_from_disk(source), source, True, DATA_FLAG)
        if split not in loaded:
            raise ValueError(f"{DATA_FLAG}: {source} has splits {sorted(loaded)}; the benchmark reads {list(splits)}")
        return loaded[split]
    return from_source(lambda: datasets.load_dataset(source, config, split=split), source, mirrored, DATA_FLAG)


def located(presets: Mapping[str, S]) -> Callable[[str, BuildOptions], S]:
    """A hub recipe's `located`: preset `name` with `bench build`'s --models-from, --data-from, --tasks, --test-rows."""
    return lambda name, o: preset_spec(presets[name], o.models_from, o.data_from, o.tasks, o.test_rows)


def expert_stage(spec_type: type[MirroredSpec], load: Callable[[Any, str], Any]) -> Stage:
    """A hub recipe's expert stage: `load(spec, hub_id)` (its model class, in the dtype the files hold) re-saved by
    this transformers under experts/TASK."""

    def write_expert(bench: Path, task: str) -> tuple[list[str], dict[str, Any]]:
        spec = spec_type.load(bench)
        source = spec.model_source(spec.expert_id(task))
        model = load(spec, spec.expert_id(task))
        with atomic_path(bench / expert_dir(task)) as tmp:
            model.save_pretrained(tmp)
        log.info("expert %s: %s", task, source)
        return [expert_dir(task)], {"source": source, "dtype": str(model.dtype)}

    return write_expert


def mirrored_build(kind: str) -> Callable[[Path, Any, Call, str, Path], dict[str, Record]]:
    """The build graph of a hub recipe whose base is its hub model as it stands: `{kind}-base`, then
    `mirrored_task_stages`."""

    def build(bench: Path, spec: Any, stage: Call, code: str, memo: Path) -> dict[str, Record]:
        records = {"base": stage(bench, f"{kind}-base", "base", digest_of(
            [code, "base", fingerprint(spec.model_source(spec.BASE_MODEL), memo)]))}
        records.update(mirrored_task_stages(bench, spec, stage, kind, code, memo))
        return records

    return build


def mirrored_task_stages(bench: Path, spec: Any, stage: Call, kind: str, code: str, memo: Path) -> dict[str, Record]:
    """A hub recipe's `{kind}-data` and `{kind}-expert` stages, one of each per task, each cached on its source's
    fingerprint (a mirror's content, or a hub id's name)."""
    records = {}
    for t in spec.tasks:
        records[f"data/{t}"] = stage(
            bench,
            f"{kind}-data",
            f"data/{t}",
            digest_of(
                [code, "data", t, spec.calibration, spec.test_rows, spec.seed, fingerprint(spec.data_source(t), memo)]
            ),
            task=t,
        )
    for t in spec.tasks:
        records[f"expert/{t}"] = stage(bench, f"{kind}-expert", f"expert/{t}", digest_of(
            [code, "expert", t, fingerprint(spec.model_source(spec.expert_id(t)), memo)]), task=t)
    return records
