"""Running statistics of calibrated modules' inputs: float64 sums fed chunk by chunk by the Gram kernel.

Two savings keep the Gram stage near its floor (docs/design.md §3):
- modules that read the very same input (q/k/v, gate/up) with the same token weights share one set of input
  sums (C_ss, C_se, means): the first of them in block order owns it, the stats file stores it once, named for all
  its readers (`q+k+v:ss`);
- a module keeps the expert side in the cheaper of two forms: C_se = Σ w x_s x_eᵀ (in × in), which the solve
  multiplies by W_tᵀ in float64, or the product it stands for, P_t = Σ w x_s (W_t x_t)ᵀ (in × out, fp32 within a
  chunk), with W_t x_t = α·y_e + (1−α)·W_t x_s: y_e = W_t x_e is the expert module's own output, so P_t costs
  W_t x_s and one product, for the run's α (featcal.alpha, part of the Gram stage's key);
- an input whose rows, all tasks' together, are few against its width keeps the rows themselves (x_s and the token
  weights, once for all its readers, and each reader's target W_t x_t) instead of any in × in sum, where the
  method's solve takes them (StatisticsPlan.rows) and runtime.row_statistics allows: no Gram products at all, and
  solves in row form (featcal.closed_form.solve_linear_weight_rows) that cost less than the Gram's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import cast

import torch
from torch import nn

import featcal_kernels
from featcal.closed_form import LinearMoments, LinearRows, NormMoments
from featcal.modeling import as_out_in, is_norm, linear_dims, normalized
from featcal_kernels.bf16 import bf16_target_product, bf16_units_serve

# How a module's statistics keep the expert side: not at all (RegMean's C_ss only), C_se, P_t, or its rows.
FORMS = ("none", "gram", "product", "rows")
# Joins the names of the modules that read one input, in the key of its sums (module names never hold it).
READERS = "+"


# How much cheaper P_t must be than C_se to be kept instead. C_se has an edge in accuracy: in the solve C_st·W_tᵀ is
# then formed from the same rounded sums as C_ss, and with one expert at λ → 0 those roundings cancel (the solve gives
# W_t back); P_t's own rounding does not cancel. At 1 (cost alone) the single-expert exactness test's BERT features
# move 1.5e-4 from the expert's, past its 1e-4; at 1.5, 5.9e-5, where they were when P_e and P_s were kept apart.
PRODUCT_MARGIN = 1.5


def expert_side_form(rows: int, d_in: int, d_out: int, sharers: int) -> str:
    """'product' when P_t (4·rows·in·out fp32 FLOPs: W_t x_s and one product), with PRODUCT_MARGIN, costs less than
    C_se shared by `sharers` modules (2·rows·in²/sharers) plus its float64 product with W_tᵀ in the solve
    (2·in²·out at about half the fp32 rate); else 'gram'. `rows` is the task's token rows for the module."""
    product = PRODUCT_MARGIN * 4 * rows * d_out
    return "product" if product < 2 * rows * d_in / sharers + 4 * d_in * d_out else "gram"


