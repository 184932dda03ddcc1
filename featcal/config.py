"""The run configuration: one YAML file, validated by pydantic so every bad field is named."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from featcal import secrets


class ConfigError(ValueError):
    """A configuration problem, with the offending field named in the message."""


def _non_negative_or_auto(value: float | Literal["auto"]) -> float | Literal["auto"]:
    """A strength that is a number >= 0 or chosen without labels ('auto'): λ, the shared inputs' weight."""
    if not isinstance(value, str) and value < 0:
        raise ValueError(f"must be >= 0 or 'auto', got {value}")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class MergeConfig(_Strict):
    """How θ_m is made (featcal/merging.py), or, with `given`, where a merge made elsewhere is read from."""

    method: Literal["task_arithmetic", "ties", "average", "dare_linear", "dare_ties", "tsv_m", "iso_c", "iso_cts",
                    "wudi", "given"] = "task_arithmetic"
    scaling: float = Field(0.3, gt=0, description="s in θ0 + s·merged task vector (ignored by average)")
    ties_top_k: float = Field(0.2, gt=0, le=1, description="ties: int(top_k·n) entries of each task vector kept, "
                              "per tensor (MergeKit's density)")
    ties_merge: Literal["sum", "mean"] = Field("sum", description="ties, dare_ties: the agreeing entries summed, or "
                                               "averaged over the tasks that agree (MergeKit's normalize)")
    density: float = Field(0.5, gt=0, le=1, description="dare_*: each task-vector entry kept with this probability, "
                           "the kept ones divided by it")
    seed: int = Field(42, description="dare_*: the drop masks depend on (seed, task, tensor name) only")
    svd_scaling: float = Field(1.0, gt=0, description="tsv_m, iso_c, iso_cts: α in θ0 + α·Δ (FusionBench's default 1; "
                               "the papers tune it on validation data)")
    iso_common_fraction: float = Field(0.8, ge=0, le=1, description="iso_cts: share of each matrix's k = min(m, n) "
                                       "directions taken from the summed task matrix (the common subspace)")
    wudi_steps: int = Field(300, ge=0, description="wudi: Adam steps per matrix")
    wudi_lr: float = Field(1e-5, gt=0, description="wudi: Adam's learning rate")
    path: str | None = Field(None, description="given: a merged checkpoint of the base's architecture, used as θ_m")

    @model_validator(mode="after")
    def _path_with_given(self) -> MergeConfig:
        if (self.method == "given") != (self.path is not None):
            raise ValueError("merge.path names the merged checkpoint of merge.method given, and only of it "
                             f"(method {self.method}, path {self.path!r})")
        return self


class DataSource(_Strict):
    path: str = Field(description="datasets directory (save_to_disk), a data file, or a hub dataset id")
    config: str | None = Field(None, description="the dataset's configuration (a hub dataset's config name, e.g. "
                               "GLUE's `mnli`); None: its default")
    split: str = "train"
    column: str | None = Field(None, description="raw input column (text/image); default: detected")
    text_pair_column: str | None = None
    label_column: str | None = None
    target_column: str | None = Field(None, description="encoder–decoder calibration: the target sequence (text, or "
                                      "token ids ending in EOS); default: the expert's own greedy output")


class ViewsConfig(_Strict):
    """Extra views of each text calibration example: copies with a random share of their tokens deleted. The expert
    and the merged model read the same views, so they are rows with a target and no label; with few examples a
    task, the last block's solve otherwise rests on one pooled row per example (docs/design.md §2.8)."""

    count: int = Field(0, ge=0, description="views added to each example (0: none; the example itself is kept)")
    drop: float = Field(0.15, gt=0, lt=1, description="share of each view's tokens deleted, never the first "
                              "or last token, a segment's last token, or one of the tokenizer's special tokens")


