"""Checks made before any work starts, so a bad input fails in seconds with a clear message."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
from transformers import AutoConfig, AutoTokenizer

from featcal.adapters import Adapter, adapter_for
from featcal.calibration_methods import METHODS, calibration_method
from featcal.config import ConfigError, DataSource, FeatCalConfig, RunConfig
from featcal.data import DataError, InputBuilder, load_split
from featcal.devices import bf16_warning, check_keep_freed_memory, resolve_device
from featcal.hub import Resolved, hub_ref, local_dir, resolve
from featcal.input_checks import (
    label_names_check,
    label_range_error,
    pad_with_eos,
    safetensors_header_error,
    text_length_limit,
    text_type_error,
)
from featcal.modeling import Skeleton, expert_checkpoint
from featcal.setup_checks import check_lora_head, setup_warnings, strict_refusal
from featcal.t5 import answer_kind
from featcal.zeroshot import class_names
from featcal_kernels.bf16 import cpu_has_native_bf16
from storage.activations import ActivationError, ActivationStore
from storage.checkpoint import CanonicalCheckpoint, CheckpointError
from storage.lora import LoraCheckpoint, config_directory, is_lora_adapter
from tasks.head_refit import heads_left, shared_head

log = logging.getLogger("featcal")
GIB = 1024**3
Opened = TypeVar("Opened")


def _inputs(cfg: RunConfig) -> list[tuple[str, str, str, DataSource | None, Callable[[str], None]]]:
    """Every input path of `cfg` that may be a hub id: (field, value, repo type, data source or None, setter)."""
    def setter(obj: Any, attr: str) -> Callable[[str], None]:
        return lambda value: setattr(obj, attr, value)

    def expert(task: str) -> Callable[[str], None]:
        return lambda value: cfg.experts.__setitem__(task, value)

    found: list[tuple[str, str, str, DataSource | None, Callable[[str], None]]] = [
             ("base", cfg.base, "model", None, setter(cfg, "base")),
             *((f"experts.{t}", cfg.experts[t], "model", None, expert(t)) for t in cfg.tasks)]
    if cfg.zero_shot is not None:
        found.append(("zero_shot.clip_model", cfg.zero_shot.clip_model, "model", None,
                      setter(cfg.zero_shot, "clip_model")))
    if cfg.merge.path is not None:
        found.append(("merge.path", cfg.merge.path, "model", None, setter(cfg.merge, "path")))
    sections = [("calibration.data", cfg.calibration.data), *_shared_pool(cfg)]
    if cfg.evaluation.enabled:
        sections.append(("evaluation.data", cfg.evaluation.data))
    found += [(f"{section}.{task}.path", source.path, "dataset", source, setter(source, "path"))
              for section, by_task in sections for task, source in by_task.items()]
    return found


def hub_inputs(cfg: RunConfig) -> list[Resolved]:
    """Every hub id among the inputs fetched (or found in the cache), checked to hold what the run reads, and pinned
    in `cfg` to the commit resolved (`org/name@<commit>`), so run.yaml and the cache keys name the exact revision."""
    resolved = []
    for field, value, repo_type, source, pin in _inputs(cfg):
        hit = resolve(value, field, repo_type, source.config if source else None)
        if hit is not None:
            resolved.append(hit)
            pin(hit.pinned)
    return resolved


def hub_summary(resolved: list[Resolved]) -> str | None:
    """One line: the hub inputs, their size on disk and what was downloaded for them."""
    if not resolved:
        return None
    size, fetched = sum(r.size for r in resolved), sum(r.downloaded for r in resolved)
    return (f"{len(resolved)} hub input(s), {size / GIB:.3f} GiB in the cache ({fetched / GIB:.3f} GiB downloaded "
            "now): " + ", ".join(f"{r.pinned[:len(r.repo_id) + 9]}" for r in resolved))


def localized(cfg: RunConfig) -> RunConfig:
    """A copy of `cfg` whose hub inputs are their snapshot directories: what the checks read."""
    local = cfg.model_copy(deep=True)
    for _, value, repo_type, _, set_path in _inputs(local):
        set_path(local_dir(value, repo_type))
    return local


def _config(path: str, field: str):
    if not Path(path).is_dir():
        what = "is a file, not a checkpoint directory" if Path(path).exists() else "does not exist"
        raise CheckpointError(f"{field}: checkpoint directory {path} {what} (expected a local directory or a hub id)")
    if not (Path(path) / "config.json").is_file():
        raise CheckpointError(f"{field}: checkpoint directory {path} has no config.json; expected a checkpoint saved "
                              "with save_pretrained (config.json beside its weights)")
    broken = safetensors_header_error(path)
    if broken:
        raise CheckpointError(f"{field}: {broken}")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise CheckpointError(f"{field}: cannot read the config of {path}: {exc}") from exc


def body_signature(ckpt: CanonicalCheckpoint | LoraCheckpoint, adapter: Adapter) -> dict[str, tuple[int, ...]]:
    return {n: ckpt.shape(n) for n in ckpt.names() if not adapter.is_head(n)}


def _expert_config(cfg: RunConfig, task: str):
    """Expert `task`'s config: its own, or for a LoRA adapter without one, the base's (storage/lora.py)."""
    return _config(str(config_directory(cfg.experts[task], cfg.base)), f"experts.{task}")


def _named(field: str, opened: Callable[[], Opened]) -> Opened:
    """`opened()`; a CheckpointError it raises (a LoRA adapter's base, modules, shapes; a layout not of the adapter's
    family) as one line naming the config field the checkpoint came from."""
    try:
        return opened()
    except CheckpointError as exc:
        raise CheckpointError(f"{field}: {exc}") from None


def _expert_checkpoint(cfg: RunConfig, task: str, adapter: Adapter) -> CanonicalCheckpoint | LoraCheckpoint:
    """Expert `task`'s tensors, its problems named by its field."""
    path = cfg.experts[task]
    if not is_lora_adapter(path):
        return _named(f"experts.{task}", lambda: CanonicalCheckpoint(path, adapter))
    return _named(f"experts.{task}", lambda: expert_checkpoint(path, cfg.base, Skeleton(_expert_config(cfg, task))))


