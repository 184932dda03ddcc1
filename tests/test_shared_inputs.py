"""calibration.shared_inputs: each task's term also reads the other tasks' calibration inputs (through its own expert),
weighted w below its own rows; w = 0 is today's run, w auto is chosen on the held-out own rows."""

import hashlib

import pytest
import torch
from safetensors.torch import load_file

from flows.cli import main
from flows.pipeline import keyed, run_pipeline
from storage.rundir import RunDir
from tasks.boundary import foreign_rows
from tasks.context import context
from tasks.merge import MERGED
from tests.conftest import example_config, one_error_line

MODULE = "attention.self.query"  # block 0's query reads the block input itself: its rows are the stored boundary
EXAMPLES, EVERY = 8, 4
OFF = {"evaluation": {"enabled": False}, "runtime": {"keep_activations": True}}


def _run(tiny_example, run_dir, shared=None, **featcal):
    settings = {"lambda": 0.1, "rho": 2.2, "holdout_every": EVERY, **featcal}
    extra = {} if shared is None else {"calibration__shared_inputs": shared}
    cfg = example_config(tiny_example, "bert", featcal=settings, calibration__examples_per_task=EXAMPLES,
                         **extra, **OFF)
    run_pipeline(cfg, run_dir)
    return cfg


def _task_rows(run_dir, task):
    """(x_s, x_e, token weight, example index, FOREIGN_ROWS mark) of every token row of block 0 for `task`."""
    ctx = context(run_dir)
    store, run = ctx.run.store, ctx.run

    def read(rel):
        return torch.from_numpy(store.open_array(store.location(rel))[:])

    x_s, x_e = (read(run.acts(task, 0, side)).double() for side in ("merged", "expert"))
    mask = read(f"{run.inputs(task)}/attention_mask")
    tokens = mask.shape[1]
    example = torch.arange(mask.shape[0]).repeat_interleave(tokens)
    marks = foreign_rows(ctx, task)
    marks = torch.zeros(mask.shape[0], dtype=torch.long) if marks is None else marks
    return x_s, x_e, mask.reshape(-1).double(), example, marks.repeat_interleave(tokens)


def _brute_force(run_dir, w, lam, rho, alpha, held_every=None):
    """Block 0's query weight and bias from every task's rows concatenated: own rows weighted 1/(Σw_own·n_t), foreign
    rows w/(Σw_foreign·n_t), n_t = ‖C_ss‖_F of the own (fit) rows; with `held_every`, every task's examples
    i ≡ −1 mod it are left out of the fit, as own rows and as other tasks' foreign rows. Solved by dense normal
    equations in float64."""
    ctx = context(run_dir)
    prefix = ctx.adapter.block_prefix(0) + MODULE
    merged, base = (ctx.checkpoint(c) for c in (MERGED, "base"))
    anchor_w = rho * merged.get(prefix + ".weight").double() + (1 - rho) * base.get(prefix + ".weight").double()
    anchor_b = rho * merged.get(prefix + ".bias").double() + (1 - rho) * base.get(prefix + ".bias").double()
    d = anchor_w.shape[1]
    a, b = lam * torch.eye(d, dtype=torch.float64), lam * anchor_w.T.clone()
    bias_terms = []
    for task in ctx.tasks:
        x_s, x_e, tw, example, marks = _task_rows(run_dir, task)
        w_t = ctx.checkpoint(task).get(prefix + ".weight").double()
        b_t = ctx.checkpoint(task).get(prefix + ".bias").double()
        own, foreign = marks == 0, marks != 0
        if held_every:  # pool rows (mark −1) are no task's held-out rows: always fitted
            own &= example % held_every != held_every - 1
            foreign &= (marks < 0) | ((marks - 1) % held_every != held_every - 1)
        c_own = (x_s[own] * tw[own, None]).T @ x_s[own] / tw[own].sum()
        n_t = float(torch.linalg.matrix_norm(c_own))
        row_w = torch.where(own, tw / (tw[own].sum() * n_t), torch.zeros_like(tw))
        row_w += torch.where(foreign, w * tw / (tw[foreign].sum() * n_t), torch.zeros_like(tw))
        y = (alpha * x_e + (1 - alpha) * x_s) @ w_t.T
        a += (x_s * row_w[:, None]).T @ x_s
        b += (x_s * row_w[:, None]).T @ y
        bias_terms.append((row_w, x_s, y, b_t))
    weight = torch.linalg.solve(a, b).T
    num, den = lam * anchor_b.clone(), lam
    for row_w, x_s, y, b_t in bias_terms:  # Σ rows w_i (b_t + y_i − W x_i) over every row, + λ A(b)
        num += (row_w[:, None] * (y + b_t - x_s @ weight.T)).sum(0)
        den += float(row_w.sum())
    return weight, num / den