class SharedInputsConfig(_Strict):
    """Task t's term in every shared solve also reads the other tasks' calibration inputs (and a pool's), through
    expert t on the expert side and the merged model on the merged side: rows with a target and no label, weighted
    below the task's own (docs/design.md §2.12)."""

    weight: float | Literal["auto"] = Field(
        0.0, description="w: task t's moments are its own rows' + w × the foreign rows' (w = 1: the foreign rows "
                         "together count as much as the own rows); 0: off; auto: chosen per module from grid on the "
                         "held-out own rows, with lambda / rho / shrinkage when they are auto (no labels)")
    grid: list[float] = Field(default_factory=lambda: [0.0, 0.1, 0.25, 0.5, 1.0], min_length=1,
                              description="the w values weight auto chooses from")
    pool: DataSource | None = Field(None, description="unlabelled inputs of the same modality, added to every "
                                    "task's foreign rows; None: the other tasks' inputs only")
    pool_examples: int = Field(256, ge=1, description="examples drawn from pool (seeded by calibration.seed)")

    _non_negative_weight = field_validator("weight")(_non_negative_or_auto)

    @field_validator("grid")
    @classmethod
    def _non_negative_grid(cls, grid: list[float]) -> list[float]:
        if min(grid) < 0:
            raise ValueError(f"every value must be >= 0, got {grid}")
        return grid

    @property
    def weights(self) -> list[float]:
        """The w a solve may take: none when off, the one given, or the grid with auto."""
        if self.weight == "auto":
            return list(self.grid)
        return [self.weight] if self.weight else []


class CalibrationConfig(_Strict):
    data: dict[str, DataSource]
    examples_per_task: int = Field(256, ge=1)
    batch_size: int = Field(16, ge=1)
    max_length: int = Field(128, ge=2, description="text: truncate to this many tokens")
    max_target_length: int = Field(16, ge=1, description="encoder–decoder: at most this many target tokens "
                                   "(greedy generation stops there; a target column is truncated to it)")
    seed: int = 42
    views: ViewsConfig = Field(default_factory=ViewsConfig)
    shared_inputs: SharedInputsConfig = Field(default_factory=SharedInputsConfig)


