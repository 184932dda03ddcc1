"""runtime.input_cache (tasks/input_cache.py): a second run on the same data with another λ copies every task's model
inputs from the cache instead of preparing them again, and they are the very arrays a fresh preparation writes."""

import json
from pathlib import Path

import tasks.prepare
from flows.pipeline import run_pipeline
from tests.conftest import example_config, torch_threads_restored


def _run(tiny_example: Path, run_dir: Path, cache: Path, lam: float) -> dict[str, dict]:
    cfg = example_config(tiny_example, "bert", evaluation={"enabled": False}, featcal__lambda=lam,
                         runtime={"threads": 1, "input_cache": str(cache)})
    with torch_threads_restored():
        run_pipeline(cfg, run_dir)
    return {p.stem: json.loads(p.read_text()) for p in (run_dir / "records").glob("prepare__*.json")}


def test_a_second_run_with_another_lambda_does_not_prepare_again(tiny_example, tmp_path, monkeypatch):
    cache = tmp_path / "inputs"
    first = _run(tiny_example, tmp_path / "first", cache, 0.05)
    assert first and all(r["info"]["inputs"] == "prepared, then kept in runtime.input_cache" for r in first.values())
    assert len(list(cache.glob("*.json"))) == len(first)  # one complete entry per task

    def refused(*args, **kwargs):
        raise AssertionError("the calibration data was read again")

    monkeypatch.setattr(tasks.prepare, "load_split", refused)
    second = _run(tiny_example, tmp_path / "second", cache, 0.2)
    assert sorted(second) == sorted(first)
    for stage, record in second.items():
        assert record["info"]["inputs"] == "from runtime.input_cache"
        # The copied inputs are byte for byte what the first run prepared (the same digests), and so are the
        # embeddings computed from them: the rest of the run cannot tell the difference.
        assert record["outputs"] == first[stage]["outputs"]
        assert {k: v for k, v in record["info"].items() if k != "inputs"} == \
            {k: v for k, v in first[stage]["info"].items() if k != "inputs"}
    weights = [(tmp_path / d / "calibrated" / "model.safetensors").read_bytes() for d in ("first", "second")]
    assert weights[0] != weights[1]  # the λ did change the solve


def test_an_incomplete_entry_is_prepared_again(tiny_example, tmp_path):
    cache = tmp_path / "inputs"
    first = _run(tiny_example, tmp_path / "first", cache, 0.05)
    for info in cache.glob("*.json"):
        info.unlink()  # as a crash between the arrays and their info leaves an entry
    second = _run(tiny_example, tmp_path / "second", cache, 0.05)
    assert all(r["info"]["inputs"] == "prepared, then kept in runtime.input_cache" for r in second.values())
    assert {s: r["outputs"] for s, r in second.items()} == {s: r["outputs"] for s, r in first.items()}



def test_images_preprocessed_on_an_accelerator_get_entries_of_their_own(monkeypatch):
    """There the tensor path (featcal/pixels.py) may put a pixel one level from Pillow's, so a CPU run's entry must
    not serve it, nor its entry a CPU run; token inputs are the same anywhere and keep one key."""
    from types import SimpleNamespace

    import flows.pipeline
    from flows.pipeline import BlockWalk

    data = {"calibration": {"data": {"t": {"path": "/data"}}}}
    cfg = SimpleNamespace(runtime=SimpleNamespace(input_cache="/cache", device="cpu"), slice=lambda name: data)
    walk = BlockWalk.__new__(BlockWalk)  # only what _prepare_params reads
    walk.p = SimpleNamespace(cfg=cfg, code="code", inputs={"calibration/t": "data digest", "base": "base digest"})

    def key(names: tuple[str, ...]) -> str:
        walk.adapter = SimpleNamespace(architecture="arch", has_decoder=False, model_input_names=lambda: names)
        return walk._prepare_params("t", {})["inputs_key"]

    on_cpu = {names: key(names) for names in [("pixel_values",), ("input_ids", "attention_mask")]}
    monkeypatch.setattr(flows.pipeline, "on_accelerator", lambda device: True)
    assert key(("pixel_values",)) != on_cpu[("pixel_values",)]
    assert key(("input_ids", "attention_mask")) == on_cpu[("input_ids", "attention_mask")]
