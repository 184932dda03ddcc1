"""The whole pipeline on tiny real HF models: exactness, drift reduction, outputs, bad inputs."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from featcal.modeling import task_model
from flows.pipeline import run_pipeline
from storage.activations import ActivationError
from storage.atomic import digest
from storage.checkpoint import CanonicalCheckpoint, CheckpointError
from storage.rundir import RunDir
from tasks.context import context
from tasks.evaluate import run_task_model
from tasks.solve import solve_groups
from tests.conftest import example_config

ARCHS = ["bert", "clip"]


@pytest.fixture(scope="module", params=ARCHS)
def three_expert_run(request, example_runs):
    return request.param, *example_runs(request.param)


def test_calibration_reduces_drift_at_every_block(three_expert_run):
    """Average feature drift over the tasks, at every block boundary after the (uncalibrated) embeddings.

    Per task it is a compromise: the weights are shared, and on the tiny BERT example the `count` task's
    all-token drift at boundary 1 rises by about 3 % while the others fall by 10–20 %."""
    arch, cfg, run_dir, _ = three_expert_run
    report = json.loads((run_dir / "report.json").read_text())
    assert sorted(report["tasks"]) == cfg.tasks
    for scores in report["tasks"].values():
        merged, calibrated = scores["drift"]["merged"], scores["drift"]["calibrated"]
        assert len(merged) == len(calibrated) == context(run_dir).num_blocks + 1
        assert merged[0] == pytest.approx(calibrated[0])  # embeddings are not calibrated
    average = report["summary"]["average_drift"]
    for block, (m, c) in enumerate(zip(average["merged"][1:], average["calibrated"][1:]), start=1):
        assert c < m, f"{arch}: boundary {block} average drift {c:.4f} not below merged {m:.4f}"


def test_report_files_and_accuracy_table(three_expert_run):
    arch, cfg, run_dir, records = three_expert_run
    report = json.loads((run_dir / "report.json").read_text())
    for task in cfg.tasks:
        acc = report["tasks"][task]["accuracy"]
        assert set(acc) == {"base", "merged", "calibrated", "expert"}
        assert all(0.0 <= v <= 1.0 for v in acc.values())
    avg = report["summary"]["average_accuracy"]
    assert avg["calibrated"] > avg["merged"], avg  # the point of the method, on the example too
    assert 0 < report["summary"]["gap_closed"] <= 1
    md = (run_dir / "report.md").read_text()
    assert all(f"| {t} |" in md for t in cfg.tasks)
    assert (run_dir / "drift.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["versions"]["torch"].startswith("2.")
    assert set(records) == {"merge", "assemble", "evaluate"}


def test_calibrated_checkpoint_loads_with_from_pretrained(three_expert_run):
    arch, cfg, run_dir, _ = three_expert_run
    architecture = json.loads((run_dir / "calibrated" / "config.json").read_text())["architectures"][0]
    base_cls = getattr(transformers, architecture)
    model = base_cls.from_pretrained(run_dir / "calibrated")
    blocks = load_file(run_dir / "blocks" / "l00.safetensors")
    ctx = context(run_dir)
    body = ctx.adapter.body(model) if ctx.adapter.body_attr.get(type(model).__name__) else model
    loaded = ctx.adapter.blocks(body)[0]
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, blocks[name]), name
    task = cfg.tasks[0]
    per_task = run_task_model(run_dir, task)  # the run refitted its heads (featcal.head_refit auto, 64 examples)
    head = load_file(run_dir / "calibrated" / "heads" / f"{task}.safetensors")
    assert head and all(torch.equal(per_task.state_dict()[k], v) for k, v in head.items())
    expert_head = task_model(cfg.experts[task], CanonicalCheckpoint(run_dir / "calibrated", ctx.adapter)).state_dict()
    assert not all(torch.equal(expert_head[k], v) for k, v in head.items())


def test_intermediates_are_released_but_records_kept(three_expert_run):
    arch, cfg, run_dir, _ = three_expert_run
    assert not (run_dir / "stats").exists() or not any((run_dir / "stats").rglob("*.safetensors"))
    assert not (run_dir / "spare").exists(), "released statistics kept for reuse outlive the last Gram stage"
    for task in cfg.tasks:
        assert not (run_dir / "acts" / task).exists(), "boundaries and model inputs should be deleted after use"
    run = RunDir(run_dir)
    assert run.record("gram/l00/" + cfg.tasks[0])["outputs"]


@pytest.mark.parametrize("arch", ARCHS)
def test_single_expert_exactness(tiny_example, tmp_path, arch):
    """T=1, α=1, λ→0: the calibrated model reproduces the expert's features (docs/design.md §2).

    `average` of one expert makes the merged statistics the expert's own, while the anchor (ρ=2.2 against
    the base) points elsewhere: only a correct solve lands back on the expert."""
    task = example_config(tiny_example, arch).tasks[0]
    base_cfg = example_config(tiny_example, arch)
    cfg = example_config(
        tiny_example, arch,
        experts={task: base_cfg.experts[task]},
        calibration__data={task: base_cfg.calibration.data[task].model_dump()},
        merge={"method": "average"},
        featcal={"lambda": 1e-9, "alpha": 1.0, "rho": 2.2},
        evaluation={"enabled": False},
        runtime={"keep_activations": True},  # the check below reads the stored model inputs
    )

    def deviation(run_dir):
        ctx = context(run_dir)
        expert = task_model(cfg.experts[task])
        calibrated = task_model(cfg.experts[task], CanonicalCheckpoint(run_dir / "calibrated", ctx.adapter))
        from tasks.boundary import stored_inputs

        worst = 0.0
        for batch in stored_inputs(ctx, task):
            inputs = {k: v for k, v in batch.items() if k in ctx.adapter.model_input_names()}
            with torch.inference_mode():
                a = expert(**inputs, output_hidden_states=True).hidden_states
                b = calibrated(**inputs, output_hidden_states=True).hidden_states
            # Padding tokens carry weight 0 in every statistic, so nothing constrains their features: the
            # method's claim (and this check) is about real tokens. They never reach a real token (masked keys).
            real = inputs["attention_mask"].bool() if "attention_mask" in inputs else slice(None)
            worst = max(worst, max(float((x[real] - y[real]).norm() / y[real].norm()) for x, y in zip(b, a)))
        return worst

    run_pipeline(cfg, tmp_path / "exact")
    assert deviation(tmp_path / "exact") < 1e-4
    # The same run with a real λ is pulled towards the anchor: the check above can fail.
    loose = cfg.model_copy(update={"featcal": cfg.featcal.model_copy(update={"lam": 0.5})})
    run_pipeline(loose, tmp_path / "loose")
    assert deviation(tmp_path / "loose") > 1e-3


def test_mismatched_expert_is_refused_before_any_work(tiny_example, tmp_path):
    cfg = example_config(tiny_example, "bert")
    bad = tmp_path / "bad-expert"
    bad.mkdir()
    src = cfg.experts[cfg.tasks[1]]
    for f in ("config.json",):
        (bad / f).write_bytes((tiny_example / "bert" / "experts" / cfg.tasks[1] / f).read_bytes())
    tensors = load_file(f"{src}/model.safetensors")
    name = next(n for n in tensors if "intermediate.dense.weight" in n)
    tensors[name] = tensors[name][:-1]
    from safetensors.torch import save_file

    save_file(tensors, str(bad / "model.safetensors"))
    cfg = cfg.model_copy(update={"experts": {**cfg.experts, cfg.tasks[1]: str(bad)}})
    wrong = rf"experts\.{cfg.tasks[1]}: tensor .*intermediate\.dense\.weight has shape"
    with pytest.raises(CheckpointError, match=wrong):
        run_pipeline(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_missing_task_data_is_named(tiny_example, tmp_path):
    cfg = example_config(tiny_example, "bert")
    task = cfg.tasks[0]
    cfg.calibration.data[task].path = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=rf"calibration\.data\.{task}\.path"):
        run_pipeline(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_keep_activations_keeps_boundaries_and_stats(tiny_example, tmp_path):
    cfg = example_config(tiny_example, "bert", evaluation={"enabled": False}, runtime={"keep_activations": True})
    run_pipeline(cfg, tmp_path / "keep")
    for task in cfg.tasks:
        for layer in range(context(tmp_path / "keep").num_blocks):
            for side in ("merged", "expert"):
                assert (tmp_path / "keep" / "acts" / task / f"l{layer:02d}" / side / "zarr.json").is_file()
            assert (tmp_path / "keep" / "stats" / f"l{layer:02d}" / f"{task}.safetensors").is_file()
    assert not (tmp_path / "keep" / "records" / "released").exists()


def test_solve_groups_split_a_block_by_cost_and_keep_block_order():
    lin, norm = torch.nn.Linear, torch.nn.LayerNorm
    modules = {"q": lin(8, 8), "k": lin(8, 8), "v": lin(8, 8), "o": lin(8, 8), "ln1": norm(8),
               "fc1": lin(8, 32), "fc2": lin(32, 8), "ln2": norm(8)}
    # costs in² · (in + out): q, k, v, o 1024; fc1 2560; fc2 40960; norms their width, 8
    assert solve_groups(modules, 1) == [list(modules)]
    assert solve_groups(modules, 2) == [["fc2"], ["q", "k", "v", "o", "ln1", "fc1", "ln2"]]
    assert solve_groups(modules, 3) == [["fc2"], ["o", "fc1"], ["q", "k", "v", "ln1", "ln2"]]
    assert solve_groups(modules, 8) == [[m] for m in ["fc2", "fc1", "q", "k", "v", "o", "ln1", "ln2"]]
    for bad in (0, 9):
        with pytest.raises(ValueError, match=rf"runtime.solve_groups must be between 1 and 8 .*got {bad}"):
            solve_groups(modules, bad)


def test_split_solves_give_the_same_weights(three_expert_run, tiny_example, tmp_path):
    arch, _, run_dir, _ = three_expert_run
    grouped = example_config(tiny_example, arch, runtime={"solve_groups": 3}, evaluation={"enabled": False})
    run_pipeline(grouped, tmp_path / "grouped")
    for rel in ("calibrated/model.safetensors", "merged/model.safetensors"):
        assert digest(tmp_path / "grouped" / rel) == digest(run_dir / rel), rel
    run, whole = RunDir(tmp_path / "grouped"), RunDir(run_dir)
    for layer in range(context(run_dir).num_blocks):
        solved = [run.record(f"solve/l{layer:02d}/g{g}")["info"]["modules"] for g in range(3)]
        assert min(solved) > 0 and sum(solved) == whole.record(f"solve/l{layer:02d}")["info"]["modules"]
    assert run.record("solve/l00") is None and run.record("solve/l00/g3") is None


def test_unknown_activation_store_is_named_before_any_work(tiny_example, tmp_path):
    cfg = example_config(tiny_example, "bert", runtime={"activation_store": "nosuch://bucket/run"})
    with pytest.raises(ActivationError, match=r"runtime.activation_store: nosuch://bucket/run: .*nosuch"):
        run_pipeline(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_named_column_that_is_not_there_is_named(tiny_example, tmp_path):
    cfg = example_config(tiny_example, "bert")
    task = cfg.tasks[0]
    cfg.calibration.data[task].column = "txt"
    wrong = rf"calibration\.data\.{task}\.column: 'txt' is not a column of the data \(it has \["
    with pytest.raises(ValueError, match=wrong):
        run_pipeline(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