class FeatCalConfig(_Strict):
    """The block-by-block solve. `method` picks the objective (featcal/calibration_methods.py holds one class per
    method: the keys below it reads, its statistics, its solves); the same stages and caches serve them all.

    - featcal: docs/design.md §2 (every field below is used).
    - regmean: W = (Σ_t G̃_t)⁻¹ Σ_t G̃_t W_t per linear module, G_t from expert t's own inputs (its block on
      its own stream). Only linear weights are solved; biases, norms and everything outside the blocks keep
      the merged checkpoint's values, so `merge.method: average` gives the published RegMean (non-linear
      parameters averaged). Uses `regmean_off_diagonal` and `eps`; lambda, rho, alpha, calibrate_bias,
      calibrate_norm, pooled_token_weight are ignored, and task_weights, task_weight_power, trust,
      head_metric and calibrate_head_side are refused (tasks/preflight.py).
    - regmean_plus_plus: as regmean, but G_t comes from expert t's block run on the merged stream, i.e. the
      inputs that flow through the already-solved earlier blocks (forward order, like FeatCal).
    - lot: LOT Merging (arXiv 2505.23859): per linear module W = W0 + T, T = (Σ_t X_tᵀX_t)⁺ Σ_t X_tᵀX_t T_t on
      RegMean's statistics (X_t expert t's own inputs, summed over real tokens), T_t = W_t − W0; each norm's scale
      is the base's plus the per-dimension average of the tasks' scale task vectors weighted by Σ z² of their
      normalised inputs. Biases, norm shifts and everything outside the blocks keep the merged values. It reads no
      key; the refused ones are regmean's.
    """

    method: Literal["featcal", "regmean", "regmean_plus_plus", "lot"] = "featcal"
    regmean_off_diagonal: float = Field(
        0.95, gt=0, le=1, description="RegMean's a: G̃ = a·G + (1−a)·diag(G) (0.95 for encoders; 0.6 for GPT-2)")
    lam: float | Literal["auto"] = Field(
        0.05, alias="lambda", description="ridge strength towards the anchor; auto: chosen per module from "
                                          "lambda_grid on held-out calibration rows (no labels)")
    rho: float | Literal["auto"] = Field(2.2, description="anchor ρ·θ_m + (1−ρ)·θ0; auto: chosen from rho_grid")
    lambda_grid: list[float] = Field(default_factory=lambda: [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0],
                                     min_length=1)
    rho_grid: list[float] = Field(default_factory=lambda: [1.0, 1.5, 2.2, 3.0, 4.0], min_length=1)
    holdout_every: int = Field(4, ge=2, description="with lambda, rho or shrinkage auto: every Nth calibration "
                                                    "example of each task is held out to score the grid")
    holdout_folds: int = Field(
        1, ge=1, description="how many of the holdout_every folds (examples i with i mod N = N−1, N−2, …) each take "
                             "their turn as the held-out rows; the grid's scores are summed over them (cross-"
                             "validation when equal to holdout_every); 1: one held-out fold")
    lambda_choice: Literal["lowest", "one_standard_error"] = Field(
        "lowest", description="with auto and holdout_folds ≥ 2: lowest: the grid point of lowest summed held-out "
                              "score; one_standard_error: then the largest λ within one standard error of it over "
                              "the folds (docs/design.md §2.8)")
    shrinkage: float | Literal["auto"] = Field(
        0.0, description="γ: each task's Gram C_ss and cross term C_st become (1−γ)·C + γ·T, T from shrinkage_target "
                         "(docs/design.md §2.8); 0: off; auto: chosen from shrinkage_grid with lambda and rho")
    shrinkage_target: Literal["identity", "diagonal"] = Field(
        "identity", description="T = tr(C_ss)/d·I (identity) or diag(C_ss) (diagonal)")
    shrinkage_grid: list[float] = Field(default_factory=lambda: [0.0, 0.05, 0.1, 0.2, 0.4], min_length=1)
    alpha: float = Field(0.25, ge=0, le=1)
    eps: float = Field(1.0e-8, gt=0, description="initial Cholesky damping; grows ×10 on failure")
    calibrate_bias: bool = True
    calibrate_norm: bool = True
    pooled_token_weight: float | None = Field(0.01, ge=0, le=1)
    task_weight_power: float = Field(
        0.0, description="c_t ∝ d_t^p: each task's weight in a block's shared solve from its own drift d_t (the "
                         "uncalibrated merged block's relative output error on the task's rows); 0: all alike")
    task_weights: dict[str, float] = Field(
        default_factory=dict, description="c_t per task named here (others 1), multiplying task_weight_power's: a "
                                          "task weighed 4 counts as four copies of that task in every shared solve")
    trust: float = Field(0.0, ge=0, description="μ: each task's term also keeps a linear module's output near the "
                                                "merged module's on that task's rows")
    head_metric: float = Field(
        0.0, ge=0, le=1, description="η: in the last block's module that feeds the head (BERT's output.dense, ViT's "
                                     "mlp.fc2, a Llama-layout LM's mlp.down_proj), each task's output error is "
                                     "measured in (1−η)I + η·H_tᵀH_t (scaled "
                                     "to the same trace), H_t the linear path to the task's logits; 0: off "
                                     "(docs/design.md §2.8)")
    calibrate_head_side: bool = Field(
        False, description="also calibrate the modules between the last block and the head (BERT's pooler, CLIP's "
                           "post_layernorm, a ViT's or decoder's final norm) as one more block")
    head_refit: Literal["auto"] | bool = Field(
        "auto", description="after the body is calibrated, refit each task's own linear head (a classifier, zero-shot "
                            "class embeddings) so that on its calibration rows it maps the calibrated features to the "
                            "expert's logits, ridge towards the expert's head, λ from lambda_grid on held-out rows (no "
                            "labels; docs/design.md §2.11); a head the tasks share (an LM head) is left. auto: refit "
                            "where every task has one linear head and a task has at least 64 calibration examples, "
                            "leave the heads (and say why) otherwise; true: refit, refusing an expert without one")

    _non_negative = field_validator("lam")(_non_negative_or_auto)

    @field_validator("task_weights")
    @classmethod
    def _positive_weights(cls, weights: dict[str, float]) -> dict[str, float]:
        bad = {t: w for t, w in weights.items() if not w > 0}
        if bad:
            raise ValueError(f"every weight must be > 0, got {bad}")
        return weights

    @field_validator("shrinkage")
    @classmethod
    def _a_fraction(cls, gamma: float | Literal["auto"]) -> float | Literal["auto"]:
        if not isinstance(gamma, str) and not 0 <= gamma <= 1:
            raise ValueError(f"must be in [0, 1] or 'auto', got {gamma}")
        return gamma

    @field_validator("shrinkage_grid")
    @classmethod
    def _fractions(cls, grid: list[float]) -> list[float]:
        if min(grid) < 0 or max(grid) > 1:
            raise ValueError(f"every value must be in [0, 1], got {grid}")
        return grid

    @field_validator("lambda_grid")
    @classmethod
    def _positive_grid(cls, grid: list[float]) -> list[float]:
        if min(grid) <= 0:
            raise ValueError(f"every value must be > 0, got {grid}")
        return grid

    @model_validator(mode="after")
    def _folds_within_every(self) -> FeatCalConfig:
        if self.holdout_folds > self.holdout_every:
            raise ValueError(f"holdout_folds ({self.holdout_folds}) must be <= holdout_every ({self.holdout_every}): "
                             "the examples fall into holdout_every folds")
        if self.lambda_choice == "one_standard_error" and self.holdout_folds < 2:
            raise ValueError(f"lambda_choice one_standard_error needs the folds' spread: holdout_folds >= 2 (got "
                             f"{self.holdout_folds})")
        return self


