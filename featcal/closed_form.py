"""The closed-form FeatCal solves of docs/design.md §2, on per-task moments, in float64."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

import featcal_kernels


@dataclass(frozen=True)
class Hyper:
    lam: float
    rho: float
    alpha: float
    eps: float
    trust: float = 0.0  # μ: each task's term also pulls W·x_s towards the merged W_m·x_s on that task's rows
    shrink: float = 0.0  # γ: each task's C_ss and C_st shrunk towards T_t (docs/design.md §2.8)
    shrink_target: str = "identity"  # T_t = tr(C_ss)/d·I ("identity") or diag(C_ss) ("diagonal")


@dataclass
class LinearMoments:
    """Weighted uncentred moments of one linear module's inputs for one task (sums already divided by Σw).

    The expert side comes as C_se, or as the product the solve needs (featcal/statistics.py picks the cheaper)."""

    c_ss: torch.Tensor  # E_w[x_s x_sᵀ]   [in, in]
    mu_s: torch.Tensor  # E_w[x_s]        [in]
    mu_e: torch.Tensor  # E_w[x_e]        [in]
    c_se: torch.Tensor | None = None  # E_w[x_s x_eᵀ]   [in, in]
    p_st: torch.Tensor | None = None  # E_w[x_s (W_t x_t)ᵀ]   [in, out], for the α its Gram stage was keyed with
    weight: float = 1.0  # c_t, the task's weight in the shared solve (featcal.task_weight_power, task_weights)
    _norm: float | None = field(default=None, init=False, repr=False, compare=False)  # ‖C_ss‖_F, once

    def add_target(self, out: torch.Tensor, alpha: float, w_t: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """out += scale·C_st·W_tᵀ, in place, with C_st·W_tᵀ = E_w[x_s (W_t x_t)ᵀ], x_t = α·x_e + (1−α)·x_s, [in, out]
        float64 and W_t [out, in]. The product goes straight into `out`: [in, out] temporaries cost a tenth of the
        solve on ViT-B/32. P_t already holds the product, summed for the run's α (tasks/solve.py checks the
        statistics file's α against the run's)."""
        if self.p_st is not None:
            return out.add_(self.p_st, alpha=scale)
        if self.c_se is None:
            raise ValueError("these moments keep no expert side (C_se or its product): RegMean statistics?")
        c_st = torch.mul(self.c_se, alpha).add_(self.c_ss, alpha=1.0 - alpha)
        return out.addmm_(c_st, w_t.double().T, alpha=scale)

    def shrink_target(self, kind: str) -> torch.Tensor:
        """The diagonal of T_t, the shrinkage target of C_ss: tr(C_ss)/d everywhere ("identity") or diag(C_ss)."""
        diag = self.c_ss.diagonal().double()
        if kind == "identity":
            return torch.full_like(diag, float(diag.mean()))
        if kind == "diagonal":
            return diag.clone()
        raise ValueError(f"featcal.shrinkage_target: {kind!r} is not a target; expected identity or diagonal")

    def add_shrunk(self, a: torch.Tensor, b: torch.Tensor, hp: Hyper, w_t: torch.Tensor, scale: float) -> None:
        """a += scale·C̃_ss and b += scale·C̃_st·W_tᵀ in place, with C̃ = (1−γ)·C + γ·T_t for both (γ = hp.shrink).

        The cross term takes the same target as the Gram: in the directions the rows leave unseen the shrunk data term
        reads x_t as x_s, so its γ part is γ‖(W − W_t)T_t^½‖², a pull towards the task's own expert (as RegMean's
        diagonal shrinkage). Shrinking C_ss alone would pull W towards zero instead. γ = 0 adds exactly C_ss and
        C_st."""
        a.add_(self.c_ss, alpha=scale * (1.0 - hp.shrink))
        self.add_target(b, hp.alpha, w_t, scale * (1.0 - hp.shrink))
        if hp.shrink:
            t = self.shrink_target(hp.shrink_target).mul_(scale * hp.shrink)
            a.diagonal().add_(t)
            b.add_(t[:, None] * w_t.double().T)

    def with_foreign(self, foreign: LinearMoments | None, w: float) -> LinearMoments:
        """These (a task's own rows') moments with its foreign rows' at weight w (calibration.shared_inputs,
        docs/design.md §2.12): the data term E_own + w·E_foreign, kept as the mean (M_own + w·M_foreign)/(1 + w) with
        weight c_t·(1 + w), so that every solve, the bias's included, reads it as one task's rows; n_t stays the own
        rows' ‖C_ss‖_F. w = 0 or no foreign rows: these moments themselves."""
        if not w or foreign is None:
            return self

        def mixed(own: torch.Tensor | None, other: torch.Tensor | None) -> torch.Tensor | None:
            if own is None or other is None:
                if own is not other:
                    raise ValueError("own and foreign rows' moments keep the expert side in different forms")
                return None
            return torch.add(own, other, alpha=w).div_(1.0 + w)

        c_ss = mixed(self.c_ss, foreign.c_ss)
        mu_s, mu_e = mixed(self.mu_s, foreign.mu_s), mixed(self.mu_e, foreign.mu_e)
        assert c_ss is not None and mu_s is not None and mu_e is not None  # always kept
        out = LinearMoments(c_ss=c_ss, mu_s=mu_s, mu_e=mu_e, c_se=mixed(self.c_se, foreign.c_se),
                            p_st=mixed(self.p_st, foreign.p_st), weight=self.weight * (1.0 + w))
        out._norm = float(torch.linalg.matrix_norm(self.c_ss))
        return out

    def normaliser(self) -> float:
        """n_t / c_t with n_t = ‖C_ss‖_F, so λ is a ratio comparable across layers and tasks."""
        if self._norm is None:  # asked by the weight's solve and by the bias's
            self._norm = float(torch.linalg.matrix_norm(self.c_ss))
        return (self._norm if self._norm > 0 else 1.0) / self.weight