def check_same_body(field: str, config, ckpt: CanonicalCheckpoint | LoraCheckpoint, adapter: Adapter,
                    base: dict[str, tuple[int, ...]]) -> None:
    """The checkpoint of config field `field` has the base's body tensors: the same names, none missing or extra, and
    the same shapes (`check_family` has passed)."""
    body = body_signature(ckpt, adapter)
    missing, extra = sorted(set(base) - set(body)), sorted(set(body) - set(base))
    if missing or extra:
        raise CheckpointError(
            f"{field}: tensor names differ from the base: missing {missing[:5]}, not in base {extra[:5]}"
            f"{' (and more)' if len(missing) > 5 or len(extra) > 5 else ''}"
        )
    for name, shape in body.items():
        if shape != base[name]:
            raise CheckpointError(f"{field}: tensor {name} has shape {shape}, the base has {base[name]}")


def check_family(field: str, config, adapter: Adapter) -> None:
    """The checkpoint of config field `field` is of the base's architecture family: told by its config, before any
    of its tensors is read under the family's names."""
    if adapter_for(config).model_types != adapter.model_types:
        raise CheckpointError(f"{field}: a {config.model_type} model, but base is a {adapter.model_types[0]} model")


def check_checkpoints(cfg: RunConfig) -> Adapter:
    """Every expert, and a `given` merge, must share the base's architecture family and body tensors (names and
    shapes)."""
    first = cfg.tasks[0]
    adapter = adapter_for(_expert_config(cfg, first))
    base_cfg = _config(cfg.base, "base")
    if adapter_for(base_cfg).model_types != adapter.model_types:
        raise CheckpointError(f"base is a {base_cfg.model_type} model but experts.{first} is a "
                              f"{adapter.model_types[0]} model")
    base = body_signature(CanonicalCheckpoint(cfg.base, adapter), adapter)
    for task in cfg.tasks:
        config = _expert_config(cfg, task)  # first: it refuses an unreadable safetensors header in one line
        check_family(f"experts.{task}", config, adapter)
        expert = _expert_checkpoint(cfg, task, adapter)
        check_same_body(f"experts.{task}", config, expert, adapter, base)
        check_lora_head(task, cfg.experts[task], Skeleton(config), expert)
    if cfg.merge.method == "given" and cfg.merge.path is not None:  # the config requires the path with "given"
        config = _config(cfg.merge.path, "merge.path")  # a missing directory named before its tensors are read
        check_family("merge.path", config, adapter)
        given = cfg.merge.path
        check_same_body("merge.path", config, _named("merge.path", lambda: CanonicalCheckpoint(given, adapter)),
                        adapter, base)
    return adapter


