"""featcal.head_metric: the last block's output.dense weighs each task's output error through the task's head
(docs/design.md §2.8). The solve against a dense Kronecker brute force, the head map against autograd on a tiny BERT,
and a real run that changes that one module and nothing else."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import BertConfig, BertForSequenceClassification, ViTConfig, ViTForImageClassification

from featcal import closed_form
from featcal.adapters import UnsupportedModelError, adapter_for
from featcal.closed_form import (
    BiasTerm,
    Hyper,
    LinearMoments,
    anchor,
    head_factor,
    head_metric,
    solve_linear_bias,
    solve_linear_weight,
    solve_linear_weight_head,
)
from featcal.config import ConfigError
from flows.pipeline import run_pipeline
from storage.checkpoint import CanonicalCheckpoint
from storage.rundir import RunDir
from tests.conftest import example_config
from tests.test_architectures import VISION
from tests.test_head_side import _build as build_head_side_case

D_IN, D_OUT, T, K = 7, 5, 3, 2
WEIGHTS = (1.0, 2.0, 0.5)


@pytest.fixture
def problem():
    g = torch.Generator().manual_seed(0)
    tasks = []
    for c in WEIGHTS:
        xs = torch.randn(40, D_IN, generator=g, dtype=torch.float64)
        xe = xs + 0.3 * torch.randn(40, D_IN, generator=g, dtype=torch.float64)
        mom = LinearMoments(c_ss=xs.T @ xs / 40, mu_s=xs.mean(0), mu_e=xe.mean(0), c_se=xs.T @ xe / 40, weight=c)
        tasks.append((mom, torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64),
                      head_factor(torch.randn(K, D_OUT, generator=g, dtype=torch.float64))))
    w_m, w_0 = (torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64) for _ in range(2))
    return tasks, w_m, w_0


def _brute_force(tasks, w_m, w_0, hp: Hyper, eta: float) -> torch.Tensor:
    """The objective's normal equations written out as one dense (in·out)² system on vec(W), column-major:
    vec(M W C) = (Cᵀ ⊗ M) vec(W)."""
    eye, n = torch.eye(D_OUT, dtype=torch.float64), D_IN * D_OUT
    lhs = (hp.lam + hp.eps) * torch.eye(n, dtype=torch.float64)
    rhs = hp.lam * anchor(w_m, w_0, hp.rho).T.reshape(-1)
    for mom, w_t, u_t in tasks:
        metric = (1 - eta) * eye + eta * u_t.T @ u_t
        target = float(mom.c_ss.diagonal().mean()) * torch.eye(D_IN, dtype=torch.float64)
        c_ss = (1 - hp.shrink) * mom.c_ss + hp.shrink * target
        c_st = (1 - hp.shrink) * (hp.alpha * mom.c_se + (1 - hp.alpha) * mom.c_ss) + hp.shrink * target
        n_t = float(torch.linalg.matrix_norm(mom.c_ss)) / mom.weight
        lhs += (torch.kron(c_ss.T.contiguous(), metric) + hp.trust * torch.kron(c_ss.T.contiguous(), eye)) / n_t
        rhs += ((metric @ w_t @ c_st.T).T.reshape(-1) + hp.trust * (w_m @ c_ss.T).T.reshape(-1)) / n_t
    return torch.linalg.solve(lhs, rhs).reshape(D_IN, D_OUT).T


@pytest.mark.parametrize("eta", [0.5, 1.0])
@pytest.mark.parametrize("trust,shrink", [(0.0, 0.0), (0.5, 0.2)])
def test_head_metric_solve_equals_the_dense_brute_force(problem, eta, trust, shrink):
    tasks, w_m, w_0 = problem
    hp = Hyper(lam=0.1, rho=2.0, alpha=0.25, eps=1e-12, trust=trust, shrink=shrink)
    sol = solve_linear_weight_head(tasks, w_m, w_0, hp, eta)
    ref = _brute_force(tasks, w_m, w_0, hp, eta)
    torch.testing.assert_close(sol.weight, ref, rtol=0, atol=1e-10 * float(ref.abs().max()))
    steps = int(sol.path.split(", ")[1].split()[0])
    assert 0 < steps < 200
    plain = solve_linear_weight([(m, w) for m, w, _ in tasks], w_m, w_0, hp).weight
    assert float((plain - ref).abs().max()) > 1e-3  # the metric changes the answer: the test can fail


@pytest.mark.parametrize("shared_object", [True, False])
def test_tasks_that_read_one_head_share_a_gram_and_match_the_brute_force(problem, shared_object):
    """Every task with the same U (one tensor, as a causal LM's merged head gives, or equal values): one summed Gram
    serves them, the preconditioner is then the whole system, and the weight is the dense brute force's."""
    tasks, w_m, w_0 = problem
    u = tasks[0][2]
    shared = [(mom, w_t, u if shared_object else u.clone()) for mom, w_t, _ in tasks]
    hp = Hyper(lam=0.1, rho=2.0, alpha=0.25, eps=1e-12, trust=0.5, shrink=0.2)
    sol = solve_linear_weight_head(shared, w_m, w_0, hp, 1.0)
    ref = _brute_force(shared, w_m, w_0, hp, 1.0)
    torch.testing.assert_close(sol.weight, ref, rtol=0, atol=1e-10 * float(ref.abs().max()))
    assert sol.path == "head metric, 0 CG steps"


def test_a_solve_that_does_not_converge_says_so(problem, monkeypatch):
    tasks, w_m, w_0 = problem
    monkeypatch.setattr(closed_form, "HEAD_MAX_STEPS", 2)
    with pytest.raises(ValueError, match=r"^featcal.head_metric: conjugate gradients left a relative residual of "
                                         r"\S+ after 2 steps \(asked 1e-12\); lower featcal.head_metric"):
        solve_linear_weight_head(tasks, w_m, w_0, Hyper(lam=0.1, rho=2.0, alpha=0.25, eps=1e-12), 1.0)


def test_zero_eta_is_the_plain_solve_without_a_step(problem):
    tasks, w_m, w_0 = problem
    hp = Hyper(lam=0.1, rho=2.0, alpha=0.25, eps=1e-12, trust=0.5, shrink=0.2)
    sol = solve_linear_weight_head(tasks, w_m, w_0, hp, 0.0)
    plain = solve_linear_weight([(m, w) for m, w, _ in tasks], w_m, w_0, hp)
    torch.testing.assert_close(sol.weight, plain.weight, rtol=0, atol=1e-14)
    assert sol.path == "head metric, 0 CG steps"


def test_head_metric_bias_zeroes_the_objectives_gradient(problem):
    """The bias's objective Σ_t (b − r_t)ᵀM_t(b − r_t)/n_t + μ Σ_t ‖b − r_m,t‖²/n_t + λ‖b − A(b)‖²,
    r_t = b_t + W_t μ_t − W μ_s and r_m,t = b_m + (W_m − W) μ_s, differentiated by autograd: its gradient at the
    solved bias is zero."""
    tasks, w_m, w_0 = problem
    hp = Hyper(lam=0.1, rho=2.0, alpha=0.25, eps=1e-12, trust=0.5)
    g = torch.Generator().manual_seed(1)
    b_m, b_0 = (torch.randn(D_OUT, generator=g, dtype=torch.float64) for _ in range(2))
    weight = torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64)
    terms = [BiasTerm.of(mom, w_t, torch.randn(D_OUT, generator=g, dtype=torch.float64), hp.alpha,
                         head_metric(u_t, 0.7)) for mom, w_t, u_t in tasks]
    bias = solve_linear_bias(terms, weight, b_m, b_0, hp, merged_weight=w_m).requires_grad_()
    loss = hp.lam * (bias - anchor(b_m, b_0, hp.rho)).pow(2).sum()
    for term in terms:
        r = bias - (term.expert_out - weight @ term.mu_s)
        r_m = bias - (b_m + (w_m - weight) @ term.mu_s)
        loss = loss + term.inv_n * (r @ term.metric @ r + hp.trust * r_m @ r_m)
    (grad,) = torch.autograd.grad(loss, bias)
    assert float(grad.abs().max()) < 1e-12
    plain = solve_linear_bias([BiasTerm(t.inv_n, t.mu_s, t.expert_out) for t in terms], weight, b_m, b_0, hp,
                              merged_weight=w_m)
    assert float((plain - bias.detach()).abs().max()) > 1e-3  # the metric moves the bias: the test can fail