def _solved(run_dir):
    blocks = load_file(run_dir / "blocks" / "l00.safetensors")
    return blocks[f"{MODULE}.weight"].double(), blocks[f"{MODULE}.bias"].double()


def test_a_weighted_solve_equals_the_closed_form_on_own_and_foreign_rows_concatenated(tiny_example, tmp_path):
    """...and the head refit reads the own rows only."""
    cfg = _run(tiny_example, tmp_path / "run", {"weight": 0.5}, head_refit=True)
    run = RunDir(tmp_path / "run")
    task = cfg.tasks[0]
    info = run.record(f"prepare/{task}")["info"]
    assert info["examples"] == EXAMPLES and info["foreign_examples"] == EXAMPLES * (len(cfg.tasks) - 1)
    marks = foreign_rows(context(tmp_path / "run"), task)  # own rows, then each other task's examples 1..8
    assert marks.tolist() == [0] * EXAMPLES + list(range(1, EXAMPLES + 1)) * (len(cfg.tasks) - 1)
    refit = run.stage_records()["assemble"]["info"]["head_refit"]
    assert {t: r["rows"] for t, r in refit.items()} == dict.fromkeys(cfg.tasks, EXAMPLES)
    weight, bias = _solved(tmp_path / "run")
    expected_w, expected_b = _brute_force(tmp_path / "run", 0.5, 0.1, 2.2, cfg.featcal.alpha)
    torch.testing.assert_close(weight, expected_w, rtol=0, atol=2e-5 * float(expected_w.abs().max()))
    torch.testing.assert_close(bias, expected_b, rtol=0, atol=2e-5 * float(expected_b.abs().max()))
    # the foreign rows moved the solve: the own rows alone give another weight
    own_w, _ = _brute_force(tmp_path / "run", 0.0, 0.1, 2.2, cfg.featcal.alpha)
    assert float((own_w - expected_w).abs().max()) > 100 * 2e-5 * float(expected_w.abs().max())


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_weight_zero_is_the_run_without_the_option_bit_for_bit(tiny_example, tmp_path):
    _run(tiny_example, tmp_path / "plain")
    _run(tiny_example, tmp_path / "zero", {"weight": 0, "grid": [0.5, 2.0]})
    rel = "calibrated/model.safetensors"
    assert _digest(tmp_path / "plain" / rel) == _digest(tmp_path / "zero" / rel)
    plain, zero = RunDir(tmp_path / "plain"), RunDir(tmp_path / "zero")
    records, zeros = plain.stage_records(), zero.stage_records()
    assert len(records) > 5 and {s: r["key"] for s, r in records.items()} == {s: r["key"] for s, r in zeros.items()}
    assert keyed({"seed": 1, "shared_inputs": {"weight": 0, "grid": [1.0], "pool": None}}) == {"seed": 1}