@dataclass
class NormMoments:
    """Per-dimension moments of the merged side's normalised norm input z_s for one task."""

    m: torch.Tensor  # E_w[z_s]
    e: torch.Tensor  # E_w[z_s²]
    weight: float = 1.0  # c_t, as LinearMoments.weight

    def with_foreign(self, foreign: NormMoments | None, w: float) -> NormMoments:
        """As LinearMoments.with_foreign: the mean of own and w × foreign moments, weight c_t·(1 + w)."""
        if not w or foreign is None:
            return self
        return NormMoments(m=torch.add(self.m, foreign.m, alpha=w).div_(1.0 + w),
                           e=torch.add(self.e, foreign.e, alpha=w).div_(1.0 + w), weight=self.weight * (1.0 + w))


def anchor(merged: torch.Tensor, base: torch.Tensor, rho: float, scale: float = 1.0) -> torch.Tensor:
    """scale·A(θ), A(θ) = ρ·θ_m + (1−ρ)·θ0, in float64, in one fresh buffer: widening and scaling each term apart
    took five weight-sized float64 temporaries, 2.1 s of a 37.3 s solve stage on the Llama-3.2-3B shape."""
    return base.to(torch.float64, copy=True).mul_(scale * (1.0 - rho)).add_(merged, alpha=scale * rho)


@dataclass
class LinearSolution:
    weight: torch.Tensor
    damping: float
    path: str | None = None  # with a mixed solve: "mixed, N steps" or "float64: <why it fell back>"
    unresolved: int = 0  # directions neither the data nor the ridge determines (unresolved_directions)


# A Gram summed from fp32 products carries their rounding, about 2⁻²⁴ ≈ 6e-8 each: eigenvalues of a normalised Gram
# below 1e-7 of its Frobenius norm are within it (the negative eigenvalues that rounding leaves in the tiny T5
# decoder's rank-2 Grams reach −1.2e-7).
UNRESOLVED = 1e-7
# Along such a direction the solve's weight is that rounding over λ + ε, unless λ + ε is large against it: calibrated
# towards itself on those Grams, that T5's first decoder boundary went 56 % from the expert's at λ 1e-9, 31 % at 1e-7,
# 1.2 % at 1e-6 and 0.013 % at 1e-4 (benchmarks/results/exactness_floor.md). From 1e-6 of the norm on the ridge holds.
LIFTED = 1e-6


def unresolved_directions(a: torch.Tensor, reg: float) -> int:
    """How many eigenvalues of a (the tasks' summed normalised Gram) lie below UNRESOLVED·‖a‖_F while reg = λ + ε is
    below LIFTED·‖a‖_F: directions the data leaves within its rounding and the ridge is too weak to hold, so that the
    solve's weights along them are rounding noise. 0 with no eigendecomposition when reg is not that weak (every
    λ ≥ 1e-6: all but λ → 0)."""
    norm = float(torch.linalg.matrix_norm(a))
    if reg >= LIFTED * norm:
        return 0
    return int((torch.linalg.eigvalsh(a) < UNRESOLVED * norm).sum())


def numerical_rank(c: torch.Tensor) -> int:
    """How many eigenvalues of a Gram reach UNRESOLVED of its Frobenius norm: the directions its data resolves."""
    floor = UNRESOLVED * float(torch.linalg.matrix_norm(c))
    return int((torch.linalg.eigvalsh(c.double()) >= floor).sum())


def _ridge(a: torch.Tensor, b: torch.Tensor, eps: float, mixed: bool) -> LinearSolution:
    """Wᵀ from (a + εI) Wᵀ = b: float64 Cholesky, or fp32 with float64-residual refinement when `mixed` and the
    right-hand side is narrow enough for that to pay (featcal_kernels.mixed_pays); the path says which."""
    d, k = b.shape
    if not mixed or not featcal_kernels.mixed_pays(d, k):
        sol = featcal_kernels.ridge_solve(a, b, damping=eps)
        path = None if not mixed else (f"float64: {k} right-hand sides for {d} unknowns, too many for the fp32 "
                                       "factor to pay for the float64 residuals")
        return LinearSolution(weight=sol.x.T.contiguous(), damping=sol.damping, path=path)
    sol = featcal_kernels.ridge_solve_mixed(a, b, damping=eps)
    path = f"mixed, {sol.steps} steps" if sol.path == "mixed" else f"float64: {sol.fallback}"
    return LinearSolution(weight=sol.x.T.contiguous(), damping=sol.damping, path=path)


def solve_linear_weight(
    tasks: Iterable[tuple[LinearMoments, torch.Tensor]], merged: torch.Tensor, base: torch.Tensor, hp: Hyper,
    mixed: bool = False,
) -> LinearSolution:
    """Wᵀ = (Σ_t C̃_ss/n_t + (λ+ε)I)⁻¹ (Σ_t (C̃_st/n_t) W_tᵀ + λ A(W)ᵀ); weights are [out, in]. C̃ = C unless
    hp.shrink (γ) > 0: then (1−γ)·C + γ·T_t for C_ss and C_st alike (LinearMoments.add_shrunk); n_t stays ‖C_ss‖_F.

    `tasks` yields (moments, W_t) one task at a time, so only one task's d×d moments are ever held."""
    d = merged.shape[1]
    a = torch.zeros(d, d, dtype=torch.float64, device=merged.device)
    b = anchor(merged, base, hp.rho, hp.lam).T
    for mom, w_t in tasks:
        mom.add_shrunk(a, b, hp, w_t, 1.0 / mom.normaliser())
        del mom, w_t  # before the next task's are read
    if hp.trust:  # + μ Σ_t E‖W x_s − W_m x_s‖²/n_t: the data Gram again, with the merged weight as target
        b += hp.trust * a @ merged.double().T
        a *= 1.0 + hp.trust
    unresolved = unresolved_directions(a, hp.lam + hp.eps)
    a.diagonal().add_(hp.lam)  # + λI without a d×d identity
    return replace(_ridge(a, b, hp.eps, mixed), unresolved=unresolved)


