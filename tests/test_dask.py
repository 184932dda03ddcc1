"""Stages on Dask workers (prefect-dask): a local cluster of 2 worker processes reproduces the single-process
weights bit for bit; usage and connection errors name what is wrong."""

import json
import os
from collections.abc import Iterator

import fsspec
import pytest
import torch

from flows.cli import main
from flows.dask_runner import DaskUnavailable, _check_shared, check_scheduler
from flows.prefect_flow import featcal_flow
from storage.atomic import digest
from storage.rundir import RunDir
from tasks.context import context
from tests.dask_processes import dask_processes, free_port

pytest_plugins = ("tests.prefect_server", "tests.s3_server")


def test_local_cluster_of_one_worker_per_device_is_bit_identical_to_one_process(prefect_server, tiny_example,
                                                                                one_thread_run, tmp_path):
    """What `--gpus 2` starts (a local cluster of two workers, each pinned to its own device by a worker plugin),
    here with two CPU devices: CI has no GPU. benchmarks/gpu_check.sh runs `--gpus 1` on a CUDA machine."""
    no_eval = ["evaluation.enabled=false"]
    state = featcal_flow(str(tiny_example / "bert" / "example.yaml"), str(tmp_path / "dask"), no_eval,
                         runner="dask", devices=["cpu", "cpu"], return_state=True)
    assert state.is_completed(), state
    for rel in ("calibrated/model.safetensors", "merged/model.safetensors",
                *(f"blocks/l{b:02d}.safetensors" for b in range(3))):
        assert digest(tmp_path / "dask" / rel) == digest(one_thread_run / rel), rel
    run = RunDir(tmp_path / "dask")
    started = {e["pid"] for e in run.events() if e["event"] == "start"}
    assert len(started) == 2 and os.getpid() not in started  # every stage ran on one of the two workers
    records = [json.loads(p.read_text()) for p in (run.root / "records").glob("*.json") if p.stem != "fingerprints"]
    assert len(records) > 10 and {r["info"]["device"] for r in records} == {"cpu"}


def test_gpus_are_refused_in_one_line_without_cuda_or_with_other_cluster_flags(tiny_example, tmp_path, capsys):
    config = str(tiny_example / "bert" / "example.yaml")
    assert main(["run", config, "--run-dir", str(tmp_path / "r"), "--runner", "dask", "--gpus", "2"]) == 2
    assert f"featcal: error: --gpus 2: torch sees 0 CUDA device(s) (torch {torch.__version__})" in (
        capsys.readouterr().err)
    for extra in (["--workers", "2"], ["--address", "tcp://127.0.0.1:1"], ["--runner", "pool"]):  # and never ignored
        with pytest.raises(SystemExit):
            main(["run", config, "--run-dir", str(tmp_path / "r"), "--runner", "dask", "--gpus", "2", *extra])
        assert "--gpus N starts a local Dask cluster of one worker per GPU: it needs --runner dask and excludes " \
               "--address and --workers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", config, "--run-dir", str(tmp_path / "r"), "--runner", "dask", "--gpus", "2", "--no-prefect"])
    assert "--runner dask runs stages as Prefect tasks: it cannot be combined with --no-prefect" in (
        capsys.readouterr().err)
    assert not (tmp_path / "r").exists()


@pytest.fixture
def dask_cluster(tmp_path) -> Iterator[str]:
    """A Dask cluster started the way a user starts one: `dask scheduler` and `dask worker` processes."""
    with dask_processes("tcp", {**os.environ, "OMP_NUM_THREADS": "1"}, tmp_path / "dask-logs") as address:
        yield address


def test_existing_cluster_at_an_address_runs_split_solves_bit_identically(prefect_server, tiny_example, dask_cluster,
                                                                         one_thread_run, s3_options, s3_bucket,
                                                                         tmp_path):
    """`--runner dask --address`: a scheduler and two worker processes started by hand, the activations in an
    S3 object store, each block's solve in three groups submitted together; the weights equal a single-process
    run with local activations and one solve per block, and the bucket keeps only what is still needed."""
    overrides = ["evaluation.enabled=false", "runtime.solve_groups=3", f"runtime.activation_store=s3://{s3_bucket}/run",
                 f"runtime.storage_options={json.dumps(s3_options)}"]
    state = featcal_flow(str(tiny_example / "bert" / "example.yaml"), str(tmp_path / "dask"), overrides,
                         runner="dask", address=dask_cluster, return_state=True)
    assert state.is_completed(), state
    for rel in ("calibrated/model.safetensors", "merged/model.safetensors"):
        assert digest(tmp_path / "dask" / rel) == digest(one_thread_run / rel), rel
    events = RunDir(tmp_path / "dask").events()
    solvers = {e["pid"] for e in events if e["event"] == "start" and e["stage"].startswith("solve/")}
    started = {e["pid"] for e in events if e["event"] == "start"}
    assert len(started) == 2 and os.getpid() not in started and solvers <= started
    assert not (tmp_path / "dask" / "acts").exists()
    assert len([e for e in events if e["event"] == "start" and e["stage"].startswith("solve/")]) == 3 * 3
    fs = fsspec.filesystem("s3", **s3_options)
    fs.invalidate_cache()
    assert fs.find(f"{s3_bucket}/run") == []  # boundaries and model inputs released after use
    assert {f"acts/{t}/inputs" for t in context(tmp_path / "dask").tasks} <= {
        p.stem.replace("__", "/") for p in (tmp_path / "dask" / "records" / "released").glob("*.json")}


def test_dask_runner_needs_a_cluster_flag(tiny_example, tmp_path, capsys):
    config = str(tiny_example / "bert" / "example.yaml")
    with pytest.raises(SystemExit) as exc:
        main(["run", config, "--run-dir", str(tmp_path / "r"), "--runner", "dask"])
    assert exc.value.code == 2
    assert "--runner dask needs --address tcp://HOST:PORT (an existing cluster), --workers N (a local cluster) or " \
           "--gpus N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", config, "--run-dir", str(tmp_path / "r"), "--workers", "2"])
    assert "--workers and --worker-threads need --runner pool (processes on this machine) or --runner dask" in (
        capsys.readouterr().err)
    assert not (tmp_path / "r").exists()


def test_dask_address_that_does_not_answer_is_named(tiny_example, tmp_path, capsys):
    address = f"tcp://127.0.0.1:{free_port()}"
    code = main(["run", str(tiny_example / "bert" / "example.yaml"), "--run-dir", str(tmp_path / "r"),
                 "--runner", "dask", "--address", address])
    assert code == 2
    assert f"featcal: error: no Dask scheduler answers at {address}" in capsys.readouterr().err
    with pytest.raises(DaskUnavailable, match="is not a Dask scheduler address"):
        check_scheduler("http://example")


def test_workers_that_cannot_see_the_run_directory_are_named(tmp_path):
    class BlindCluster:  # what distributed.Client.run returns: {worker address: the probe's result}
        def run(self, probe, path, token):
            return {"tcp://10.0.0.7:4000": ("far-host", 1, False), "tcp://127.0.0.1:4001": probe(path, token)}

    with pytest.raises(DaskUnavailable, match=r"workers tcp://10.0.0.7:4000 on far-host cannot see the run directory"):
        _check_shared(BlindCluster(), str(tmp_path / "run"))
    assert not list((tmp_path / "run").iterdir())  # the probe file is gone again