def given_dtype_notice(cfg: RunConfig, adapter: Adapter) -> list[str]:
    """A `given` merge stored in other dtypes than the base is written to merged/ in the base's: said once."""
    if cfg.merge.method != "given" or cfg.merge.path is None:
        return []
    base, given = CanonicalCheckpoint(cfg.base, adapter), CanonicalCheckpoint(cfg.merge.path, adapter)
    differ = sorted({(str(given.dtype(n)), str(base.dtype(n))) for n in body_signature(base, adapter)
                     if given.dtype(n) != base.dtype(n)})
    if not differ:
        return []
    pairs = ", ".join(f"{g.removeprefix('torch.')} → {b.removeprefix('torch.')}" for g, b in differ)
    return [f"merge.path: {cfg.merge.path} stores tensors in other dtypes than the base; merged/ takes the base's "
            f"({pairs})"]


# featcal.* options that change what one method solves; set under another method, they would be ignored in silence
METHOD_OPTIONS = ("calibrate_head_side", "task_weights", "task_weight_power", "trust", "head_metric")


def _shared_pool(cfg: RunConfig) -> list[tuple[str, dict[str, DataSource]]]:
    """calibration.shared_inputs.pool as a data section (one source, named `pool`) when shared inputs are on."""
    shared = cfg.calibration.shared_inputs
    return [("calibration.shared_inputs", {"pool": shared.pool})] if shared.weights and shared.pool else []


def check_shared_inputs(cfg: RunConfig, adapter: Adapter) -> None:
    """calibration.shared_inputs: FeatCal's solve of an encoder or decoder-only model (an encoder–decoder's targets
    are per task; RegMean's Grams take no weighted foreign rows)."""
    weight = cfg.calibration.shared_inputs.weight
    if not cfg.calibration.shared_inputs.weights:
        return
    if cfg.featcal.method != "featcal":
        raise ConfigError(f"calibration.shared_inputs.weight: {weight} needs featcal.method featcal, not "
                          f"{cfg.featcal.method}; expected weight 0")
    if adapter.has_decoder:
        raise ConfigError(f"calibration.shared_inputs.weight: {weight} is not for encoder–decoders "
                          f"({adapter.architecture}: each task's decoder targets are its own); expected weight 0")


def check_method_reads(cfg: RunConfig) -> None:
    """Each of METHOD_OPTIONS set away from its default must be read by the run's calibration method."""
    fc = cfg.featcal
    reads = calibration_method(fc).keys
    for key in METHOD_OPTIONS:
        default = FeatCalConfig.model_fields[key].get_default(call_default_factory=True)
        if key not in reads and getattr(fc, key) != default:
            readers = " or ".join(sorted(n for n, method in METHODS.items() if key in method.keys))
            raise ConfigError(f"featcal.{key}: only with featcal.method {readers}, not {fc.method}")


def check_head_side(cfg: RunConfig, adapter: Adapter) -> None:
    """featcal.calibrate_head_side needs an architecture with a head side whose tensors the base has."""
    if not cfg.featcal.calibrate_head_side:
        return
    path = adapter.head_side_path()
    if not any(n.startswith(f"{path}.") for n in CanonicalCheckpoint(cfg.base, adapter).names()):
        raise CheckpointError(f"featcal.calibrate_head_side: base {cfg.base} has no {path} tensors to calibrate")