@dataclass
class LinearRows:
    """One task's rows of one module, for the weight solve in row form: where all tasks' rows together are few
    against the input width, their n × n system costs less than the in × in one of the Gram (solve_linear_weight_rows).
    Rows of zero weight are left out by the Gram stage."""

    x: torch.Tensor  # x_s [rows, in]
    y: torch.Tensor  # W_t x_t [rows, out], x_t = α·x_e + (1−α)·x_s, for the α its Gram stage was keyed with
    w: torch.Tensor  # token weights [rows]
    sum_w: float  # Σw over all the task's rows
    weight: float = 1.0  # c_t, as LinearMoments.weight

    def moments(self, mu_s: torch.Tensor, mu_e: torch.Tensor) -> LinearMoments:
        """The same statistics as Gram-form moments (C_ss and P_t), for the solves that need the in × in system."""
        wx = self.x.double() * (self.w.double() / self.sum_w)[:, None]
        return LinearMoments(c_ss=wx.T @ self.x.double(), mu_s=mu_s, mu_e=mu_e, p_st=wx.T @ self.y.double(),
                             weight=self.weight)


# Width of the panels over which the row form's products of fp32 rows sum in fp32 before adding up in float64: a
# Gram-stage chunk's rows at 8 × 128 tokens, so that the row form's products round as the Gram form's do.
PANEL = 1024


def panel_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a·bᵀ in float64, multiplied in a's and b's own precision (fp32 at least) over PANEL-wide panels of their
    shared dimension: fp32 rows multiply at the fp32 rate, as the Gram stage's chunks do, and float64 rows exactly."""
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64, device=a.device)
    for start in range(0, a.shape[1], PANEL):
        out.add_(a[:, start:start + PANEL].to(dtype) @ b[:, start:start + PANEL].to(dtype).T)
    return out


def solve_linear_weight_rows(tasks: Sequence[LinearRows], merged: torch.Tensor, base: torch.Tensor,
                             hp: Hyper) -> tuple[LinearSolution, list[float]]:
    """solve_linear_weight's Wᵀ from the rows themselves, and each task's n_t/c_t (for the bias solve).

    With Q the rows √(w/(Σw·n_t))·x_s of all tasks stacked [n, in] and Y their targets W_t x_t weighted alike, the
    system is (QᵀQ + δI)Wᵀ = QᵀY + λA(W)ᵀ, δ = λ + ε. By (QᵀQ + δI)⁻¹Qᵀ = Qᵀ(QQᵀ + δI)⁻¹,

        Wᵀ = (λ/δ)·A(W)ᵀ + Qᵀ(QQᵀ + δI)⁻¹(Y − (λ/δ)·Q·A(W)ᵀ):

    an n × n Cholesky and 4·n·in·out multiply-adds for in³/3 + 2·in²·out, and no in × in Gram in the Gram stage.
    n_t = ‖C_ss‖_F = ‖X_t diag(w) X_tᵀ‖_F/Σw comes from the diagonal blocks of QQᵀ. QQᵀ and Q·A(W)ᵀ, the row form's
    Gram and right-hand side, multiply the rows as stored (panel_product: fp32 products, as the Gram form's sums;
    A(W) rounded to the rows' precision); the factorisation, its solves and Qᵀ(·) are float64. Only the plain
    objective (no trust, shrinkage or head metric): the others need the Gram (LinearRows.moments)."""
    if hp.trust or hp.shrink:
        raise ValueError("the row-form solve takes neither featcal.trust nor featcal.shrinkage: use the moments")
    x = torch.cat([t.x for t in tasks])
    g = panel_product(x, x)
    normalisers, scale, start = [], [], 0
    for t in tasks:
        end = start + t.x.shape[0]
        root_w = t.w.double().sqrt()
        norm = float(torch.linalg.matrix_norm(g[start:end, start:end] * root_w[:, None] * root_w[None, :])) / t.sum_w
        normalisers.append((norm if norm > 0 else 1.0) / t.weight)
        scale.append(root_w / (t.sum_w * normalisers[-1]) ** 0.5)
        start = end
    s = torch.cat(scale)  # Q = diag(s)·X
    g.mul_(s[:, None]).mul_(s[None, :])
    g.diagonal().add_(hp.lam)
    a = anchor(merged, base, hp.rho)  # [out, in]
    # [n, out] at the rows' precision, as the fp32 targets Y it is taken from: in float64 it took 2.0 s of the 5.6 s
    # that a Llama-3.2-3B block's down_proj solve took
    qa = panel_product(x, a.to(torch.promote_types(x.dtype, torch.float32))).mul_(s[:, None])
    y = torch.cat([t.y for t in tasks]).double().mul_(s[:, None])
    sol = featcal_kernels.ridge_solve(g, y - qa * (hp.lam / (hp.lam + hp.eps)), damping=hp.eps)
    if sol.damping != hp.eps:  # the damping grew: the anchor's share follows δ = λ + damping
        sol = featcal_kernels.ridge_solve(g, y - qa * (hp.lam / (hp.lam + sol.damping)), damping=sol.damping)
    weight = (sol.x.T @ x.double().mul_(s[:, None])).add_(a, alpha=hp.lam / (hp.lam + sol.damping))
    return LinearSolution(weight=weight, damping=sol.damping, path=f"rows: {x.shape[0]} rows for {x.shape[1]} "
                          "inputs"), normalisers


