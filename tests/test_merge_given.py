"""`merge.method: given`: FeatCal on a merge made elsewhere (e.g. MergeKit's output directory)."""

import json

import torch
from safetensors.torch import load_file

from featcal.config import ConfigError
from flows.pipeline import Pipeline, direct_runner, run_pipeline
from tests.conftest import example_config, torch_threads_restored


def test_given_merge_equal_to_our_ta_merge_gives_the_same_weights_bit_for_bit(tiny_example, one_thread_run, tmp_path):
    """The TA run's own merged/ directory given as θ_m: the same merged body, the same heads (from the experts) and
    the same calibrated checkpoint, bit for bit; the merge stage's key holds the given checkpoint's fingerprint."""
    given = one_thread_run / "merged"
    cfg = example_config(tiny_example, "bert", evaluation={"enabled": False}, runtime={"threads": 1},
                         merge={"method": "given", "path": str(given)})
    with torch_threads_restored():
        run_pipeline(cfg, tmp_path / "given")
    for rel in ("merged/model.safetensors", "calibrated/model.safetensors"):
        assert (tmp_path / "given" / rel).read_bytes() == (one_thread_run / rel).read_bytes(), rel
    heads = sorted(p.name for p in (given / "heads").iterdir())
    assert heads and heads == sorted(p.name for p in (tmp_path / "given" / "merged" / "heads").iterdir())
    for name in heads:
        ours, theirs = (load_file(d / "heads" / name) for d in (tmp_path / "given" / "merged", given))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    manifest = json.loads((tmp_path / "given" / "manifest.json").read_text())
    assert manifest["inputs"]["merge"] == Pipeline(tmp_path / "given", direct_runner).inputs["merge"]
    assert "merge" not in json.loads((one_thread_run / "manifest.json").read_text())["inputs"]


def test_given_needs_a_path_and_a_path_needs_given(tiny_example):
    for merge, seen in (({"method": "given"}, "method given, path None"),
                        ({"method": "ties", "path": "x"}, "method ties, path 'x'")):
        try:
            example_config(tiny_example, "bert", merge=merge)
        except ConfigError as exc:
            assert "merge: Value error, merge.path names the merged checkpoint of merge.method given" in str(exc)
            assert seen in str(exc)
        else:
            raise AssertionError(merge)


def test_given_merge_cannot_be_the_runs_own_merged_dir(tiny_example, one_thread_run, tmp_path):
    """The merge stage writes merged/: reading θ_m from the same directory would overwrite what it reads."""
    import shutil

    import pytest

    from storage.checkpoint import CheckpointError

    shutil.copytree(one_thread_run / "merged", tmp_path / "run" / "merged")
    cfg = example_config(tiny_example, "bert", evaluation={"enabled": False},
                         merge={"method": "given", "path": str(tmp_path / "run" / "merged")})
    with pytest.raises(CheckpointError, match=r"^merge.path: .*run/merged is this run's own merged/, which the merge"):
        run_pipeline(cfg, tmp_path / "run")


def test_given_merge_in_another_dtype_is_cast_to_the_bases_with_one_notice(tiny_example, one_thread_run, tmp_path):
    """A bf16 merge of an fp32 base: preflight says so once; merged/ holds the bf16 values in fp32, exactly."""
    import shutil

    import yaml
    from safetensors.torch import save_file

    from tasks.context import CONFIG_NAME, context
    from tasks.merge import run as merge_stage
    from tasks.preflight import preflight

    given = tmp_path / "bf16"
    shutil.copytree(one_thread_run / "merged", given)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(given / "model.safetensors").items()}
    save_file(tensors, str(given / "model.safetensors"), metadata={"format": "pt"})
    cfg = example_config(tiny_example, "bert", evaluation={"enabled": False},
                         merge={"method": "given", "path": str(given)})
    assert preflight(cfg, quiet=True).notices == [
        f"merge.path: {given} stores tensors in other dtypes than the base; merged/ takes the base's "
        "(bfloat16 → float32)"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / CONFIG_NAME).write_text(yaml.safe_dump(cfg.redacted()))
    merge_stage(context(tmp_path / "run"))
    merged = load_file(tmp_path / "run" / "merged" / "model.safetensors")
    assert all(merged[k].dtype == torch.float32 and torch.equal(merged[k], tensors[k].float()) for k in tensors)