def test_head_factor_has_the_identitys_trace_and_refuses_a_zero_head():
    u = head_factor(torch.randn(3, D_OUT, dtype=torch.float64))
    assert float(torch.trace(u.T @ u)) == pytest.approx(D_OUT, rel=1e-12)
    with pytest.raises(ValueError, match="head map is all zeros"):
        head_factor(torch.zeros(2, D_OUT))


def _bert_path(config: BertConfig):
    """A tiny BERT classifier, its last norm, and what its logits make of y, the last output.dense's output, with the
    pooler's tanh replaced by the identity."""
    model = BertForSequenceClassification(config).eval()
    model.bert.pooler.activation = torch.nn.Identity()
    norm = model.bert.encoder.layer[-1].output.LayerNorm
    return model, norm, lambda x, y: model.classifier(model.bert.pooler.dense(norm(x + y)))


def _vit_path(config: ViTConfig):
    """A tiny ViT classifier, its final norm, and what its logits make of y, the last mlp.fc2's output."""
    model = ViTForImageClassification(config).eval()
    return model, model.vit.layernorm, lambda x, y: model.classifier(model.vit.layernorm(x + y))


@pytest.mark.parametrize("arch", ["bert", "vit"])
def test_head_map_is_the_jacobian_up_to_the_per_row_factors(tmp_path, arch):
    """The Jacobian of the logits with respect to the head-feeding module's output at one row is H/σ on every
    direction orthogonal to the row's normalised vector n (the norm's per-row terms, 1/σ and −n nᵀ/d, and BERT's
    tanh′, made the identity here, are what head_map leaves out)."""
    torch.manual_seed(0)
    if arch == "bert":
        config = BertConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_labels=3, architectures=["BertForSequenceClassification"])
        model, norm, logits_of = _bert_path(config)
    else:
        config = ViTConfig(**{**VISION, "hidden_size": 16}, num_labels=3, architectures=["ViTForImageClassification"])
        model, norm, logits_of = _vit_path(config)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
    model.save_pretrained(tmp_path)
    adapter = adapter_for(config)
    head = adapter.head_map(CanonicalCheckpoint(tmp_path, adapter))
    model.double()
    x, y = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(lambda out: logits_of(x, out), y)
    centred = (x + y) - (x + y).mean()
    sigma = float(torch.sqrt(centred.pow(2).mean() + norm.eps))
    n = centred / sigma
    v = torch.randn(16, 4, dtype=torch.float64)
    v -= n[:, None] * (n @ v)[None] / (n @ n)  # orthogonal to n
    torch.testing.assert_close(jac @ v, head @ v / sigma, rtol=1e-10, atol=1e-12)
    assert float((jac @ n - head @ n / sigma).abs().max()) > 1e-3  # along n the per-row term shows: a real check