def row_form_pays(rows: int, tasks: int, d_in: int, d_outs: Sequence[int]) -> bool:
    """Whether keeping an input's rows beats its Gram for the modules that read it (their output widths `d_outs`):
    each one's row-form solve in float64 multiply-adds (n = tasks·rows: Q·A(W)ᵀ and Qᵀ·S, QQᵀ, the n × n Cholesky
    and its solves) against the Gram stage's fp32 C_ss products (once for all readers) and each one's in × in solve
    in float64 (at half the fp32 rate). `rows` is a task's token rows for the input."""
    n = tasks * rows
    row_form = sum(2 * (4 * n * d_in * d_out + 2 * n * n * d_in + n**3 // 3 + 2 * n * n * d_out) for d_out in d_outs)
    gram_form = tasks * 2 * rows * d_in * d_in + sum(2 * (d_in**3 // 3 + 2 * d_in * d_in * d_out) for d_out in d_outs)
    return row_form < gram_form


# Rows of a fp32 chunk sum widened into a float64 running sum at a time: 2 MiB of float64.
WIDEN_BYTES = 2 * 2**20


def add_widened(total: torch.Tensor, part: torch.Tensor) -> None:
    """total += part, a float64 running sum and a chunk's fp32 sum, a band of rows at a time. Added whole, the
    mixed-dtype add first widens all of `part` into a fresh float64 temporary (75 MB for a d = 3072 Gram) whose page
    faults cost more than the add; band by band the temporary stays small and in cache. The same sums, bit for bit."""
    if part.dim() < 2:
        total.add_(part)
        return
    rows = max(1, WIDEN_BYTES // (8 * part[0].numel()))
    for start in range(0, part.shape[0], rows):
        total[start:start + rows].add_(part[start:start + rows])


class InputSums:
    """Σ w x_s x_sᵀ (and Σ w x_s x_eᵀ when some reader keeps C_se), Σ w x_s, Σ w x_e, Σ w of one module input; in
    row form (`rows`: its readers all keep rows) the rows of non-zero weight and their weights instead of C_ss."""

    def __init__(self, dim: int, with_se: bool, device: torch.device | None = None, rows: bool = False):
        f64 = torch.float64
        self.ss = None if rows else torch.zeros(dim, dim, dtype=f64, device=device)
        self.se = torch.zeros(dim, dim, dtype=f64, device=device) if with_se else None
        self.rows: dict[str, list[torch.Tensor]] | None = {"xs": [], "w": []} if rows else None  # one entry per chunk
        self.sum_s = torch.zeros(dim, dtype=f64, device=device)
        self.sum_e = torch.zeros(dim, dtype=f64, device=device)
        self.sum_w = torch.zeros((), dtype=f64, device=device)
        self.flops = 0

    def add(self, xs: torch.Tensor, xe: torch.Tensor, w: torch.Tensor) -> None:
        if self.rows is not None:  # x_s as it came (bf16 rows widen exactly in the solve)
            w32 = w.float()
            self.sum_s += xs.float().T @ w32
            self.sum_e += xe.float().T @ w32
            self.sum_w += w.double().sum()
            keep = w > 0
            self.rows["xs"].append(xs[keep])
            self.rows["w"].append(w32[keep])
            return
        assert self.ss is not None  # C_ss is kept whenever rows are not
        g = featcal_kernels.dual_gram(xs, xe if self.se is not None else None, w)
        add_widened(self.ss, g.c_ss)
        self.sum_s += g.sum_s
        self.sum_w += g.sum_w
        rows, dim = xs.shape
        self.flops += rows * dim * (dim + 1)  # C_ss: one triangle
        if self.se is not None:
            add_widened(self.se, g.c_se)
            self.sum_e += g.sum_e
            self.flops += 2 * rows * dim * dim
        else:
            self.sum_e += xe.float().T @ w.float()

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"sum_s": self.sum_s, "sum_e": self.sum_e, "sum_w": self.sum_w}
        if self.rows is not None:
            return {**out, **{key: torch.cat(parts) for key, parts in self.rows.items()}}
        assert self.ss is not None  # C_ss is kept whenever rows are not
        out["ss"] = self.ss
        return out if self.se is None else {**out, "se": self.se}


class LinearStats:
    """One linear module's statistics: the sums of its input (its own, or shared with the module `owner` that
    reads the same input) and, in product form, P_t for the target mix `alpha`; in row form the targets of the
    input's rows instead."""

    def __init__(self, d_in: int, d_out: int, form: str, owner: str, inputs: InputSums, alpha: float | None):
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {form!r}")
        if form in ("product", "rows") and alpha is None:
            raise ValueError(f"{form}-form statistics need featcal.alpha, the target mix they keep")
        self.form, self.owner, self.inputs, self.alpha = form, owner, inputs, alpha
        device = inputs.sum_s.device
        self.pt = torch.zeros(d_in, d_out, dtype=torch.float64, device=device) if form == "product" else None
        self.targets: list[torch.Tensor] = []  # row form: one entry per chunk
        self.flops = 0

    def add_target_product(self, xs: torch.Tensor, w: torch.Tensor, w_t: torch.Tensor, y: torch.Tensor,
                           bias: torch.Tensor | None) -> None:
        """P_t += Σ w x_s (α·y_e + (1−α)·W_t x_s)ᵀ with y_e = W_t x_e = y − bias (y the expert module's output) and
        W_t [out, in]. bf16 rows, output and W_t on a CPU with bf16 units: on those units
        (featcal_kernels.bf16.bf16_target_product); else in fp32."""
        pt, alpha = self.pt, self.alpha
        assert pt is not None and alpha is not None  # product form: both set in __init__
        w32 = w.float()
        if y.dtype == w_t.dtype == torch.bfloat16 and bf16_units_serve(xs, y, w32):
            add_widened(pt, bf16_target_product(xs, w32, w_t, y, bias, alpha))
        else:
            xs32 = xs.float()
            target = torch.mm(xs32, w_t.float().T).mul_(1.0 - alpha)
            target.add_(y.float() if bias is None else y.float() - bias.float(), alpha=alpha)
            add_widened(pt, (xs32 * w32[:, None]).T @ target)
        self.flops += 4 * xs.shape[0] * w_t.shape[0] * w_t.shape[1]

    def add_rows(self, xs: torch.Tensor, w: torch.Tensor, w_t: torch.Tensor, y: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        """Row form: W_t x_t = α·y_e + (1−α)·W_t x_s in fp32 (y_e = y − bias, as add_target_product) for the chunk's
        rows of non-zero weight, the rows the input keeps."""
        alpha = self.alpha
        assert alpha is not None  # row form: set in __init__
        keep = w > 0
        xs, y = xs[keep], y[keep]
        target = torch.mm(xs.float(), w_t.float().T).mul_(1.0 - alpha)
        target.add_(y.float() if bias is None else y.float() - bias.float(), alpha=alpha)
        self.targets.append(target)
        self.flops += 2 * xs.shape[0] * w_t.shape[0] * w_t.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.form == "rows":
            return {"yt": torch.cat(self.targets)}
        return {} if self.pt is None else {"pt": self.pt}


class NormStats:
    def __init__(self, dim: int, device: torch.device | None = None):
        self.sum_z = torch.zeros(dim, dtype=torch.float64, device=device)
        self.sum_z2 = torch.zeros(dim, dtype=torch.float64, device=device)
        self.sum_w = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, z: torch.Tensor, w: torch.Tensor) -> None:
        wz = w[:, None] * z
        self.sum_z += wz.sum(0).double()
        self.sum_z2 += (wz * z).sum(0).double()
        self.sum_w += w.double().sum()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"sum_z": self.sum_z, "sum_z2": self.sum_z2, "sum_w": self.sum_w}


Stats = dict[str, LinearStats | NormStats]


def _positive(sum_w: torch.Tensor, module: str) -> float:
    total = float(sum_w)
    if total <= 0:
        raise ValueError(f"module {module}: no token carries weight (Σw = {total}); is every token padding?")
    return total


def linear_moments(t: dict[str, torch.Tensor], module: str, in_place: bool = False) -> LinearMoments:
    """The moments of one module's sums. `in_place`: the sums are the caller's to overwrite (freshly read from a
    file), so they become the moments without a second d×d buffer each (fc2's C_ss is 75 MB on ViT-B/32)."""
    sw = _positive(t["sum_w"], module)

    def of(key: str) -> torch.Tensor:
        return t[key].div_(sw) if in_place else t[key] / sw

    def mean(key: str) -> torch.Tensor | None:
        return of(key) if key in t else None

    if "xs" in t:  # row form, asked for its in × in moments
        return linear_rows(t, module).moments(of("sum_s"), of("sum_e"))
    return LinearMoments(c_ss=of("ss"), mu_s=of("sum_s"), mu_e=of("sum_e"), c_se=mean("se"), p_st=mean("pt"))


def linear_rows(t: dict[str, torch.Tensor], module: str) -> LinearRows:
    """One module's row-form statistics (keys xs, yt, w besides the input's sums)."""
    return LinearRows(x=t["xs"], y=t["yt"], w=t["w"], sum_w=_positive(t["sum_w"], module))


def input_gram_sum(t: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """Σ_w x_s x_sᵀ of one module's sums, not divided by Σw: LOT Merging's X_tᵀX_t, whose sum over tasks weighs each
    task by its tokens."""
    _positive(t["sum_w"], module)
    if "ss" not in t:
        raise ValueError(f"module {module}: its statistics keep rows, not the input Gram ss that this solve reads")
    return t["ss"]


def norm_sq_sum(t: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """Σ_w z_s² per dimension of one norm's sums, not divided by Σw (LOT Merging's weights of the tasks' scales)."""
    _positive(t["sum_w"], module)
    return t["sum_z2"]


def norm_moments(t: dict[str, torch.Tensor], module: str) -> NormMoments:
    sw = _positive(t["sum_w"], module)
    return NormMoments(m=t["sum_z"] / sw, e=t["sum_z2"] / sw)


# Prefix of the held-out rows' sums in a statistics file (kept besides the all-row sums when λ or ρ is auto).
HELD = "held_"


def held_prefix(fold: int) -> str:
    """The prefix of held-out fold `fold`'s sums: HELD for the first (the only one without cross-validation), then
    held1_, held2_, … (no module sum's own key starts with "held")."""
    return HELD if fold == 0 else f"held{fold}_"


def flatten_stats(stats: Stats, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor once, as `name:key`: a module's own sums under its name, an input's sums under the names of
    all the modules that read it joined by READERS."""
    flat = {}
    for module, s in stats.items():
        if isinstance(s, LinearStats) and s.owner == module:
            readers = READERS.join(m for m, r in stats.items() if isinstance(r, LinearStats) and r.owner == module)
            flat.update({f"{readers}:{prefix}{k}": v.cpu().contiguous() for k, v in s.inputs.tensors().items()})
        flat.update({f"{module}:{prefix}{k}": v.cpu().contiguous() for k, v in s.tensors().items()})
    return flat


def module_keys(keys: list[str], module: str) -> dict[str, str]:
    """The keys of a statistics file that hold `module`'s sums (its own, and those of the input it reads), each
    mapped to its key among the module's sums."""
    return {key: key.rsplit(":", 1)[1] for key in keys if module in key.rsplit(":", 1)[0].split(READERS)}


def shared_inputs(keys: list[str]) -> set[tuple[str, ...]]:
    """The inputs that several modules read, each as its readers in the order the statistics file names them."""
    return {tuple(owner.split(READERS)) for owner in (key.rsplit(":", 1)[0] for key in keys) if READERS in owner}


def stats_flops(stats: Stats) -> int:
    """Multiply-adds ×2 of the products the statistics took (input sums counted once)."""
    linear = [s for s in stats.values() if isinstance(s, LinearStats)]
    return sum(s.flops for s in linear) + sum(s.inputs.flops for m, s in stats.items()
                                               if isinstance(s, LinearStats) and s.owner == m)


def held_out_sums(t: dict[str, torch.Tensor], fold: int = 0) -> dict[str, torch.Tensor]:
    """One module's sums over the held-out rows of fold `fold`."""
    prefix = held_prefix(fold)
    return {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix)}


def fit_sums(t: dict[str, torch.Tensor], fold: int = 0) -> dict[str, torch.Tensor]:
    """One module's sums over the rows that fold `fold` does not hold out: all own rows minus that fold's, and (with
    shared inputs) all foreign rows minus those of the examples their own task holds out in that fold."""
    prefix = held_prefix(fold)

    def fitted(key: str, value: torch.Tensor) -> torch.Tensor:
        own = key[len(FOREIGN):] if key.startswith(FOREIGN) else key
        foreign = key.startswith(FOREIGN)
        held = (FOREIGN if foreign else "") + prefix + own
        return value - t[held] if held in t or not foreign else value  # own rows always have their fold's sums

    return {k: fitted(k, v) for k, v in t.items() if not k.startswith(("held", FOREIGN + "held"))}


# Prefix of the foreign rows' sums in a statistics file (calibration.shared_inputs): the other tasks' inputs (and the
# pool's) through this task's expert; the unprefixed sums are then the task's own rows' alone. Under FOREIGN + the
# fold's held prefix: the foreign rows of the examples their own task holds out in that fold.
FOREIGN = "foreign_"


def foreign_sums(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """One module's sums over its task's foreign rows (all of them), or None when the task has none."""
    out = {k[len(FOREIGN):]: v for k, v in t.items() if k.startswith(FOREIGN) and not k.startswith(FOREIGN + "held")}
    return out or None


def example_rows(
    weights: dict[str, torch.Tensor], examples: torch.Tensor, *sides: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], ...]:
    """The token weights, then each side's module tensors (inputs, or outputs where a side has them), of the
    chunk's `examples` (a bool per example).

    A module's rows are its examples' tokens in example order (B·T, or B·T_encoder for cross-attention keys
    and values, or B when it reads one token per example), so row r belongs to example r // (rows / B)."""
    chosen: list[dict[str, torch.Tensor]] = [{} for _ in range(1 + len(sides))]
    for name, w in weights.items():
        rows = examples.repeat_interleave(w.shape[0] // examples.shape[0])
        for out, source in zip(chosen, (weights, *sides), strict=True):
            if name in source:
                out[name] = source[name][rows]
    return tuple(chosen)


def _same_input(a: str, b: str, weights: dict[str, torch.Tensor], sides: tuple[dict[str, torch.Tensor], ...]) -> bool:
    def same(x: torch.Tensor, y: torch.Tensor) -> bool:
        return x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()

    return all(same(s[a], s[b]) for s in sides) and torch.equal(weights[a], weights[b])


def input_owners(names: list[str], weights: dict[str, torch.Tensor], *sides: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each linear module → the first module (in block order) that reads the very same tensor on every side with
    equal token weights; its input sums serve both."""
    owners: dict[str, str] = {}
    for name in names:
        owners[name] = next((o for o in dict.fromkeys(owners.values()) if _same_input(o, name, weights, sides)), name)
    return owners


def new_stats(modules: dict[str, nn.Module], forms: dict[str, str] | None = None,
              owners: dict[str, str] | None = None, device: torch.device | None = None,
              alpha: float | None = None) -> Stats:
    """Empty statistics (on `device`: where the Gram sums run); by default every linear module owns its input's
    sums and keeps C_se. Product-form modules need the target mix `alpha`."""
    forms, owners = forms or {}, owners or {}
    sums: dict[str, InputSums] = {}
    out: Stats = {}
    for name, m in modules.items():
        if is_norm(m):
            out[name] = NormStats(cast(torch.Tensor, m.weight).shape[0], device)
            continue
        d_in, d_out = linear_dims(m)
        owner = owners.get(name, name)
        if owner not in sums:
            readers = [n for n in modules if owners.get(n, n) == owner]
            sums[owner] = InputSums(d_in, any(forms.get(n, "gram") == "gram" for n in readers), device,
                                    rows=all(forms.get(n, "gram") == "rows" for n in readers))
        out[name] = LinearStats(d_in, d_out, forms.get(name, "gram"), owner, sums[owner], alpha)
    return out


@contextmanager
def captured_inputs(modules: dict[str, nn.Module], sink: dict[str, torch.Tensor],
                    outputs: dict[str, torch.Tensor] | None = None) -> Iterator[None]:
    """Record each module's first positional input, flattened to [tokens, features], while the block runs; with
    `outputs`, each module's output too."""

    def pre_hook(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0]
            sink[name] = x.reshape(-1, x.shape[-1])

        return hook

    def post_hook(name: str, into: dict[str, torch.Tensor]):
        def hook(module: nn.Module, args: tuple, y: torch.Tensor) -> None:
            into[name] = y.reshape(-1, y.shape[-1])

        return hook

    handles = [m.register_forward_pre_hook(pre_hook(name)) for name, m in modules.items()]
    if outputs is not None:
        handles += [m.register_forward_hook(post_hook(name, outputs)) for name, m in modules.items() if not is_norm(m)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def per_row_weights(name: str, xs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A norm's weights per input row. A per-head norm (Qwen3's q/k norms) reads [B, T, heads, head_dim], so its
    rows come `heads` to a token, token-major: each takes its token's weight."""
    per_token, rest = divmod(xs.shape[0], w.shape[0])
    if rest or not per_token:
        raise ValueError(f"module {name}: input has {xs.shape[0]} rows, not a whole number per token weight "
                         f"({w.shape[0]})")
    return w if per_token == 1 else w.repeat_interleave(per_token)


def accumulate(
    stats: Stats, modules: dict[str, nn.Module], merged_inputs: dict[str, torch.Tensor],
    expert_inputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
    expert_outputs: dict[str, torch.Tensor] | None = None, expert_modules: dict[str, nn.Module] | None = None,
) -> None:
    """Add one chunk's module inputs (both sides) into the running sums; weights are per token. Product-form
    modules also need the expert modules and their outputs on the expert side."""
    for name, s in stats.items():
        xs, w = merged_inputs[name], weights[name]
        if isinstance(s, NormStats):
            s.add(normalized(modules[name], xs), per_row_weights(name, xs, w))
            continue
        if xs.shape[0] != w.shape[0]:
            raise ValueError(f"module {name}: input has {xs.shape[0]} token rows, token weights have {w.shape[0]}")
        if s.owner == name:
            s.inputs.add(xs, expert_inputs[name], w)
        if s.form in ("product", "rows"):
            if expert_outputs is None or expert_modules is None:
                raise ValueError(f"module {name}: {s.form}-form statistics need the expert module and its outputs")
            expert = expert_modules[name]
            add = s.add_rows if s.form == "rows" else s.add_target_product
            # nn.Module types its attributes as Tensor | Module; a linear module's weight and bias are tensors
            weight, bias = cast(torch.Tensor, expert.weight), cast("torch.Tensor | None", expert.bias)
            add(xs, w, as_out_in(expert, weight), expert_outputs[name], bias)


def stats_layout(modules: dict[str, nn.Module], weights: dict[str, torch.Tensor],
                 sides: tuple[dict[str, torch.Tensor], ...],
                 examples: int, chunk_examples: int, keeps_expert: bool,
                 rows_of_tasks: int = 0) -> tuple[dict[str, str], dict[str, str]]:
    """(form, owner of the input sums) of each linear module, from a task's first chunk of module inputs: the form
    for the task's `examples` examples (the chunk has `chunk_examples`), 'none' when the expert side is not kept.
    `rows_of_tasks` > 0: the solve takes rows, from that many tasks: the modules that read one input all keep its
    rows where that pays for them together (row_form_pays, each task taken to have this task's rows)."""
    linear = [n for n, m in modules.items() if not is_norm(m)]
    owners = input_owners(linear, weights, *sides)
    forms = {}
    for name in linear:
        d_in, d_out = linear_dims(modules[name])
        rows = sides[0][name].shape[0] // chunk_examples * examples
        readers = [n for n in linear if owners[n] == owners[name]]
        if not keeps_expert:
            forms[name] = "none"
        elif rows_of_tasks and row_form_pays(rows, rows_of_tasks, d_in, [linear_dims(modules[n])[1] for n in readers]):
            forms[name] = "rows"
        else:
            forms[name] = expert_side_form(rows, d_in, d_out, len(readers))
    return forms, owners
