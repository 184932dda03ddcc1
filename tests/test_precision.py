"""runtime.precision bf16 and runtime.device: a bf16 run stores bf16 activations, lands near the fp32 run's weights,
reruns bit-identically; an unreachable device is refused before any stage runs. The runs use FEATCAL_TEST_DEVICE
(default cpu): benchmarks/gpu_check.sh sets it to cuda on a GPU machine."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from featcal.devices import resolve_device
from flows.pipeline import run_pipeline
from storage.rundir import RunDir
from tasks.context import context
from tests.conftest import example_config

QUIET = {"enabled": False}
DEVICE = os.environ.get("FEATCAL_TEST_DEVICE", "cpu")


def _run(tiny_example, run_dir, **runtime):
    cfg = example_config(tiny_example, "clip", runtime={"keep_activations": True, **runtime}, evaluation=QUIET)
    run_pipeline(cfg, run_dir)
    return load_file(run_dir / "calibrated" / "model.safetensors")


@pytest.fixture(scope="module")
def fp32_and_bf16(tiny_example, tmp_path_factory):
    dirs = {p: tmp_path_factory.mktemp(f"precision-{p}") for p in ("fp32", "bf16")}
    return {p: (d, _run(tiny_example, d, precision=p, device=DEVICE)) for p, d in dirs.items()}


def test_bf16_run_stores_bf16_activations_and_stays_near_fp32(fp32_and_bf16):
    (fp32_dir, fp32), (bf16_dir, bf16) = fp32_and_bf16["fp32"], fp32_and_bf16["bf16"]
    ctx = context(bf16_dir)
    store = ctx.run.store
    task = ctx.tasks[0]
    assert store.array_dtype(store.location(ctx.run.acts(task, 1, "merged"))) == torch.bfloat16
    fp32_store = context(fp32_dir).run.store
    assert fp32_store.array_dtype(fp32_store.location(ctx.run.acts(task, 1, "merged"))) == torch.float32
    assert fp32.keys() == bf16.keys()
    assert all(bf16[k].dtype == fp32[k].dtype == torch.float32 for k in fp32)  # weights keep the experts' dtype
    rel = {k: float((bf16[k] - fp32[k]).norm() / fp32[k].norm().clamp_min(1e-30)) for k in fp32}
    changed = [k for k, r in rel.items() if r > 0]
    assert changed, "bf16 activations must change the solved weights somewhat"
    assert max(rel.values()) < 2e-2, max(rel.items(), key=lambda kv: kv[1])


def test_solve_records_say_where_they_ran(fp32_and_bf16):
    run = RunDir(fp32_and_bf16["fp32"][0])
    solves = [json.loads(p.read_text()) for p in (run.root / "records").glob("solve__*.json")]
    device = str(resolve_device(DEVICE))  # tiny systems: they fit on any GPU
    assert solves and all(r["info"]["solved_on"] == [device] for r in solves)
    on_cpu = device == "cpu"  # there, peak RSS says it
    assert all(("peak_device_mib" in r["info"]) != on_cpu for r in solves)


def test_bf16_rerun_in_a_fresh_directory_is_bit_identical(fp32_and_bf16, tiny_example, tmp_path):
    again = _run(tiny_example, tmp_path / "again", precision="bf16", device=DEVICE)
    first = fp32_and_bf16["bf16"][1]
    assert all(torch.equal(again[k], first[k]) for k in first)


def test_unreachable_device_is_refused_before_any_stage(tiny_example, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    cfg = example_config(tiny_example, "clip", runtime={"device": "cuda"}, evaluation=QUIET)
    with pytest.raises(ValueError, match=r"runtime.device: 'cuda' asked for but torch sees no CUDA device"):
        run_pipeline(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "records").exists() or not list((tmp_path / "run" / "records").glob("*.json"))


def test_plan_shows_device_and_halves_activation_disk_in_bf16(tiny_example):
    from flows.plan import plan, render

    fp32 = plan(example_config(tiny_example, "bert", runtime={"precision": "fp32"}))
    bf16 = plan(example_config(tiny_example, "bert", runtime={"precision": "bf16"}))
    assert bf16["estimated_disk_gib"] < fp32["estimated_disk_gib"]
    auto = str(resolve_device("auto"))
    assert fp32["device"] == auto and (fp32["estimated_peak_device_gib"] is None) == (auto == "cpu")
    assert f"device            {auto}, bf16" in render(bf16)