def test_vit_run_takes_the_head_metric_solve_in_its_last_mlp(tmp_path):
    cfg = build_head_side_case(tmp_path, "vit", head_metric=1.0)
    run_pipeline(cfg, tmp_path / "run")
    path = RunDir(tmp_path / "run").record(f"solve/l{VISION['num_hidden_layers'] - 1:02d}")["info"]["solve_path"]
    assert list(path) == ["mlp.fc2"] and path["mlp.fc2"].startswith("head metric, ")


def test_a_run_changes_the_last_output_dense_only_and_records_the_steps(tiny_example, tmp_path):
    off = {"evaluation": {"enabled": False}}
    run_pipeline(example_config(tiny_example, "bert", **off), tmp_path / "plain")
    cfg = example_config(tiny_example, "bert", featcal={"head_metric": 1.0}, **off)
    run_pipeline(cfg, tmp_path / "head")
    plain, head = (load_file(tmp_path / r / "calibrated/model.safetensors") for r in ("plain", "head"))
    changed = {name for name in plain if not torch.equal(plain[name], head[name])}
    last = BertConfig.from_pretrained(cfg.base).num_hidden_layers - 1
    assert changed == {f"encoder.layer.{last}.output.dense.weight", f"encoder.layer.{last}.output.dense.bias"}
    path = RunDir(tmp_path / "head").record(f"solve/l{last:02d}")["info"]["solve_path"]
    assert list(path) == ["output.dense"] and path["output.dense"].startswith("head metric, ")


def test_refused_where_the_head_path_is_unknown_or_the_method_cannot_read_it(tiny_example, tmp_path):
    off = {"evaluation": {"enabled": False}}
    with pytest.raises(ConfigError, match="^featcal.head_metric: only with featcal.method featcal, not regmean$"):
        run_pipeline(example_config(tiny_example, "bert", featcal={"method": "regmean", "head_metric": 0.5}, **off),
                     tmp_path / "regmean")
    with pytest.raises(ConfigError, match="^featcal.head_metric: not with featcal.calibrate_head_side"):
        run_pipeline(example_config(tiny_example, "bert", featcal={"head_metric": 0.5, "calibrate_head_side": True},
                                    **off), tmp_path / "pooler")
    with pytest.raises(UnsupportedModelError,
                       match=r"^featcal.head_metric: not supported for CLIPForImageClassification \(supported: "):
        run_pipeline(example_config(tiny_example, "clip", featcal={"head_metric": 0.5}, **off), tmp_path / "clip")
    with pytest.raises(ValueError, match="head_metric"):
        example_config(tiny_example, "bert", featcal={"head_metric": 1.5})