HEAD_TOL = 1e-12  # relative residual at which the head-metric solve stops: float64 accuracy (docs/design.md §6)
HEAD_MAX_STEPS = 5000


def head_factor(head: torch.Tensor) -> torch.Tensor:
    """U_t from a task's head map H_t [k, out]: U_t = H_t·√out/‖H_t‖_F, so that S_t = U_tᵀU_t has trace `out`, the
    identity's, and η moves weight between the two metrics without changing the data term's scale."""
    h = head.double()
    norm = float(torch.linalg.matrix_norm(h))
    if not norm > 0:
        raise ValueError("featcal.head_metric: a task's head map is all zeros, so it reads nothing of this module")
    return h * (h.shape[1] ** 0.5 / norm)


def solve_linear_weight_head(
    tasks: Iterable[tuple[LinearMoments, torch.Tensor, torch.Tensor]], merged: torch.Tensor, base: torch.Tensor,
    hp: Hyper, eta: float,
) -> LinearSolution:
    """solve_linear_weight with each task's output error measured in M_t = (1−η)I + η·S_t, S_t = U_tᵀU_t
    (head_factor): min Σ_t E_t[(W x_s − W_t x_t)ᵀ M_t (W x_s − W_t x_t)]/n_t + μ-trust + λ‖W − A(W)‖² (docs/design.md
    §2.8, head metric). Its normal equations, in X = Wᵀ [in, out],

        (1−η+μ)·a·X + η Σ_t G_t X S_t + (λ+ε) X = (1−η)·B + η Σ_t B_t S_t + μ·a·W_mᵀ + λ A(W)ᵀ,

    with G_t = C̃_ss^t/n_t, a = Σ_t G_t and B_t = C̃_st^t W_tᵀ/n_t, are a sum of Kronecker products with no closed
    form. Conjugate gradients solve them, preconditioned by the one Kronecker product near them, a·X·M̄ + (λ+ε)X
    with M̄ = (1−η+μ)I + η Σ_t (tr G_t/tr a)·S_t, which two eigendecompositions invert exactly (and which is the
    whole system when the tasks' Grams are proportional, or at η = 0).

    `tasks` yields (moments, W_t, U_t [k, out]). Tasks with equal U_t share one S and so one summed Gram in the
    iterations: one in² per distinct head (a causal LM's tasks all read the merged head: one in all, and the
    preconditioner is then the system), at most T·in² floats."""
    d, f64, dev = merged.shape[1], torch.float64, merged.device
    a = torch.zeros(d, d, dtype=f64, device=dev)
    b = anchor(merged, base, hp.rho, hp.lam).T
    grams: list[torch.Tensor] = []  # per distinct U: Σ G_t over the tasks that read it
    factors: list[torch.Tensor] = []
    for mom, w_t, u_t in tasks:
        g_t = torch.zeros(d, d, dtype=f64, device=dev)
        b_t = torch.zeros_like(b)
        mom.add_shrunk(g_t, b_t, hp, w_t, 1.0 / mom.normaliser())
        u_t = u_t.to(dtype=f64, device=dev)
        a += g_t
        b.add_(b_t, alpha=1.0 - eta).add_((b_t @ u_t.T) @ u_t, alpha=eta)
        same = next((k for k, u in enumerate(factors) if u is u_t or torch.equal(u, u_t)), None)
        if same is None:
            grams.append(g_t)
            factors.append(u_t)
        else:
            grams[same].add_(g_t)
        del mom, w_t, g_t, b_t  # before the next task's are read
    if hp.trust:
        b += hp.trust * a @ merged.double().T
    plain, reg = 1.0 - eta + hp.trust, hp.lam + hp.eps

    def operator(x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(x, a, x, beta=reg, alpha=plain)
        for g_t, u_t in zip(grams, factors, strict=True):
            out.add_(g_t @ (x @ u_t.T) @ u_t, alpha=eta)
        return out

    total = float(a.trace())
    mean_metric = plain * torch.eye(merged.shape[0], dtype=f64, device=dev)
    for g_t, u_t in zip(grams, factors, strict=True):
        mean_metric.add_(u_t.T @ u_t, alpha=eta * float(g_t.trace()) / total)
    e, v = torch.linalg.eigh(a)
    m, q = torch.linalg.eigh(mean_metric)
    scale = 1.0 / (e.clamp_min(0)[:, None] * m.clamp_min(0)[None, :] + reg)

    def precondition(r: torch.Tensor) -> torch.Tensor:
        return v @ ((v.T @ r @ q) * scale) @ q.T

    x = precondition(b)
    r = b - operator(x)
    z = precondition(r)
    p, rz = z.clone(), float((r * z).sum())
    b_norm = float(torch.linalg.matrix_norm(b))
    steps = 0
    while float(torch.linalg.matrix_norm(r)) > HEAD_TOL * b_norm:
        if steps == HEAD_MAX_STEPS:
            raise ValueError(f"featcal.head_metric: conjugate gradients left a relative residual of "
                             f"{float(torch.linalg.matrix_norm(r)) / b_norm:.3g} after {steps} steps (asked "
                             f"{HEAD_TOL:g}); lower featcal.head_metric or raise featcal.lambda")
        q_p = operator(p)
        step = rz / float((p * q_p).sum())
        x.add_(p, alpha=step)
        r.sub_(q_p, alpha=step)
        z = precondition(r)
        rz, rz_old = float((r * z).sum()), rz
        p = z.add_(p, alpha=rz / rz_old)
        steps += 1
    return LinearSolution(weight=x.T.contiguous(), damping=hp.eps, path=f"head metric, {steps} CG steps")


@dataclass(frozen=True)
class Choice:
    """The (λ, ρ, γ) a module's held-out rows chose, with the held-out data term of every grid point ([γ, λ, ρ])."""

    lam: float
    rho: float
    scores: torch.Tensor
    shrink: float = 0.0


def _best(scores: torch.Tensor, lams: Sequence[float], rhos: Sequence[float],
          shrinks: Sequence[float] = (0.0,)) -> Choice:
    """The lowest score; ties go to the first grid point in (γ, λ, ρ) order, so the choice is fixed."""
    flat = int(torch.argmin(scores.reshape(-1)))
    k, rest = divmod(flat, len(lams) * len(rhos))
    return Choice(lam=float(lams[rest // len(rhos)]), rho=float(rhos[rest % len(rhos)]), scores=scores,
                  shrink=float(shrinks[k]))


def cross_validated(choices: Sequence[Choice], lams: Sequence[float], rhos: Sequence[float],
                    shrinks: Sequence[float], one_standard_error: bool = False) -> Choice:
    """The grid point with the lowest score summed over the folds' choices (each fold held out in turn, scored on
    its own rows; every score omits a constant of its fold only, so the sum ranks the grid as the full sums would).
    One fold: that fold's choice.

    `one_standard_error`: then the largest λ, at the best point's γ and ρ, whose excess over the best point is
    within one standard error of that excess, from its spread over the folds: each fold's excess d_k is the
    difference of two scores of that fold, so the folds' unknown constants cancel; λ is kept if mean(d) ≤
    std(d)/√K. Few held-out rows make the lowest score a noisy pick, and the rule then leans to the stronger pull
    towards the anchor that the folds cannot tell apart from it."""
    total = choices[0].scores.clone()
    for choice in choices[1:]:
        total.add_(choice.scores)
    best = _best(total, lams, rhos, shrinks)
    if not one_standard_error or len(choices) < 2:
        return best
    k, i, j = shrinks.index(best.shrink), lams.index(best.lam), rhos.index(best.rho)
    folds = torch.stack([c.scores[k, :, j] for c in choices])  # [K, λ]
    excess = folds - folds[:, i:i + 1]
    mean, spread = excess.mean(0), excess.std(0) / len(choices) ** 0.5
    within = [m for m, lam in enumerate(lams) if lam >= best.lam and float(mean[m]) <= float(spread[m])]
    chosen = max(within, key=lambda m: lams[m])  # the best point itself always qualifies (excess 0)
    return replace(best, lam=float(lams[chosen]))


def choose_foreign_weight(by_weight: Sequence[Sequence[Choice]], weights: Sequence[float], lams: Sequence[float],
                          rhos: Sequence[float], shrinks: Sequence[float],
                          one_standard_error: bool = False) -> tuple[float, Choice]:
    """The foreign rows' weight w (calibration.shared_inputs.weight auto) whose best grid point has the lowest held-out
    score summed over the folds, and that w's (λ, ρ, γ) by cross_validated. `by_weight[k]` holds each fold's choice
    fitted with weights[k]; the held-out rows are own rows, scored alike at every w, so the scores compare across w.
    Ties go to the first w."""
    best = [float(torch.stack([c.scores for c in choices]).sum(0).min()) for choices in by_weight]
    k = min(range(len(best)), key=lambda i: (best[i], i))
    return float(weights[k]), cross_validated(by_weight[k], lams, rhos, shrinks, one_standard_error)


@dataclass
class _FitSums:
    """The parts of a held-out choice's fit system, summed over tasks: A = Σ_t C_ss/n_t, B_0 = Σ_t C_st·W_tᵀ/n_t and,
    with shrinkage, D = Σ_t T_t/n_t (its diagonal) and E = Σ_t T_t·W_tᵀ/n_t (B_0 itself without: then unused)."""

    a: torch.Tensor
    b0: torch.Tensor
    diag: torch.Tensor
    e_rhs: torch.Tensor

    @classmethod
    def zeros(cls, merged: torch.Tensor, shrinking: bool) -> _FitSums:
        d, f64, dev = merged.shape[1], torch.float64, merged.device
        b0 = torch.zeros(d, merged.shape[0], dtype=f64, device=dev)
        return cls(torch.zeros(d, d, dtype=f64, device=dev), b0, torch.zeros(d, dtype=f64, device=dev),
                   torch.zeros_like(b0) if shrinking else b0)

    def add(self, mom: LinearMoments, w_t: torch.Tensor, n: float, hp: Hyper, shrinking: bool) -> None:
        """One task's moments, divided by its normaliser n."""
        self.a.add_(mom.c_ss, alpha=1.0 / n)
        mom.add_target(self.b0, hp.alpha, w_t, 1.0 / n)
        if shrinking:
            t = mom.shrink_target(hp.shrink_target).div_(n)
            self.diag.add_(t)
            self.e_rhs.add_(t[:, None] * w_t.double().T)

    def plus(self, other: _FitSums, w: float) -> _FitSums:
        """These sums + w × `other`'s (own rows' and foreign rows' at weight w: every part is linear in w)."""
        b0 = torch.add(self.b0, other.b0, alpha=w)
        e_rhs = b0 if self.e_rhs is self.b0 else torch.add(self.e_rhs, other.e_rhs, alpha=w)
        return _FitSums(torch.add(self.a, other.a, alpha=w), b0, torch.add(self.diag, other.diag, alpha=w), e_rhs)


def choose_linear_hyper(
    tasks: Iterable[tuple[LinearMoments, LinearMoments, torch.Tensor]], merged: torch.Tensor, base: torch.Tensor,
    hp: Hyper, lams: Sequence[float], rhos: Sequence[float], shrinks: Sequence[float] | None = None,
) -> Choice:
    """The (λ, ρ, γ) of the grid whose weight, fitted on each task's fit rows, has the smallest data term on its
    held-out rows: Σ_t ‖X_h,t Wᵀ − X̃_h,t W_tᵀ‖²/n_t up to a constant, as the solve's own objective weighs it (the
    held-out term is never shrunk: γ is scored by how well the shrunk fit predicts rows it did not see).

    `tasks` yields (fit moments, held-out moments, W_t); `shrinks` is the γ grid (default: hp.shrink alone). The fit
    system at γ is (1−γ)·A + γ·D with A = Σ_t C_ss/n_t and D = Σ_t T_t/n_t diagonal, its right side (1−γ)·B + γ·E.
    One eigendecomposition per γ serves the λ × ρ grid (one in all for the identity target: D is then a multiple of
    I, so every γ shares A's eigenvectors): in its eigenbasis V, Wᵀ = V·(R_0 + λ(R_base + ρ·R_delta)) / (e + λ + ε),
    and for each λ the held-out score is a quadratic in ρ, so each (γ, λ) costs two products with the rotated
    held-out Gram: the joint grid costs |γ| times the λ grid's products."""
    shrinks = [hp.shrink] if shrinks is None else list(shrinks)
    fit_sums, h, g = _FitSums.zeros(merged, any(shrinks)), *_held_zeros(merged)
    for fit, held, w_t in tasks:
        fit_sums.add(fit, w_t, fit.normaliser(), hp, any(shrinks))
        _add_held(h, g, held, w_t, hp)
        del fit, held, w_t  # before the next task's are read
    return _grid_choice(fit_sums, h, g, merged, base, hp, lams, rhos, shrinks)


def choose_linear_hyper_by_weight(
    tasks: Iterable[tuple[LinearMoments, LinearMoments | None, LinearMoments, torch.Tensor]], merged: torch.Tensor,
    base: torch.Tensor, hp: Hyper, lams: Sequence[float], rhos: Sequence[float], shrinks: Sequence[float],
    weights: Sequence[float],
) -> list[Choice]:
    """choose_linear_hyper at each foreign weight w of `weights` (calibration.shared_inputs.weight auto), from one
    pass over the tasks: `tasks` yields (own fit moments, foreign fit moments or None, held-out moments, W_t). Task t's
    fit term at w is (own + w·foreign)/n_t with n_t the own fit rows' (LinearMoments.with_foreign), so every part of
    the fit system is own + w·foreign: summed once each, then one grid choice per w."""
    shrinking = any(shrinks)
    own, foreign, (h, g) = _FitSums.zeros(merged, shrinking), _FitSums.zeros(merged, shrinking), _held_zeros(merged)
    for fit, other, held, w_t in tasks:
        n = fit.normaliser()
        own.add(fit, w_t, n, hp, shrinking)
        if other is not None:
            foreign.add(other, w_t, n, hp, shrinking)
        _add_held(h, g, held, w_t, hp)
        del fit, other, held, w_t  # before the next task's are read
    return [_grid_choice(own.plus(foreign, w) if w else own, h, g, merged, base, hp, lams, rhos, list(shrinks))
            for w in weights]


def _held_zeros(merged: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d, f64, dev = merged.shape[1], torch.float64, merged.device
    return torch.zeros(d, d, dtype=f64, device=dev), torch.zeros(d, merged.shape[0], dtype=f64, device=dev)


def _add_held(h: torch.Tensor, g: torch.Tensor, held: LinearMoments, w_t: torch.Tensor, hp: Hyper) -> None:
    """H += C_ss/n and G += C_st·W_tᵀ/n of one task's held-out rows, n their own normaliser."""
    n_held = held.normaliser()
    h.add_(held.c_ss, alpha=1.0 / n_held)
    held.add_target(g, hp.alpha, w_t, 1.0 / n_held)


def _grid_choice(fit: _FitSums, h: torch.Tensor, g: torch.Tensor, merged: torch.Tensor, base: torch.Tensor, hp: Hyper,
                 lams: Sequence[float], rhos: Sequence[float], shrinks: list[float]) -> Choice:
    """The held-out scores of the (γ, λ, ρ) grid for the fit system `fit` and the held-out sums H, G, and the best."""
    a, b0, diag, e_rhs = fit.a, fit.b0, fit.diag, fit.e_rhs
    f64, dev = torch.float64, merged.device
    shared = hp.shrink_target == "identity"  # D = c·I: every γ has A's eigenvectors
    delta = merged.double() - base.double()
    rho = torch.tensor(rhos, dtype=f64, device=dev)
    scores = torch.empty(len(shrinks), len(lams), len(rhos), dtype=f64, device=dev)
    basis: tuple[torch.Tensor, ...] = ()
    for k, gamma in enumerate(shrinks):
        if not basis or not shared:
            evals, v = torch.linalg.eigh((1.0 - gamma) * a + torch.diag(gamma * diag) if gamma and not shared else a)
            basis = (evals.clamp_min(0), v, v.T @ h @ v, v.T @ g, v.T @ base.double().T, v.T @ delta.T)
        evals, v, h_rot, g_rot, r_base, r_delta = basis
        if gamma and shared:
            evals = (1.0 - gamma) * evals + gamma * float(diag[0])
        evals = evals + hp.eps
        r0 = v.T @ ((1.0 - gamma) * b0 + gamma * e_rhs) if gamma else v.T @ b0
        for i, lam in enumerate(lams):
            scale = 1.0 / (evals + lam)[:, None]
            y0, y1 = scale * (r0 + lam * r_base), scale * (lam * r_delta)  # Wᵀ in the eigenbasis: y0 + ρ·y1
            hy0, hy1 = h_rot @ y0, h_rot @ y1
            q00, q01, q11 = (hy0 * y0).sum(), (hy0 * y1).sum(), (hy1 * y1).sum()
            l0, l1 = (g_rot * y0).sum(), (g_rot * y1).sum()
            scores[k, i] = q00 + 2 * rho * q01 + rho**2 * q11 - 2 * (l0 + rho * l1)
    return _best(scores, lams, rhos, shrinks)


def choose_norm_hyper(
    fit: Sequence[NormMoments], held: Sequence[NormMoments], expert_gammas: Sequence[torch.Tensor],
    expert_betas: Sequence[torch.Tensor] | None, merged_gamma: torch.Tensor, base_gamma: torch.Tensor,
    merged_beta: torch.Tensor | None, base_beta: torch.Tensor | None, hp: Hyper,
    lams: Sequence[float], rhos: Sequence[float],
) -> Choice:
    """As choose_linear_hyper for a norm's affine: solve_norm_affine on the fit rows at every grid point, scored
    by Σ_t E_held[(γ⊙z + β − γ_t⊙z − β_t)²] summed over dimensions (the solve's own data term)."""
    scores = torch.empty(len(lams), len(rhos), dtype=torch.float64)
    for i, lam in enumerate(lams):
        for j, rho in enumerate(rhos):
            trial = Hyper(lam=lam, rho=rho, alpha=hp.alpha, eps=hp.eps)
            gamma, beta = solve_norm_affine(fit, expert_gammas, expert_betas, merged_gamma, base_gamma,
                                            merged_beta, base_beta, trial)
            total = torch.zeros((), dtype=torch.float64)
            for k, mom in enumerate(held):
                dg = gamma - expert_gammas[k].double()
                term = dg**2 * mom.e
                if beta is not None and expert_betas is not None:
                    db = beta - expert_betas[k].double()
                    term = term + 2 * dg * db * mom.m + db**2
                total += term.sum()
            scores[i, j] = total
    return _best(scores[None], lams, rhos, [hp.shrink])


@dataclass
class BiasTerm:
    """What the bias solve needs of one task: vectors, kept while the weight solve streams the matrices."""

    inv_n: float
    mu_s: torch.Tensor  # E_w[x_s]
    expert_out: torch.Tensor  # b_t + W_t μ_t
    metric: torch.Tensor | None = None  # M_t [out, out] with featcal.head_metric (solve_linear_weight_head)

    @classmethod
    def of(cls, mom: LinearMoments, w_t: torch.Tensor, b_t: torch.Tensor, alpha: float,
           metric: torch.Tensor | None = None) -> BiasTerm:
        return cls.of_means(1.0 / mom.normaliser(), mom.mu_s, mom.mu_e, w_t, b_t, alpha, metric)

    @classmethod
    def of_means(cls, inv_n: float, mu_s: torch.Tensor, mu_e: torch.Tensor, w_t: torch.Tensor, b_t: torch.Tensor,
                 alpha: float, metric: torch.Tensor | None = None) -> BiasTerm:
        """From the task's means, μ_t = α·μ_e + (1−α)·μ_s (the row-form solve has no LinearMoments)."""
        mu_t = alpha * mu_e + (1.0 - alpha) * mu_s
        return cls(inv_n, mu_s, b_t.double() + w_t.double() @ mu_t, metric)


def head_metric(u_t: torch.Tensor, eta: float) -> torch.Tensor:
    """M_t = (1−η)I + η·U_tᵀU_t."""
    return torch.eye(u_t.shape[1], dtype=torch.float64, device=u_t.device).mul_(1.0 - eta).add_(u_t.T @ u_t,
                                                                                               alpha=eta)


def solve_linear_bias(
    terms: Sequence[BiasTerm], weight: torch.Tensor, merged: torch.Tensor, base: torch.Tensor, hp: Hyper,
    merged_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """b = [Σ_t (b_t + W_t μ_t − W μ_s)/n_t + λ A(b)] / (Σ_t 1/n_t + λ), after the weight is solved; with a trust
    weight μ each task adds μ(b_m + W_m μ_s − W μ_s)/n_t and μ/n_t (`merged_weight` is then W_m). A term with a head
    metric M_t enters as M_t(b_t + W_t μ_t − W μ_s)/n_t and M_t/n_t, and b solves (Σ_t M_t/n_t + c·I) b = num."""
    num = anchor(merged, base, hp.rho, hp.lam)
    den = hp.lam
    den_metric: torch.Tensor | None = None  # Σ_t M_t/n_t over the terms with a metric
    w = weight.double()
    for term in terms:
        resid = term.expert_out - w @ term.mu_s
        if term.metric is None:
            num = num + term.inv_n * resid
            den += term.inv_n
        else:
            num = num + term.inv_n * (term.metric @ resid)
            den_metric = term.inv_n * term.metric if den_metric is None else den_metric + term.inv_n * term.metric
        if hp.trust:
            if merged_weight is None:
                raise ValueError("solve_linear_bias: a trust weight needs merged_weight")
            num = num + hp.trust * term.inv_n * (merged.double() + (merged_weight.double() - w) @ term.mu_s)
            den += hp.trust * term.inv_n
    if den_metric is None:
        return num / den
    return torch.linalg.solve(den_metric + den * torch.eye(len(num), dtype=torch.float64, device=num.device), num)


def solve_norm_affine(
    moments: Sequence[NormMoments], expert_gammas: Sequence[torch.Tensor], expert_betas: Sequence[torch.Tensor] | None,
    merged_gamma: torch.Tensor, base_gamma: torch.Tensor,
    merged_beta: torch.Tensor | None, base_beta: torch.Tensor | None, hp: Hyper,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per dimension, min Σ_t E‖γ⊙z + β − (γ_t⊙z + β_t)‖² + λ(‖γ−A(γ)‖² + ‖β−A(β)‖²): a 2×2 system (1×1 without β)."""
    reg = hp.lam + hp.eps
    sum_e = sum(m.weight * m.e for m in moments)
    rhs_g = anchor(merged_gamma, base_gamma, hp.rho, hp.lam)
    for mom, g_t in zip(moments, expert_gammas, strict=True):
        rhs_g = rhs_g + mom.weight * mom.e * g_t.double()
    if expert_betas is None:
        return rhs_g / (sum_e + reg), None
    assert merged_beta is not None and base_beta is not None  # experts with β: so has every side
    sum_m = sum(m.weight * m.m for m in moments)
    rhs_b = anchor(merged_beta, base_beta, hp.rho, hp.lam)
    for mom, g_t, b_t in zip(moments, expert_gammas, expert_betas, strict=True):
        rhs_g = rhs_g + mom.weight * mom.m * b_t.double()
        rhs_b = rhs_b + mom.weight * (mom.m * g_t.double() + b_t.double())
    a11, a12, a22 = sum_e + reg, sum_m, sum(m.weight for m in moments) + reg
    det = a11 * a22 - a12 * a12
    gamma = (a22 * rhs_g - a12 * rhs_b) / det
    beta = (a11 * rhs_b - a12 * rhs_g) / det
    return gamma, beta


def solve_regmean_weight(
    tasks: Iterable[tuple[torch.Tensor, torch.Tensor]], off_diagonal: float, eps: float, mixed: bool = False,
) -> LinearSolution:
    """RegMean (Jin et al., 2023): Wᵀ = (Σ_t G̃_t)⁻¹ Σ_t G̃_t W_tᵀ with G̃_t = a·G_t + (1−a)·diag(G_t).

    `tasks` yields (G_t, W_t), W_t [out, in], one task at a time. G_t should be a per-token mean
    E_w[x xᵀ], not a sum, so every task weighs the same whatever its number of tokens. a = 1 is the
    exact minimiser of Σ_t ‖X_t Wᵀ − X_t W_tᵀ‖²; a < 1 shrinks towards each task's own weights.
    `eps` is the initial Cholesky damping (it grows ×10 on failure; the solution says what was used)."""
    if not 0 < off_diagonal <= 1:
        raise ValueError(f"off_diagonal must be in (0, 1], got {off_diagonal}")
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    for g, w_t in tasks:
        g = g.double()
        g_tilde = off_diagonal * g + (1.0 - off_diagonal) * torch.diag(g.diagonal())
        a = g_tilde if a is None else a + g_tilde
        rhs = g_tilde @ w_t.double().T
        b = rhs if b is None else b + rhs
    if a is None or b is None:
        raise ValueError("solve_regmean_weight needs at least one task")
    return _ridge(a, b, eps, mixed)


@dataclass
class PinvSolution:
    weight: torch.Tensor
    rank: int  # the input directions the pseudoinverse keeps (of the input width)


def solve_lot_weight(tasks: Iterable[tuple[torch.Tensor, torch.Tensor]], base: torch.Tensor) -> PinvSolution:
    """LOT Merging (Sun et al., 2025) for one linear map: W = W0 + T with Tᵀ = (Σ_t S_t)⁺ Σ_t S_t T_tᵀ, T_t = W_t − W0
    and S_t = X_tᵀX_t summed over task t's real tokens (not a mean: the tasks weigh by their token counts, as the
    closed form's sums over concatenated rows do). It is the least-squares T of least norm: along input directions no
    task's rows reach, T is 0 and W stays at the base's weights (RegMean's W there comes from its damping and its
    diagonal term).

    `tasks` yields (S_t, W_t), W_t [out, in], one task at a time; `base` is W0. The pseudoinverse keeps the eigen-
    directions of Σ_t S_t at or above UNRESOLVED of its Frobenius norm (the rank numerical_rank counts): those below
    are within the fp32 rounding its sums carry, and inverting them would fit that rounding."""
    w0 = base.double()
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    for s_t, w_t in tasks:
        s_t = s_t.double()
        rhs = s_t @ (w_t.double() - w0).T
        a = s_t.clone() if a is None else a.add_(s_t)
        b = rhs if b is None else b.add_(rhs)
        del s_t, w_t, rhs  # before the next task's are read
    if a is None or b is None:
        raise ValueError("solve_lot_weight needs at least one task")
    floor = UNRESOLVED * float(torch.linalg.matrix_norm(a))
    evals, v = torch.linalg.eigh(a)
    kept = evals >= floor if floor > 0 else torch.zeros_like(evals, dtype=torch.bool)
    v = v[:, kept]
    t = v @ ((v.T @ b) / evals[kept][:, None])  # Tᵀ [in, out]
    return PinvSolution(weight=w0 + t.T, rank=int(kept.sum()))


def lot_norm_scale(sq_sums: Sequence[torch.Tensor], expert_gammas: Sequence[torch.Tensor],
                   base_gamma: torch.Tensor) -> torch.Tensor:
    """LOT Merging's norm scale: per dimension j, γ_j = γ0_j + Σ_t s_tj (γ_tj − γ0_j) / Σ_t s_tj with s_tj = Σ z_tj²
    over task t's real tokens (z: the norm's input normalised, before the affine), i.e. the least-norm task vector
    minimising Σ_t ‖(γ_t − γ) ⊙ z_t‖². A dimension no task's tokens reach (Σ_t s_tj = 0) keeps γ0_j, as the
    pseudoinverse of 0 is 0; otherwise it is a convex combination of the tasks' scales, so it needs no cut-off."""
    g0 = base_gamma.double()
    total = torch.zeros_like(g0)
    num = torch.zeros_like(g0)
    for s_t, g_t in zip(sq_sums, expert_gammas, strict=True):
        total += s_t.double()
        num += s_t.double() * (g_t.double() - g0)
    reached = total > 0
    return g0 + torch.where(reached, num / torch.where(reached, total, 1.0), 0.0)