EvaluatedModel = Literal["base", "merged", "calibrated", "expert"]
EVALUATED_MODELS: tuple[EvaluatedModel, ...] = get_args(EvaluatedModel)


class EvaluationConfig(_Strict):
    enabled: bool = True
    data: dict[str, DataSource] = Field(default_factory=dict)
    batch_size: int = Field(32, ge=1)
    max_examples: int | None = Field(None, ge=1)
    models: list[EvaluatedModel] = Field(
        default_factory=lambda: list(EVALUATED_MODELS), min_length=1,
        description="whose accuracy is measured; the expert still runs as the drift reference when merged or "
                    "calibrated is listed, so a benchmark can skip re-scoring base and experts")

    label_words: dict[str, list[str]] = Field(
        default_factory=dict, description="encoder–decoder: per task, the answer word(s) of each class in label-id "
                                          "order; default: the label column's ClassLabel names")
    max_new_tokens: int = Field(16, ge=1, description="encoder–decoder: greedy generation length when scoring")

    @field_validator("models")
    @classmethod
    def _no_repeats(cls, models: list[str]) -> list[str]:
        repeated = sorted({m for m in models if models.count(m) > 1})
        if repeated:
            raise ValueError(f"lists {repeated} more than once")
        return models


# A few generic CLIP prompts. The benchmarks' per-dataset sets (e.g. "a centered satellite photo of {}." for
# EuroSAT) are in the task-arithmetic authors' code, mlfoundations/task_vectors src/datasets/templates.py, which
# FusionBench reuses; put a task's set in `zero_shot.task_templates` to match them.
DEFAULT_TEMPLATES: tuple[str, ...] = (
    "a photo of a {}.", "a bad photo of a {}.", "a photo of the large {}.", "a photo of the small {}.",
    "a cropped photo of a {}.", "a close-up photo of a {}.",
)


class ZeroShotConfig(_Strict):
    """Head-less `CLIPVisionModel` experts, classified by zero-shot heads built from a `CLIPModel`'s text tower
    (featcal/zeroshot.py): the setting of the public CLIP merging benchmarks, whose experts carry no head.

    `base` stays the vision tower the experts were fine-tuned from; `clip_model` is the full CLIPModel it
    belongs to (its text tower, projections, logit scale and tokenizer make the heads)."""

    clip_model: str = Field(description="CLIPModel checkpoint directory whose vision tower is `base`")
    templates: list[str] = Field(default_factory=lambda: list(DEFAULT_TEMPLATES), min_length=1,
                                 description="prompts, each with one {} where the class name goes")
    task_templates: dict[str, list[str]] = Field(
        default_factory=dict, description="per task, its own prompts instead of `templates` (a dataset's set)")
    class_names: dict[str, list[str]] = Field(
        default_factory=dict, description="per task, in label-id order; default: the names of the datasets "
                                          "ClassLabel label column of the task's evaluation data")

    @field_validator("templates")
    @classmethod
    def _one_slot_each(cls, templates: list[str]) -> list[str]:
        for template in templates:
            if template.count("{}") != 1:
                raise ValueError(f"template {template!r} must hold exactly one {{}} where the class name goes")
        return templates

    @field_validator("task_templates")
    @classmethod
    def _one_slot_each_per_task(cls, per_task: dict[str, list[str]]) -> dict[str, list[str]]:
        for task, templates in per_task.items():
            if not templates:
                raise ValueError(f"task {task!r}: expected a non-empty list of templates")
            cls._one_slot_each(templates)
        return per_task

    @field_validator("class_names")
    @classmethod
    def _distinct_names(cls, names: dict[str, list[str]]) -> dict[str, list[str]]:
        for task, listed in names.items():
            if not listed or len(set(listed)) != len(listed):
                raise ValueError(f"task {task!r}: expected a non-empty list of distinct class names, got {listed!r}")
        return names

    def templates_for(self, task: str) -> list[str]:
        return self.task_templates.get(task, self.templates)


