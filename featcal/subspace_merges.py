"""The merged task vector Δ of one 2-D tensor by its singular vectors (TSV-M, Iso-C, Iso-CTS) or by WUDI's data-free
least squares, from the experts' task vectors τ_t streamed one at a time (float64 in, float64 out).

Pure functions of one tensor's task vectors: featcal/merging.py registers them as merge methods and handles the
other tensors (1-D ones take the mean task vector, as these methods' papers and FusionBench do). None is elementwise,
so a tensor is merged whole, never by blocks of rows. Each reads the experts' copies one at a time; what it holds at
once is said per function."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

TaskVectors = Callable[[], Iterator[torch.Tensor]]  # yields τ_t (float64, 2-D) for t in task order, at each call


def polar(m: torch.Tensor) -> torch.Tensor:
    """The orthonormal factor P·Qᵀ of M = P·Σ·Qᵀ: the nearest matrix with orthonormal columns (or rows, when M is
    wide) to M, which is how TSV-M and Iso-CTS decorrelate the singular vectors gathered from several tasks."""
    p, _, qt = torch.linalg.svd(m, full_matrices=False)
    return p @ qt


def tsv_m(task_vectors: TaskVectors, tasks: int) -> torch.Tensor:
    """TSV-M: each task's top r = int(k·(1/T)) singular triplets (k = min(m, n)), their left and right vectors
    stacked over tasks and each stack replaced by its polar factor, then Σ_t U⊥ diag(σ) V⊥ᵀ. Holds T·r ≤ k
    singular triplets and one task vector at a time."""
    us, ss, vs = [], [], []
    shape: tuple[int, ...] = ()
    for tau in task_vectors():
        shape = tuple(tau.shape)
        u, s, vt = torch.linalg.svd(tau, full_matrices=False)
        r = int(s.shape[0] * (1 / tasks))  # FusionBench's count, float product and truncation included
        us.append(u[:, :r])
        ss.append(s[:r])
        vs.append(vt[:r])
    s = torch.cat(ss)
    if s.numel() == 0:  # fewer singular values than tasks: no task keeps any
        return torch.zeros(shape, dtype=torch.float64)
    return polar(torch.cat(us, 1)) @ torch.diag(s) @ polar(torch.cat(vs, 0))


def summed(task_vectors: TaskVectors) -> tuple[torch.Tensor, int]:
    """Σ_t τ_t added in task order onto zeros, and T: one pass that also counts the experts."""
    total, count = None, 0
    for tau in task_vectors():
        total = torch.zeros_like(tau) if total is None else total
        total += tau
        count += 1
    if total is None:
        raise ValueError("a merge needs at least one expert")
    return total, count


def iso_c(task_vectors: TaskVectors) -> torch.Tensor:
    """Iso-C: the summed task matrix U·diag(σ)·Vᵀ with every singular value replaced by their mean (an isotropic
    spectrum on the common subspace). Holds the sum and its SVD."""
    u, s, vt = torch.linalg.svd(summed(task_vectors)[0], full_matrices=False)
    return (u * s.mean()) @ vt


def iso_cts_sizes(k: int, tasks: int, common_fraction: float) -> tuple[int, int]:
    """(common directions, directions per task) of Iso-CTS for a matrix of k = min(m, n) singular values: the
    task-specific share (1 − f)·k rounded to a multiple of T (half to even, as Python's round and FusionBench)."""
    common = int(k * common_fraction)
    specific = round((k - common) / tasks) * tasks
    return k - specific, specific // tasks


def iso_cts(task_vectors: TaskVectors, common_fraction: float) -> torch.Tensor:
    """Iso-CTS: the top directions of the summed task matrix (the common subspace) plus, per task, the top directions
    of its task vector with the common left subspace projected out; the gathered left and right vectors each
    replaced by their polar factor, and every singular value by the mean of the gathered ones. Two passes over the
    experts (the first also counts them); holds the sum's SVD, then k kept triplets and one task vector at a time."""
    total, tasks = summed(task_vectors)
    u, s, vt = torch.linalg.svd(total, full_matrices=False)
    common, per_task = iso_cts_sizes(s.shape[0], tasks, common_fraction)
    u_c = u[:, :common]
    us, ss, vs = [u_c], [s[:common]], [vt[:common]]
    del u, vt
    for tau in task_vectors():
        u_t, s_t, vt_t = torch.linalg.svd(tau - u_c @ (u_c.T @ tau), full_matrices=False)
        us.append(u_t[:, :per_task])
        ss.append(s_t[:per_task])
        vs.append(vt_t[:per_task])
    kept = torch.cat(ss)
    return (polar(torch.cat(us, 1)) * kept.mean()) @ polar(torch.cat(vs, 0))


def wudi(task_vectors: TaskVectors, steps: int, lr: float) -> torch.Tensor:
    """WUDI: Δ minimising L(Δ) = Σ_t ‖(Δ − τ_t)·τ_tᵀ‖²_F / ‖τ_t‖²_F, from Δ = Σ_t τ_t, by `steps` Adam steps of rate
    `lr` (torch's Adam, betas (0.9, 0.999), eps 1e-8, as FusionBench). The loss is tr((Δ − τ_t)·G_t·(Δ − τ_t)ᵀ)/‖τ_t‖²
    with G_t = τ_tᵀτ_t, so its gradient 2·(Δ·A − B), A = Σ_t G_t/‖τ_t‖², B = Σ_t τ_t·G_t/‖τ_t‖², comes from two
    sums gathered in one pass over the experts: each step costs one m×n by n×n product (2mn² flops) whatever T,
    and memory holds A (n²), B, Δ and Adam's two moments (4·mn), never the T task vectors at once."""
    total: torch.Tensor | None = None
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    for tau in task_vectors():
        norm2 = float(torch.linalg.vector_norm(tau)) ** 2
        if norm2 == 0.0:  # an expert that left this tensor alone adds nothing to the loss
            total = tau.clone() if total is None else total.add_(tau)
            continue
        g = (tau.T @ tau) / norm2
        tg = tau @ g
        total = tau.clone() if total is None else total.add_(tau)
        a = g if a is None else a.add_(g)
        b = tg if b is None else b.add_(tg)
    if total is None:
        raise ValueError("a merge needs at least one expert")
    if a is None or b is None:
        return total
    delta = total
    optimiser = torch.optim.Adam([delta], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)
    for _ in range(steps):
        delta.grad = 2.0 * (delta @ a - b)
        optimiser.step()
    return delta


def wudi_loss(delta: torch.Tensor, task_vectors: TaskVectors) -> float:
    """WUDI's objective at Δ, summed term by term as its definition reads: for the tests and the benchmark."""
    loss = 0.0
    for tau in task_vectors():
        norm2 = float(torch.linalg.vector_norm(tau)) ** 2
        if norm2 > 0.0:
            loss += float(torch.linalg.matrix_norm((delta - tau) @ tau.T)) ** 2 / norm2
    return loss
