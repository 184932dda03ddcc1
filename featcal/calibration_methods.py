"""Calibration methods (`featcal.method`): what each asks of the Gram stage and how it solves one module.

A method is one registered class: its name, the `featcal.*` keys it reads (it is handed those and no others, so a
key it does not declare cannot change its weights), the statistics it needs per module (`StatisticsPlan`), and its
solve of a linear module and of a norm. The Gram and solve stages (tasks/gram.py, tasks/solve.py) walk blocks and
modules and ask the run's method; adding a method is a class here (its name and any new keys go into `FeatCalConfig`
too, where the YAML is validated). `FeatCal` is docs/design.md §2; `RegMean`, `RegMeanPlusPlus` and `LOTMerging`
are its closed-form baselines."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, ClassVar, Literal, get_args

import torch

from featcal.closed_form import (
    BiasTerm,
    Choice,
    Hyper,
    LinearMoments,
    NormMoments,
    choose_foreign_weight,
    choose_linear_hyper,
    choose_linear_hyper_by_weight,
    choose_norm_hyper,
    head_factor,
    head_metric,
    lot_norm_scale,
    numerical_rank,
    solve_linear_bias,
    solve_linear_weight,
    solve_linear_weight_head,
    solve_linear_weight_rows,
    solve_lot_weight,
    solve_norm_affine,
    solve_regmean_weight,
)
from featcal.config import FeatCalConfig, check_registration
from featcal.statistics import (
    fit_sums,
    foreign_sums,
    held_out_sums,
    input_gram_sum,
    linear_moments,
    linear_rows,
    norm_moments,
    norm_sq_sum,
)

Side = Literal["merged", "expert"]


@dataclass(frozen=True)
class StatisticsPlan:
    """What the Gram stage records per module of a block for a method (docs/design.md §2).

    x_s, a module's input in the statistics' first slot, comes from `fit_block`'s uncalibrated block (the merged
    checkpoint's or the task's expert's) run on the `fit_stream` hidden states (S_t: "merged", E_t: "expert").
    With `expert_side`, the second slot is x_e from the expert block on E_t and its moments are kept (C_se or the
    solve's products, μ_e); without, x_s fills both slots and only C_ss, μ_s are used. `pooled_token_weight`: in the
    last block, the weight of tokens other than the pooled one (None: every real token weighs 1).
    `held_out_every`: every Nth example's sums are also kept apart, for choosing hyperparameters on them;
    `held_out_folds` such folds (examples i with i mod N = N − 1, N − 2, …), each kept apart in turn. `rows`: the
    solve takes a module's rows instead of its Gram where they are few (featcal.statistics.row_form_pays)."""

    fit_block: Side
    fit_stream: Side
    expert_side: bool
    pooled_token_weight: float | None = None
    held_out_every: int | None = None
    held_out_folds: int = 1
    rows: bool = False

    def keeps_rows(self, row_statistics: str) -> bool:
        """Whether the Gram stage keeps rows where they pay, under runtime.row_statistics."""
        return self.rows and row_statistics == "auto"

    def __post_init__(self) -> None:
        if self.fit_block == "merged" and self.fit_stream == "expert":
            raise ValueError("StatisticsPlan: the merged block runs on the merged stream only, not on the expert's")


@dataclass(frozen=True)
class ModuleData:
    """One calibrated module of a block, as a solve reads it, filled by the solve stage.

    Tensors are in the solve's layout (a linear weight [out, in]; a norm's γ with the module's offset added) and on
    the solve's device, and each is read when asked for, so a solve holds one expert's at a time. `part` is
    "weight" or "bias"; `expert(t, part)` is task t's, tasks in `tasks` order, as `stats()` yields their sums."""

    where: str  # the module's name in the model, for messages
    tasks: tuple[str, ...]
    task_weights: tuple[float, ...]  # c_t, each task's weight in the shared solve
    has_bias: bool
    stats: Callable[[], Iterator[dict[str, torch.Tensor]]]  # fresh sums at each call: a solve may overwrite them
    merged: Callable[[str], torch.Tensor]
    base: Callable[[str], torch.Tensor]
    expert: Callable[[int, str], torch.Tensor]
    # Task t's head map H_t [classes, out] (Adapter.head_map) where this is the module that feeds the head and
    # featcal.head_metric is on; None elsewhere.
    head: Callable[[int], torch.Tensor] | None = None
    rows: bool = False  # every task's statistics keep this module's rows (featcal.statistics: row form), not sums


def _each_task_stats(module: ModuleData) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(t, task t's sums), one task's at a time if the caller drops them before asking for the next: zip or
    enumerate over `module.stats()` would keep the previous task's (72 MiB for a 3072-wide C_ss) in their reused
    result tuple while the next task's are read."""
    sums = module.stats()
    for t in range(len(module.tasks)):
        yield t, next(sums)


@dataclass(frozen=True)
class Solved:
    """A module's solved parameters (solve layout; parts left out keep the merged values), with the Cholesky damping
    a linear solve used against the `eps` it asked for, and per-module facts for the solve record."""

    tensors: dict[str, torch.Tensor]
    damping: float | None = None
    eps: float | None = None
    report: dict[str, Any] = field(default_factory=dict)


def _unresolved_report(module: ModuleData, directions: int, width: int) -> dict[str, Any]:
    """What the solve record and its warning say of a module whose solve left `directions` of its `width` input
    directions unresolved (featcal.closed_form.unresolved_directions): each task's own numerical rank, so the task whose
    inputs span too little is named. A second read of the statistics, on this rare path only."""
    ranks = {}
    for t, stats in _each_task_stats(module):
        ranks[module.tasks[t]] = numerical_rank(linear_moments(stats, module.where, in_place=True).c_ss)
        del stats
    return {"directions": directions, "width": width, "task_ranks": ranks}


class CalibrationMethod(ABC):
    """One `featcal.method`. `keys` are the `featcal.*` keys (as the YAML names them) it reads from `settings`."""

    name: ClassVar[str]
    keys: ClassVar[tuple[str, ...]]

    def __init__(self, settings: Mapping[str, Any], solve_precision: str = "float64",
                 foreign_weights: Sequence[float] = ()) -> None:
        self.settings = settings
        self.mixed = solve_precision == "mixed"  # runtime.solve_precision: fp32 factor + float64 refinement
        # calibration.shared_inputs: the weights w its foreign rows may take (none: off; several: chosen per module)
        self.foreign_weights = tuple(foreign_weights)

    @property
    @abstractmethod
    def statistics(self) -> StatisticsPlan:
        """What the Gram stage records for this method."""

    @property
    def weighs_tasks(self) -> bool:
        """Whether tasks weigh by their drift and featcal.task_weights rather than all alike."""
        return "task_weight_power" in self.keys

    @property
    def joins_readers(self) -> bool:
        """Whether the linear maps that read one input may be solved as one map with their outputs stacked: true when
        each output row's solve is on its own, from the input's statistics alone (one system matrix for all rows)."""
        return True

    @abstractmethod
    def solve_linear(self, module: ModuleData) -> Solved:
        """A linear map's weight (and bias, if the method solves it)."""

    @abstractmethod
    def solve_norm(self, module: ModuleData) -> Solved | None:
        """A norm's affine, or None to keep the merged one."""


METHODS: dict[str, type[CalibrationMethod]] = {}
CONFIG_METHODS: tuple[str, ...] = get_args(FeatCalConfig.model_fields["method"].annotation)
CONFIG_KEYS = frozenset(f.alias or name for name, f in FeatCalConfig.model_fields.items()) - {"method"}


def register(cls: type[CalibrationMethod]) -> type[CalibrationMethod]:
    """Make `cls` the method of `featcal.method: cls.name`; the config must accept that name and every key."""
    check_registration("calibration method", "featcal", CONFIG_METHODS, CONFIG_KEYS, cls.name, cls.keys)
    METHODS[cls.name] = cls
    return cls


def calibration_method(fc: FeatCalConfig, solve_precision: str = "float64",
                       foreign_weights: Sequence[float] = ()) -> CalibrationMethod:
    """The method `fc.method` names, handed the values of the keys it declares (and runtime.solve_precision, and the
    foreign rows' weights of calibration.shared_inputs: SharedInputsConfig.weights)."""
    cls = METHODS.get(fc.method)
    if cls is None:
        known = ", ".join(sorted(METHODS))
        raise ValueError(f"featcal.method: unknown calibration method {fc.method!r}; known: {known}")
    values = fc.model_dump(by_alias=True)
    return cls(MappingProxyType({key: values[key] for key in cls.keys}), solve_precision, foreign_weights)


def _fit_and_held(stats: dict[str, torch.Tensor], task: str, where: str, every: int,
                  fold: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A module's sums over one task's fit rows and over its held-out rows (fold `fold` of every `every`-th
    example)."""
    held = held_out_sums(stats, fold)
    if float(held["sum_w"]) <= 0:
        raise ValueError(f"{where}, task {task}: no held-out calibration rows in fold {fold} to choose "
                         f"featcal.lambda / rho (every {every}th example is held out, one fold per "
                         f"featcal.holdout_folds; calibration.examples_per_task must be >= featcal.holdout_every)")
    return fit_sums(stats, fold), held


def _task_moments(stats: dict[str, torch.Tensor], where: str, c: float, w: float,
                  in_place: bool = False) -> LinearMoments:
    """A task's linear moments from its sums: its own rows' and, at weight w, its foreign rows' (shared inputs)."""
    own = replace(linear_moments(stats, where, in_place), weight=c)
    foreign = foreign_sums(stats) if w else None
    return own.with_foreign(None if foreign is None else linear_moments(foreign, where, in_place), w)


def _task_norm_moments(stats: dict[str, torch.Tensor], where: str, c: float, w: float) -> NormMoments:
    """As _task_moments for a norm."""
    own = replace(norm_moments(stats, where), weight=c)
    foreign = foreign_sums(stats) if w else None
    return own.with_foreign(None if foreign is None else norm_moments(foreign, where), w)


def _head_factors(head_map: Callable[[int], torch.Tensor], tasks: int) -> list[torch.Tensor]:
    """Each task's U_t (head_factor), computed once per head map: where every task reads one head (a causal LM's
    merged LM head) they all get the same tensor."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(H) → (H, U); H is held, so no id is reused
    factors = []
    for t in range(tasks):
        head = head_map(t)
        if id(head) not in made:
            made[id(head)] = (head, head_factor(head))
        factors.append(made[id(head)][1])
    return factors


@register
class FeatCal(CalibrationMethod):
    """docs/design.md §2: linear weights, then biases, and norms, towards each expert's features on the merged
    stream, anchored at ρ·θ_m + (1−ρ)·θ0; λ and ρ fixed or chosen per module on held-out rows ("auto")."""

    name = "featcal"
    keys = ("lambda", "rho", "lambda_grid", "rho_grid", "shrinkage", "shrinkage_target", "shrinkage_grid",
            "holdout_every", "holdout_folds", "lambda_choice", "alpha", "eps", "calibrate_bias",
            "calibrate_norm", "pooled_token_weight", "task_weight_power", "task_weights", "trust", "head_metric",
            "calibrate_head_side")

    def __init__(self, settings: Mapping[str, Any], solve_precision: str = "float64",
                 foreign_weights: Sequence[float] = ()) -> None:
        super().__init__(settings, solve_precision, foreign_weights)
        s = settings
        self.foreign_grid: list[float] = list(foreign_weights) or [0.0]  # w, or its grid (auto); 0: off
        self.lams: list[float] = s["lambda_grid"] if s["lambda"] == "auto" else [s["lambda"]]
        self.rhos: list[float] = s["rho_grid"] if s["rho"] == "auto" else [s["rho"]]
        self.shrinks: list[float] = s["shrinkage_grid"] if s["shrinkage"] == "auto" else [s["shrinkage"]]
        self.choosing = "auto" in (s["lambda"], s["rho"], s["shrinkage"]) or len(self.foreign_grid) > 1
        self.one_standard_error = s["lambda_choice"] == "one_standard_error"
        # With a choice, the solve runs at the module's chosen (λ, ρ, γ); the first grid point otherwise.
        self.hyper = Hyper(lam=self.lams[0], rho=self.rhos[0], alpha=s["alpha"], eps=s["eps"], trust=s["trust"],
                           shrink=self.shrinks[0], shrink_target=s["shrinkage_target"])

    @property
    def statistics(self) -> StatisticsPlan:
        return StatisticsPlan(fit_block="merged", fit_stream="merged", expert_side=True,
                              pooled_token_weight=self.settings["pooled_token_weight"],
                              held_out_every=self.settings["holdout_every"] if self.choosing else None,
                              held_out_folds=self.settings["holdout_folds"] if self.choosing else 1,
                              rows=self.takes_rows)

    @property
    def joins_readers(self) -> bool:
        """Not while λ, ρ or γ are chosen per module: stacked maps would share one choice."""
        return not self.choosing

    @property
    def takes_rows(self) -> bool:
        """Whether the solve's objective is the plain one that solve_linear_weight_rows solves."""
        s = self.settings
        return not (self.choosing or s["trust"] or s["shrinkage"] or s["head_metric"])

    def _split(self, module: ModuleData, stats: dict[str, torch.Tensor], t: int,
               fold: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return _fit_and_held(stats, module.tasks[t], module.where, self.settings["holdout_every"], fold)

    def _chosen(self, choice: Choice | None, w: float) -> tuple[Hyper, dict[str, Any]]:
        report: dict[str, Any] = {"shared_weight": w} if len(self.foreign_grid) > 1 else {}
        if choice is None:
            return self.hyper, report
        report.update({"lambda": choice.lam, "rho": choice.rho})
        if self.settings["shrinkage"] == "auto":
            report["shrinkage"] = choice.shrink
        return replace(self.hyper, lam=choice.lam, rho=choice.rho, shrink=choice.shrink), report

    def _choose(self, fold_choices: Callable[[int], list[Choice]],
                shrinks: list[float]) -> tuple[Choice | None, float]:
        """The module's (λ, ρ, γ among `shrinks`) and foreign weight w: each fold's choice at each w of the grid
        (`fold_choices(fold)`, one per w), then the w and point of lowest summed held-out score; without a choice,
        none and the one w."""
        if not self.choosing:
            return None, self.foreign_grid[0]
        by_fold = [fold_choices(fold) for fold in range(self.settings["holdout_folds"])]
        by_weight = [[choices[k] for choices in by_fold] for k in range(len(self.foreign_grid))]
        w, choice = choose_foreign_weight(by_weight, self.foreign_grid, self.lams, self.rhos, shrinks,
                                          self.one_standard_error)
        return choice, w

    def solve_linear(self, module: ModuleData) -> Solved:
        where, weights = module.where, module.task_weights
        w_merged = module.merged("weight")

        def split_tasks(fold: int, w: float) -> Iterator[tuple[LinearMoments, LinearMoments, torch.Tensor]]:
            for t, stats in _each_task_stats(module):
                c = weights[t]
                fit, held = self._split(module, stats, t, fold)
                yield (_task_moments(fit, where, c, w), replace(linear_moments(held, where), weight=c),
                       module.expert(t, "weight"))
                del stats, fit, held  # before the next task's are read: one task's d × d sums at a time

        def split_parts(fold: int) -> Iterator[tuple[LinearMoments, LinearMoments | None, LinearMoments, torch.Tensor]]:
            """As split_tasks, with the own and foreign fit rows' moments apart (every w's fit from one pass)."""
            for t, stats in _each_task_stats(module):
                c = weights[t]
                fit, held = self._split(module, stats, t, fold)
                foreign = foreign_sums(fit)
                yield (replace(linear_moments(fit, where), weight=c),
                       None if foreign is None else linear_moments(foreign, where),
                       replace(linear_moments(held, where), weight=c), module.expert(t, "weight"))
                del stats, fit, held, foreign  # one task's d × d sums at a time

        def fold_choices(fold: int) -> list[Choice]:
            if len(self.foreign_grid) == 1:
                return [choose_linear_hyper(split_tasks(fold, self.foreign_grid[0]), w_merged, module.base("weight"),
                                            self.hyper, self.lams, self.rhos, self.shrinks)]
            return choose_linear_hyper_by_weight(split_parts(fold), w_merged, module.base("weight"), self.hyper,
                                                 self.lams, self.rhos, self.shrinks, self.foreign_grid)

        choice, w = self._choose(fold_choices, self.shrinks)
        hp, report = self._chosen(choice, w)
        if module.rows and self.takes_rows:
            return self._solve_rows(module, hp, report)
        bias_terms: list[BiasTerm] = []
        eta = self.settings["head_metric"]
        heads = None if module.head is None or not eta else _head_factors(module.head, len(weights))

        def moments_of(t: int, stats: dict[str, torch.Tensor]) -> tuple[LinearMoments, torch.Tensor]:
            """Task t's moments and W_t, and its bias term on the side."""
            c = weights[t]
            # W_t in float64 once: the right-hand side's product and the bias term both read it
            mom = _task_moments(stats, where, c, w, in_place=True)
            w_t = module.expert(t, "weight").double()
            if module.has_bias:
                metric = None if heads is None else head_metric(heads[t], eta)
                bias_terms.append(BiasTerm.of(mom, w_t, module.expert(t, "bias"), hp.alpha, metric))
            return mom, w_t

        def per_task() -> Iterator[tuple[LinearMoments, torch.Tensor]]:
            """(moments, W_t) of each task."""
            for t, stats in _each_task_stats(module):
                mom, w_t = moments_of(t, stats)
                yield mom, w_t
                del stats, mom, w_t  # before the next task's are read: one task's d × d moments at a time

        def per_task_with_head(heads: list[torch.Tensor]) -> Iterator[tuple[LinearMoments, torch.Tensor, torch.Tensor]]:
            """(moments, W_t, U_t): with featcal.head_metric, task t's head factor too."""
            for t, stats in _each_task_stats(module):
                mom, w_t = moments_of(t, stats)
                yield mom, w_t, heads[t]
                del stats, mom, w_t  # as per_task

        if heads is None:
            sol = solve_linear_weight(per_task(), w_merged, module.base("weight"), hp, self.mixed)
        else:  # λ and ρ as chosen above, by the plain held-out data term
            try:
                sol = solve_linear_weight_head(per_task_with_head(heads), w_merged, module.base("weight"), hp, eta)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
        if sol.path is not None:
            report["solve_path"] = sol.path
        if sol.unresolved:
            report["unresolved"] = _unresolved_report(module, sol.unresolved, w_merged.shape[1])
        solved = {"weight": sol.weight}
        if module.has_bias and self.settings["calibrate_bias"]:
            solved["bias"] = solve_linear_bias(bias_terms, sol.weight, module.merged("bias"), module.base("bias"), hp,
                                               merged_weight=w_merged)
        return Solved(solved, damping=sol.damping, eps=hp.eps, report=report)

    def _solve_rows(self, module: ModuleData, hp: Hyper, report: dict[str, Any]) -> Solved:
        """solve_linear with every task's rows at once (few by the Gram stage's choice), in row form."""
        stats = list(module.stats())
        rows = [replace(linear_rows(s, module.where), weight=c)
                for s, c in zip(stats, module.task_weights, strict=True)]
        w_merged = module.merged("weight")
        sol, normalisers = solve_linear_weight_rows(rows, w_merged, module.base("weight"), hp)
        solved = {"weight": sol.weight}
        if module.has_bias and self.settings["calibrate_bias"]:
            terms = [BiasTerm.of_means(1.0 / n_t, s["sum_s"] / r.sum_w, s["sum_e"] / r.sum_w,
                                       module.expert(t, "weight"), module.expert(t, "bias"), hp.alpha)
                     for t, (s, r, n_t) in enumerate(zip(stats, rows, normalisers, strict=True))]
            solved["bias"] = solve_linear_bias(terms, sol.weight, module.merged("bias"), module.base("bias"), hp,
                                               merged_weight=w_merged)
        return Solved(solved, damping=sol.damping, eps=hp.eps, report={**report, "solve_path": sol.path})

    def solve_norm(self, module: ModuleData) -> Solved | None:
        if not self.settings["calibrate_norm"]:
            return None
        where, weights, tasks = module.where, module.task_weights, range(len(module.tasks))
        stats = list(module.stats())  # vectors: small
        affine = ([module.expert(t, "weight") for t in tasks],
                  [module.expert(t, "bias") for t in tasks] if module.has_bias else None,
                  module.merged("weight"), module.base("weight"),
                  module.merged("bias") if module.has_bias else None, module.base("bias") if module.has_bias else None)

        def fold_choice(fold: int, w: float) -> Choice:
            parts = [self._split(module, s, t, fold) for t, s in enumerate(stats)]
            fit = [_task_norm_moments(f, where, c, w) for (f, _), c in zip(parts, weights, strict=True)]
            held = [replace(norm_moments(h, where), weight=c) for (_, h), c in zip(parts, weights, strict=True)]
            return choose_norm_hyper(fit, held, *affine, self.hyper, self.lams, self.rhos)

        choice, w = self._choose(lambda fold: [fold_choice(fold, w) for w in self.foreign_grid], [self.hyper.shrink])
        hp, report = self._chosen(choice, w)
        report.pop("shrinkage", None)  # a norm's moments are per dimension: nothing off the diagonal to shrink
        moms = [_task_norm_moments(s, where, c, w) for s, c in zip(stats, weights, strict=True)]
        gamma, beta = solve_norm_affine(moms, *affine, hp)
        return Solved({"weight": gamma} if beta is None else {"weight": gamma, "bias": beta}, report=report)


@register
class RegMean(CalibrationMethod):
    """W = (Σ_t G̃_t)⁻¹ Σ_t G̃_t W_t per linear module, G_t the per-token mean Gram of expert t's own inputs (its block
    on its own stream), G̃ = a·G + (1−a)·diag(G). Biases and norms keep the merged values, so `merge.method: average`
    gives the published RegMean."""

    name = "regmean"
    keys = ("regmean_off_diagonal", "eps")

    @property
    def statistics(self) -> StatisticsPlan:
        return StatisticsPlan(fit_block="expert", fit_stream="expert", expert_side=False)

    def solve_linear(self, module: ModuleData) -> Solved:
        grams = ((linear_moments(stats, module.where, in_place=True).c_ss, module.expert(t, "weight"))
                 for t, stats in enumerate(module.stats()))
        eps = self.settings["eps"]
        sol = solve_regmean_weight(grams, self.settings["regmean_off_diagonal"], eps, self.mixed)
        return Solved({"weight": sol.weight}, damping=sol.damping, eps=eps,
                      report={} if sol.path is None else {"solve_path": sol.path})

    def solve_norm(self, module: ModuleData) -> Solved | None:
        return None


@register
class RegMeanPlusPlus(RegMean):
    """RegMean with G_t from expert t's block run on the merged stream: the inputs that flow through the already
    solved earlier blocks (forward order, like FeatCal)."""

    name = "regmean_plus_plus"

    @property
    def statistics(self) -> StatisticsPlan:
        return StatisticsPlan(fit_block="expert", fit_stream="merged", expert_side=False)


@register
class LOTMerging(CalibrationMethod):
    """LOT Merging (Sun et al., NeurIPS 2025, arXiv 2505.23859) on RegMean's statistics: each linear map's task vector
    is (Σ_t X_tᵀX_t)⁺ Σ_t X_tᵀX_t T_t, each norm's scale the base's plus the tasks' scale task vectors averaged per
    dimension with the weights Σ z² (docs/design.md §2.10). Biases and norm shifts keep the merged values: the parts
    of the paper that say how it treats them could not be read here (docs/configuration.md). No key: the closed
    form has no knob, and its pseudoinverse cut-off is the rounding floor of the Grams (closed_form.UNRESOLVED)."""

    name = "lot"
    keys = ()

    @property
    def statistics(self) -> StatisticsPlan:
        return StatisticsPlan(fit_block="expert", fit_stream="expert", expert_side=False)

    def solve_linear(self, module: ModuleData) -> Solved:
        def grams() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for t, stats in _each_task_stats(module):
                yield input_gram_sum(stats, module.where), module.expert(t, "weight")
                del stats  # before the next task's are read

        sol = solve_lot_weight(grams(), module.base("weight"))
        return Solved({"weight": sol.weight}, report={"pinv_rank": sol.rank})

    def solve_norm(self, module: ModuleData) -> Solved | None:
        tasks = range(len(module.tasks))
        sq = [norm_sq_sum(s, module.where) for s in module.stats()]  # vectors: small
        gamma = lot_norm_scale(sq, [module.expert(t, "weight") for t in tasks], module.base("weight"))
        return Solved({"weight": gamma})