# runtime.device: what a run may ask for (featcal/devices.py resolves it against what torch sees).
DEVICE_SPEC = re.compile(r"auto|cpu|cuda(?::([0-9]+))?")
DEVICE_FORMS = "auto, cpu, cuda or cuda:N (N = 0, 1, ...)"


class RuntimeConfig(_Strict):
    keep_activations: bool = False
    threads: int | None = Field(None, ge=1, description="torch CPU threads; default: torch's choice")
    activation_store: str | None = Field(None, description="fsspec URL for this run's activations (s3://bucket/"
                                          "run1, a shared mount, ...); default: the run directory's acts/")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="given to fsspec for "
                                            "activation_store (endpoint_url, ...); credentials: the backend's env vars")
    solve_groups: int = Field(1, ge=1, description="split each block's solve into this many stages of about "
                              "equal cost (the Dask runner runs them at the same time); the weights do not change")
    device: str = Field("auto", description="where block forwards and Gram sums run: auto (cuda:0 when torch sees "
                        "CUDA, else cpu), cpu, cuda or cuda:N; float64 solves move to cpu when the device lacks room")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: activations stored as bf16 (half the disk and I/O) and block forwards in bf16; "
                            "Grams still sum in fp32 within a chunk and float64 across chunks, solves in float64")
    solve_precision: Literal["float64", "mixed"] = Field(
        "float64", description="mixed: each linear solve factors in fp32 and refines against a float64 residual, "
                               "falling back to float64 when refinement stalls (the solve record says which per "
                               "module)")
    row_statistics: Literal["auto", "off"] = Field(
        "auto", description="auto: a module whose calibration rows (all tasks together) are few against its input "
                            "width keeps those rows instead of its in × in Gram, where that makes the Gram and solve "
                            "stages cheaper (featcal's plain objective only; the solve record says 'rows'); off: "
                            "Grams always")
    keep_freed_memory: bool = Field(False, description="glibc keeps the memory a stage frees for the next one (no "
                                    "block mapped on its own, no heap trimming, one arena): fewer page faults, a "
                                    "higher peak RSS; Linux/glibc only (docs/performance.md)")
    input_cache: str | None = Field(None, description="a directory where each task's model inputs (tokenised "
                                     "text, preprocessed images) are kept once per data fingerprint and input "
                                     "settings, for later runs on the same data to copy instead of preparing them "
                                     "again; default: none")
    resident: Literal["auto"] | bool = Field(
        "auto", description="true (on): the boundaries a block's stages write are also kept in memory and read "
                            "from there, and each layer's merged and calibrated blocks are built once (the store is "
                            "still written: resume reads it); auto: on when they fit in half the memory available at "
                            "the start (`featcal plan` says which); false (off): the streaming path. The weights do "
                            "not change")
    strict: bool = Field(False, description="refuse degenerate set-ups (an expert equal to the base, two tasks on one "
                         "checkpoint, calibration rows among the evaluation rows, ...) instead of warning; --strict")

    @field_validator("device")
    @classmethod
    def _device_spec(cls, spec: str) -> str:
        if DEVICE_SPEC.fullmatch(spec) is None:
            raise ValueError(f"{spec!r} is not a device: expected {DEVICE_FORMS}")
        return spec

    @field_validator("activation_store")
    @classmethod
    def _absolute_store(cls, url: str | None) -> str | None:
        if url is not None and "://" not in url and not Path(url).is_absolute():
            raise ValueError(f"{url!r} must be a URL (s3://bucket/prefix, file:///path) or an absolute path")
        return url