def check_head_metric(cfg: RunConfig, adapter: Adapter) -> None:
    """featcal.head_metric needs an architecture whose head path is known, the head tensors it will read, and no
    head-side calibration (the metric reads the experts' pooler, which that would change). Those tensors are each
    expert's, or, where every task reads the merged head (causal LMs), the base's: the merge makes its head from them,
    and the experts' are never read. With zero_shot the heads are made by the merge from the class names, and the
    path to them reads the base's post_layernorm (merged from it)."""
    if not cfg.featcal.head_metric:
        return
    adapter.head_input_module()
    if cfg.featcal.calibrate_head_side:
        raise ConfigError("featcal.head_metric: not with featcal.calibrate_head_side (the metric reads the pooler "
                          "as the experts have it)")
    def read(field: str, tensors: Callable[[], object]) -> None:
        try:
            tensors()
        except CheckpointError as err:
            raise CheckpointError(f"featcal.head_metric: {field}: {err}") from None

    if adapter.head_is_merged:
        read("base", lambda: adapter.head_map(CanonicalCheckpoint(cfg.base, adapter)))
    elif cfg.zero_shot is not None:
        read("base", lambda: CanonicalCheckpoint(cfg.base, adapter).get("post_layernorm.weight"))
    else:
        for task in cfg.tasks:
            read(f"experts.{task}", lambda: adapter.head_map(_expert_checkpoint(cfg, task, adapter)))  # noqa: B023


def check_head_refit(cfg: RunConfig, adapter: Adapter) -> list[str]:
    """featcal.head_refit refits each task's one linear head (a zero-shot head is one): with `true` an expert whose
    head is some other module is refused here, not after the body's calibration; where the heads are left (a merged
    LM head the tasks share; with `auto` also too few examples or a head that is not one linear layer) it is said."""
    setting = cfg.featcal.head_refit
    if setting is False or (setting == "auto" and shared_head(adapter) is not None):  # nothing asked, nothing to say
        return []
    why = heads_left(cfg, adapter, lambda task: _expert_checkpoint(cfg, task, adapter).names())
    return [] if why is None else [why]


def check_zero_shot(cfg: RunConfig) -> list[str]:
    """With `zero_shot`: base and experts are CLIPVisionModels, `clip_model` is the CLIPModel whose vision tower
    the base is, with a tokenizer, and every task has class names. Returns the notice of a tokenizer that pads
    its prompts with EOS."""
    zs = cfg.zero_shot
    if zs is None:
        return []
    clip_config = _config(zs.clip_model, "zero_shot.clip_model")
    kind = adapter_for(clip_config).architecture if clip_config.model_type == "clip" else clip_config.model_type
    if kind != "CLIPModel":
        raise CheckpointError(f"zero_shot.clip_model: {zs.clip_model} is a {kind}; expected a CLIPModel checkpoint "
                              "(its text tower, projections and logit scale make the heads)")
    for field, path in [("base", cfg.base), *((f"experts.{t}", str(config_directory(cfg.experts[t], cfg.base)))
                                              for t in cfg.tasks)]:
        architecture = adapter_for(_config(path, field)).architecture
        if architecture != "CLIPVisionModel":
            raise CheckpointError(
                f"{field}: a {architecture}; with zero_shot, base and every expert must be head-less CLIPVisionModels "
                "(save a CLIPModel's vision tower with "
                "CLIPVisionModel.from_pretrained(CLIP_DIR).save_pretrained(DIR)); "
                "the CLIPModel itself goes in zero_shot.clip_model")
    adapter = adapter_for(clip_config)  # reads the vision tower of a CLIPModel and of a CLIPVisionModel alike
    probe = adapter.probe_key
    ours, base = (CanonicalCheckpoint(path, adapter).get(probe).float() for path in (zs.clip_model, cfg.base))
    if ours.shape != base.shape or not torch.allclose(ours, base, rtol=1e-3, atol=1e-4):
        raise CheckpointError(f"zero_shot.clip_model: its vision tower is not base (tensor {probe} differs); the heads "
                              "must come from the CLIPModel whose vision tower the experts were fine-tuned from")
    try:
        tokenizer = AutoTokenizer.from_pretrained(zs.clip_model, local_files_only=True)
    except Exception as exc:
        raise CheckpointError(f"zero_shot.clip_model: cannot load its tokenizer (the prompts need it): {exc}") from exc
    for task in cfg.tasks:
        class_names(cfg, task)
    padding = pad_with_eos(tokenizer, zs.clip_model, "zero_shot.clip_model")
    return [padding] if padding else []