def test_auto_picks_the_weight_of_lowest_held_out_own_row_score(tiny_example, tmp_path):
    """λ fixed, w auto, with a pool: the recorded w of block 0's query is the grid point whose fit (own fit rows + w ×
    foreign rows, every task's held-out examples left out) has the lowest data term on the held-out own rows, by a
    brute-force loop over the grid; the final weight is the closed form at that w on all rows."""
    grid = [0.0, 0.3, 3.0]
    pool = {"path": "data/topic", "split": "train"}
    cfg = _run(tiny_example, tmp_path / "run", {"weight": "auto", "grid": grid, "pool": pool, "pool_examples": 4})
    alpha = cfg.featcal.alpha
    ctx = context(tmp_path / "run")
    prefix = ctx.adapter.block_prefix(0) + MODULE
    scores = []
    for w in grid:
        fit_w, _ = _brute_force(tmp_path / "run", w, 0.1, 2.2, alpha, held_every=EVERY)
        score = 0.0
        for task in ctx.tasks:
            x_s, x_e, tw, example, marks = _task_rows(tmp_path / "run", task)
            held = (marks == 0) & (example % EVERY == EVERY - 1)
            w_t = ctx.checkpoint(task).get(prefix + ".weight").double()
            c_held = (x_s[held] * tw[held, None]).T @ x_s[held] / tw[held].sum()
            resid = x_s[held] @ fit_w.T - (alpha * x_e[held] + (1 - alpha) * x_s[held]) @ w_t.T
            score += float((tw[held, None] * resid**2).sum() / tw[held].sum()) / float(torch.linalg.matrix_norm(c_held))
        scores.append(score)
    info = RunDir(tmp_path / "run").record("solve/l00")["info"]
    chosen = info["shared_weight"][MODULE]
    assert chosen == grid[min(range(len(grid)), key=scores.__getitem__)], (scores, chosen)
    assert sorted(scores)[1] - min(scores) > 1e-6 * min(scores)  # the grid points are told apart
    weight, _ = _solved(tmp_path / "run")
    expected, _ = _brute_force(tmp_path / "run", chosen, 0.1, 2.2, alpha)
    torch.testing.assert_close(weight, expected, rtol=0, atol=2e-5 * float(expected.abs().max()))
    assert set(info["shared_weight"].values()) <= set(grid)
    # the held-out fold's foreign sums: the rows of the other tasks' examples that those tasks hold out
    task = ctx.tasks[0]
    x_s, _, tw, _, marks = _task_rows(tmp_path / "run", task)
    assert foreign_rows(ctx, task)[-4:].tolist() == [-1] * 4  # the pool's rows come last
    there = ((marks > 0) & ((marks - 1) % EVERY == EVERY - 1)).double() * tw
    stats = load_file(tmp_path / "run" / RunDir(tmp_path / "run").stats(task, 0))
    key = next(k for k in stats if k.endswith(":foreign_held_ss") and "query" in k)
    expected = (x_s * there[:, None]).T @ x_s
    torch.testing.assert_close(stats[key], expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.usefixtures("fresh_console")
@pytest.mark.parametrize("setting, named", [
    (["calibration.shared_inputs.weight=-0.5"], "calibration.shared_inputs.weight"),
    (["calibration.shared_inputs.weight=0.5", "calibration.shared_inputs.pool.path=no/such/data"],
     "calibration.shared_inputs.pool"),
    (["calibration.shared_inputs.weight=0.5", "featcal.method=regmean"], "calibration.shared_inputs.weight"),
])
def test_bad_settings_are_refused_in_one_line_naming_the_field(tiny_example, capsys, setting, named):
    args = [a for s in setting for a in ("--set", s)]
    assert main(["plan", str(tiny_example / "bert" / "example.yaml"), *args]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert named in line, line


@pytest.mark.usefixtures("fresh_console")
def test_the_plan_says_how_many_foreign_examples_each_task_reads(tiny_example, capsys):
    config = str(tiny_example / "bert" / "example.yaml")
    assert main(["plan", config, "--set", "calibration.examples_per_task=8"]) == 0
    assert "foreign" not in capsys.readouterr().out
    assert main(["plan", config, "--set", "calibration.examples_per_task=8",
                 "--set", "calibration.shared_inputs.weight=auto"]) == 0
    assert "topic (8 ex + 16 foreign: calibration.shared_inputs)" in capsys.readouterr().out


def test_the_minilm_study_has_the_8_example_shared_inputs_row_paired_against_lambda_auto():
    from featcal_bench.builtin import recipes
    from featcal_bench.study import load_study

    study = load_study(recipes()["minilm"].study)
    run = study.runs["ta_featcal_auto_shared_n008"]
    assert run.examples == 8 and run.shared_inputs == {"weight": "auto"} and run.featcal["lambda"] == "auto"
    assert study.runs["ta_featcal_auto_n008"].shared_inputs == {}
    row = next(r for r in study.rows if r.run == "ta_featcal_auto_shared_n008")
    assert row.label == "TA + FeatCal (λ auto) + shared inputs (auto), 8 examples/task"
    assert next(r for r in study.rows if r.label == row.against).run == "ta_featcal_auto_n008"


@pytest.mark.usefixtures("fresh_console")
def test_a_pool_that_holds_evaluation_rows_is_warned_of(tiny_example, capsys):
    """With shared inputs the pool's rows are calibration rows of every task: a pool drawn from a test split is said."""
    args = ["--set", "calibration.shared_inputs.weight=0.5", "--set", "calibration.shared_inputs.pool.path=data/topic",
            "--set", "calibration.shared_inputs.pool.split=test"]
    assert main(["plan", str(tiny_example / "bert" / "example.yaml"), *args]) == 0
    assert "evaluation.data.topic: 200 of its 200 rows are also calibration rows" in capsys.readouterr().out


@pytest.mark.parametrize("target", ["identity", "diagonal"])
def test_one_pass_over_the_tasks_scores_every_weight_as_the_mixed_moments_do(target):
    """choose_linear_hyper_by_weight (own and foreign sums apart, then own + w·foreign) gives each w the scores that
    choose_linear_hyper gives the per-task mixed moments (LinearMoments.with_foreign), shrinkage included."""
    from featcal.closed_form import Hyper, LinearMoments, choose_linear_hyper, choose_linear_hyper_by_weight

    gen = torch.Generator().manual_seed(0)
    d, out = 6, 4

    def moments(rows: int, weight: float = 1.0) -> LinearMoments:
        x_s, x_e = torch.randn(rows, d, generator=gen, dtype=torch.float64), torch.randn(rows, d, generator=gen,
                                                                                        dtype=torch.float64)
        return LinearMoments(c_ss=x_s.T @ x_s / rows, mu_s=x_s.mean(0), mu_e=x_e.mean(0), c_se=x_s.T @ x_e / rows,
                             weight=weight)

    tasks = [(moments(5, c), moments(12), moments(3, c), torch.randn(out, d, generator=gen, dtype=torch.float64))
             for c in (1.0, 2.5)]
    merged, base = torch.randn(out, d, generator=gen, dtype=torch.float64), torch.randn(out, d, generator=gen,
                                                                                       dtype=torch.float64)
    hp = Hyper(lam=0.1, rho=1.0, alpha=0.25, eps=1e-10, shrink_target=target)
    lams, rhos, shrinks, weights = [0.01, 0.1, 1.0], [1.0, 2.0], [0.0, 0.2], [0.0, 0.5, 2.0]
    one_pass = choose_linear_hyper_by_weight(iter(tasks), merged, base, hp, lams, rhos, shrinks, weights)
    for w, choice in zip(weights, one_pass, strict=True):
        mixed = ((own.with_foreign(foreign, w), held, w_t) for own, foreign, held, w_t in tasks)
        expected = choose_linear_hyper(mixed, merged, base, hp, lams, rhos, shrinks)
        torch.testing.assert_close(choice.scores, expected.scores, rtol=1e-10, atol=1e-12)
        assert (choice.lam, choice.rho, choice.shrink) == (expected.lam, expected.rho, expected.shrink)
    assert len({float(c.scores.min()) for c in one_pass}) == len(weights)  # the weights are told apart