class RunConfig(_Strict):
    base: str
    experts: dict[str, str]
    merge: MergeConfig = Field(default_factory=MergeConfig)
    calibration: CalibrationConfig
    featcal: FeatCalConfig = Field(default_factory=FeatCalConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    zero_shot: ZeroShotConfig | None = Field(None, description="head-less CLIPVisionModel experts: zero-shot heads")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)

    @field_validator("experts")
    @classmethod
    def _at_least_one_expert(cls, experts: dict[str, str]) -> dict[str, str]:
        if not experts:
            raise ValueError("needs at least one task: {task_name: checkpoint}")
        for task in experts:
            if not task or "/" in task or task.startswith("."):
                raise ValueError(f"task name {task!r} must be a non-empty name without '/' or leading '.'")
        return experts

    @model_validator(mode="after")
    def _every_task_has_data(self) -> RunConfig:
        missing = sorted(set(self.experts) - set(self.calibration.data))
        if missing:
            raise ValueError(f"calibration.data has no entry for task(s) {missing}; "
                             "every expert needs calibration data")
        extra = sorted(set(self.calibration.data) - set(self.experts))
        if extra:
            raise ValueError(f"calibration.data names task(s) {extra} that are not in experts")
        for field in ("data", "label_words"):
            extra = sorted(set(getattr(self.evaluation, field)) - set(self.experts))
            if extra:
                raise ValueError(f"evaluation.{field} names task(s) {extra} that are not in experts")
        shared = self.calibration.shared_inputs
        if shared.weights and len(self.experts) == 1 and shared.pool is None:
            raise ValueError("calibration.shared_inputs: one task has no other task's inputs to share; give "
                             "shared_inputs.pool or set shared_inputs.weight 0")
        extra = sorted(set(self.featcal.task_weights) - set(self.experts))
        if extra:
            raise ValueError(f"featcal.task_weights names task(s) {extra} that are not in experts")
        for field in ("class_names", "task_templates") if self.zero_shot else ():
            extra = sorted(set(getattr(self.zero_shot, field)) - set(self.experts))
            if extra:
                raise ValueError(f"zero_shot.{field} names task(s) {extra} that are not in experts")
        return self

    @property
    def foreign_examples(self) -> int:
        """The examples each task stores besides its own with calibration.shared_inputs (at most: a short split
        gives fewer): the other tasks' and the pool's; 0 when off."""
        shared = self.calibration.shared_inputs
        if not shared.weights:
            return 0
        pool = shared.pool_examples if shared.pool is not None else 0
        return (len(self.experts) - 1) * self.calibration.examples_per_task + pool

    @property
    def tasks(self) -> list[str]:
        """Tasks in a fixed order (sorted) so every reduction over tasks is deterministic."""
        return sorted(self.experts)

    def slice(self, *sections: str) -> dict[str, Any]:
        """The parts of the config a stage depends on, for its cache key (secrets as their hashes)."""
        dumped = self.redacted()
        return {name: dumped[name] for name in sections}

    def fingerprint(self) -> str:
        """Changes with every value, secrets included, but is computed from their salted hashes only."""
        return digest_of(self.redacted())

    def redacted(self) -> dict[str, Any]:
        """The config as JSON-able data with credential-looking values replaced by placeholders
        (featcal/secrets.py): what `run.yaml` holds. Identical to the plain dump when there are none."""
        return secrets.redact(self.model_dump(mode="json", by_alias=True))


def check_registration(kind: str, section: str, listed: tuple[str, ...], known: frozenset[str], name: str,
                       keys: tuple[str, ...], refused: tuple[str, ...] = ()) -> None:
    """A method class registering under `section.method: name` (featcal.merging, featcal.calibration_methods): the
    config must list the name (`listed`, and it must not be one handled elsewhere, `refused`), and every key it reads
    must be one of `known`, the section's keys, so no key it does not declare can change its result."""
    if name not in listed or name in refused:
        raise ValueError(f"{kind} {name!r}: {section}.method does not accept it (the config lists {', '.join(listed)})")
    unknown = sorted(set(keys) - known)
    if unknown:
        raise ValueError(f"{kind} {name!r} reads {unknown}, which are not {section}.* keys")