def max_length_notice(cfg: RunConfig, adapter: Adapter) -> str | None:
    """A `max_length` beyond the base's positions is clamped where inputs are built (featcal/data.py); this says so."""
    asked = cfg.calibration.max_length
    positions = text_length_limit(adapter.config, asked) if "input_ids" in adapter.model_input_names() else asked
    if positions == asked:
        return None
    return (f"calibration.max_length {cfg.calibration.max_length} exceeds the {positions} positions the base accepts; "
            f"texts are truncated to {positions} tokens (calibration and evaluation)")


def _head_labels(cfg: RunConfig, adapter: Adapter, task: str) -> int | None:
    """How many classes the task's scores range over: its class names with zero_shot, else the expert's head
    (None where the expert has no classification head, or a regression head of one output)."""
    if cfg.zero_shot is not None:
        return len(class_names(cfg, task))
    if adapter.language_model or adapter.has_decoder:
        return None
    if not any(adapter.is_head(n) for n in _expert_checkpoint(cfg, task, adapter).names()):
        return None
    num_labels = _expert_config(cfg, task).num_labels
    return num_labels if num_labels > 1 else None


def check_data(cfg: RunConfig, adapter: Adapter, hub_ids: dict[str, str] | None = None) -> list[str]:
    """Refuses what the data holds that would crash a stage or be scored wrongly (a failure of a hub source,
    `hub_ids`: field → pinned id, names the id too); returns the notices of what is taken another way than asked (a
    tokenizer padding with EOS, class names that differ from the head's)."""
    notices: list[str] = []
    sections = [("calibration.data", cfg.calibration.data), *_shared_pool(cfg)]
    if cfg.evaluation.enabled:
        sections.append(("evaluation.data", cfg.evaluation.data))
    for section, sources in sections:
        for task, source in sources.items():
            try:
                for notice in _check_source(cfg, adapter, section, task, source):
                    if notice not in notices:
                        notices.append(notice)
            except DataError as exc:
                hub_id = (hub_ids or {}).get(f"{section}.{task}")
                if hub_id is None:
                    raise
                raise DataError(f"{exc} (hub dataset {hub_id})") from exc
    return notices


def _check_source(cfg: RunConfig, adapter: Adapter, section: str, task: str, source: DataSource) -> list[str]:
    notices: list[str] = []
    where = f"{section}.{task}"
    ds = load_split(source, where)
    if len(ds) == 0:
        raise DataError(f"{where}.path: {source.path} split {source.split!r} has no rows")
    builder = InputBuilder(cfg.base, adapter.model_input_names(), source, cfg.calibration.max_length,
                           ds.column_names, where)
    if builder.padding_notice:
        notices.append(builder.padding_notice)
    if section != "evaluation.data" and cfg.calibration.views.count and (not builder.is_text or adapter.has_decoder):
        raise DataError(f"calibration.views.count: {cfg.calibration.views.count} views need token inputs of an "
                        f"encoder or a causal LM; {where} gives " +
                        ("images" if not builder.is_text else "encoder–decoder inputs") + "; expected views.count 0")
    if builder.is_text and builder.column is not None:
        for column in filter(None, (builder.column, builder.pair_column)):
            wrong = text_type_error(ds, column, where)
            if wrong:
                raise DataError(wrong)
    if section == "evaluation.data" and source.label_column and source.label_column not in ds.column_names:
        raise ValueError(f"{where}.label_column: {source.label_column!r} is not a column ({ds.column_names})")
    label_column = source.label_column if section == "evaluation.data" else None
    num_labels = _head_labels(cfg, adapter, task) if label_column else None
    if label_column and num_labels is not None:
        wrong = label_range_error(ds, label_column, num_labels, where)
        if wrong:
            raise DataError(wrong)
        if cfg.zero_shot is None:  # zero-shot heads are made from the class names themselves
            wrong, differ = label_names_check(ds, label_column, _expert_config(cfg, task).id2label, num_labels,
                                              where, f"experts.{task}")
            if wrong:
                raise DataError(wrong)
            notices += [differ] if differ else []
    if source.target_column is not None and source.target_column not in ds.column_names:
        raise DataError(f"{where}.target_column: {source.target_column!r} is not a column ({ds.column_names})")
    if section == "evaluation.data" and source.label_column and adapter.has_decoder:
        answer_kind(ds.features, source.label_column, cfg.evaluation.label_words.get(task), where)
        try:  # generated answers are read as text
            AutoTokenizer.from_pretrained(cfg.base, local_files_only=True)
        except Exception as exc:
            raise DataError(f"{where}: scoring generated answers needs the base's tokenizer: {exc}") from exc
    return notices


