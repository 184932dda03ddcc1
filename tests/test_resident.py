"""The resident path (tasks/resident.py): the same weights as the streaming path, bit for bit, at the same precision,
with the next stages reading the boundaries from memory; and kill -9 inside a resident layer, then the same command,
gives the uninterrupted run's weights, rerunning nothing that had finished."""

import os
import signal
from pathlib import Path

import pytest
import yaml

from flows.pipeline import run_pipeline
from storage.activations import ActivationStore
from storage.atomic import digest
from tests.conftest import example_config, featcal_process, torch_threads_restored
from tests.test_resume import _resumes_bit_identically, _started


def _run(tiny_example: Path, run_dir: Path, resident: bool, precision: str, monkeypatch) -> list[str]:
    """One in-process run of the tiny BERT example; the store arrays its stages read block by block."""
    read: list[str] = []
    original = ActivationStore.iter_row_blocks

    def spied(self, location, rows):
        read.append(location)
        return original(self, location, rows)

    monkeypatch.setattr(ActivationStore, "iter_row_blocks", spied)
    cfg = example_config(tiny_example, "bert", evaluation={"enabled": False},
                         runtime={"threads": 1, "resident": resident, "precision": precision})
    with torch_threads_restored():
        run_pipeline(cfg, run_dir)
    monkeypatch.undo()
    return read


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resident_gives_the_streaming_weights_bit_for_bit(tiny_example, tmp_path, monkeypatch, precision):
    streamed = _run(tiny_example, tmp_path / "streaming", False, precision, monkeypatch)
    resident = _run(tiny_example, tmp_path / "resident", True, precision, monkeypatch)
    weights = [digest(tmp_path / d / "calibrated" / "model.safetensors") for d in ("streaming", "resident")]
    assert weights[0] == weights[1]
    # The streaming run read every boundary from the store; the resident run none of them (model inputs only).
    boundaries = [[loc for loc in read if "/l0" in loc] for read in (streamed, resident)]
    assert any("/l01/" in loc for loc in boundaries[0]), boundaries[0]
    assert boundaries[1] == []
    # Every boundary was still written: the records of both runs name the same outputs with the same digests.
    records = [{p.name: yaml.safe_load(p.read_text())["outputs"] for p in (tmp_path / d / "records").glob("*.json")
                if p.name.startswith(("gram", "propagate", "prepare"))} for d in ("streaming", "resident")]
    assert records[0] == records[1] and records[0]


def test_kill9_inside_a_resident_layer_then_rerun_is_bit_identical(resume_config, reference_run, tmp_path):
    tasks = list(yaml.safe_load(resume_config.read_text())["experts"])
    run_dir = tmp_path / "victim"
    proc = featcal_process("run", str(resume_config), "--run-dir", str(run_dir), "--no-prefect",
                           "--set", "runtime.resident=true")
    _started(proc, run_dir, f"propagate/l01/{tasks[1]}")  # block 1's Grams and solve done, one propagation too
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # The rerun starts with nothing in memory: block 1's boundaries come from the store, then it runs resident.
    _resumes_bit_identically(resume_config, run_dir, proc.pid, reference_run, "--no-prefect",
                             "--set", "runtime.resident=true")