def digest_of(obj: Any) -> str:
    """A stable short hash of JSON-able data (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _apply_override(raw: dict[str, Any], assignment: str) -> tuple[str, ...]:
    """Apply `--set KEY.PATH=VALUE` to the raw config; returns the key path it set, or the first section on that
    path it had to make: everything under that came from the option (`--set nope.x=1` makes `nope`, an unknown
    section, and the error must name the option, not the file)."""
    shown = secrets.redact_override(assignment)  # the assignment itself unless it holds a credential
    if "=" not in assignment:
        raise ConfigError(f"--set {shown!r}: expected KEY.PATH=VALUE, e.g. featcal.lambda=0.1")
    dotted, value = assignment.split("=", 1)
    keys = tuple(dotted.strip().split("."))
    node, made = raw, None
    for depth, key in enumerate(keys[:-1]):
        if key not in node and made is None:
            made = keys[: depth + 1]
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {shown!r}: {'.'.join(keys[: depth + 1])} is not a section "
                              f"(the config has {secrets.redact_value(node, keys[: depth + 1])!r} there)")
    try:
        node[keys[-1]] = yaml.safe_load(value)
    except yaml.YAMLError as exc:  # a parse error says where (MarkedYAMLError.problem); others say what they say
        problem = exc.problem if isinstance(exc, yaml.MarkedYAMLError) else exc
        raise ConfigError(f"--set {shown!r}: the value is not valid YAML ({problem})") from None
    return made or keys


def _resolve_paths(cfg: RunConfig, root: Path) -> RunConfig:
    """Relative paths in the YAML are relative to the YAML file, as a user reading it expects."""

    def resolve(path: str) -> str:
        if Path(path).is_absolute():
            return path
        candidate = root / path
        # "./x" and "../x" are always paths; a bare "org/name" may be a hub id unless it exists here.
        return str(candidate.resolve()) if path.startswith(".") or candidate.exists() else path

    cfg.base = resolve(cfg.base)
    cfg.experts = {t: resolve(p) for t, p in cfg.experts.items()}
    if cfg.merge.path is not None:
        cfg.merge.path = resolve(cfg.merge.path)
    pool = [cfg.calibration.shared_inputs.pool] if cfg.calibration.shared_inputs.pool is not None else []
    for source in [*cfg.calibration.data.values(), *pool, *cfg.evaluation.data.values()]:
        source.path = resolve(source.path)
    if cfg.zero_shot is not None:
        cfg.zero_shot.clip_model = resolve(cfg.zero_shot.clip_model)
    return cfg


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{at}: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: expected a mapping at the top level, got {type(raw).__name__}")
    origins = {_apply_override(raw, assignment): f"--set {secrets.redact_override(assignment)}"
               for assignment in overrides}
    return config_from_dict(raw, root=path.parent, source=str(path), origins=origins)


def config_from_dict(raw: dict[str, Any], root: Path, source: str = "config",
                     origins: dict[tuple[str, ...], str] | None = None) -> RunConfig:
    """`origins` maps key paths set outside `source` (by `--set`) to where they came from, for error messages.

    Placeholders of secrets this process knows (featcal/secrets.py) are replaced by their values."""
    raw = secrets.restore(raw)
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(str(p) for p in err["loc"])
            origin = next((o for keys, o in (origins or {}).items() if loc[: len(keys)] == keys), source)
            field = ".".join(loc) or "(top level)"
            got = repr(err.get("input"))
            secret = any(secrets.looks_secret(p) for p in loc) or secrets.redact(err.get("input")) != err.get("input")
            got = f"got {got}, " if loc and len(got) <= 80 and not secret else ""
            problems.append(f"{field}: {err['msg']} ({got}from {origin})")
        raise ConfigError("; ".join(problems)) from None
    return _resolve_paths(cfg, root.resolve())