def check_activation_store(cfg: RunConfig) -> None:
    url = cfg.runtime.activation_store
    if url is None:
        return
    try:
        store = ActivationStore(url, cfg.runtime.storage_options)
    except (ImportError, ValueError, TypeError) as exc:  # e.g. "Install s3fs to access S3"
        raise ActivationError(f"runtime.activation_store: {url}: {exc}") from exc
    store.check_writable()


class Checked(NamedTuple):
    """What preflight found: the architecture's adapter, one line for each input taken another way than asked, and
    one for each degenerate set-up (featcal/setup_checks.py: refused with `runtime.strict`)."""

    adapter: Adapter
    notices: list[str]
    warnings: list[str]


# The last config checked in this process: `featcal run` checks before Prefect starts, and the flow's pipeline,
# seconds later, takes that verdict once instead of reading every input again. Any later check reads them anew
# (a long-lived process may run the same config after its files changed).
_just_checked: dict[str, Checked] = {}


def preflight(cfg: RunConfig, quiet: bool = False) -> Checked:
    """Every input checked (each failure one line), hub ids first fetched and pinned (`hub_inputs`); what would make
    the run slow, cut its texts or pad them with EOS, and the degenerate set-ups, are logged unless `quiet`
    (`featcal plan` prints them in its own text; `featcal run` plans quietly, then its pipeline says them once)."""
    device = resolve_device(cfg.runtime.device)  # a device torch cannot reach fails here, not at the first Gram
    check_keep_freed_memory(cfg.runtime.keep_freed_memory)
    slow = bf16_warning(device, cfg.runtime.precision, cpu_has_native_bf16())
    if slow and not quiet:
        log.warning(slow)
    hub = hub_summary(hub_inputs(cfg))  # pins cfg's hub ids to their commits: before its fingerprint
    if hub and not quiet:
        log.info(hub)
    key = cfg.fingerprint()
    if key in _just_checked:
        checked = _just_checked.pop(key)
    else:
        files = localized(cfg)
        found = check_zero_shot(files)
        adapter = check_checkpoints(files)
        found += given_dtype_notice(files, adapter)
        check_method_reads(files)
        check_shared_inputs(files, adapter)
        check_head_side(files, adapter)
        check_head_metric(files, adapter)
        found += check_head_refit(files, adapter)
        found += check_data(files, adapter, {f"{section}.{t}": source.path for section, by_task in (
            ("calibration.data", cfg.calibration.data), ("evaluation.data", cfg.evaluation.data))
            for t, source in by_task.items() if hub_ref(source.path)})
        check_activation_store(files)
        warnings = setup_warnings(files, adapter)  # reads every tensor once: NaN/inf and short data refused here
        if warnings and cfg.runtime.strict:
            raise strict_refusal(warnings)
        notice = max_length_notice(files, adapter)
        checked = Checked(adapter, [notice, *found] if notice else found, warnings)
        _just_checked.clear()
        _just_checked[key] = checked
    for line in [] if quiet else [*checked.notices, *checked.warnings]:
        log.warning(line)
    return checked
