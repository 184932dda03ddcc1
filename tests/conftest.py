"""Shared fixtures: one tiny example build per test session, and the uninterrupted reference runs of it; a fresh
console for tests that call `featcal` in-process, and the one error line it ends with."""

import atexit
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One torch thread per process, in every test worker and every `featcal` process a test starts (they inherit it):
# the tensors are tiny, and on CI's 2 cores two xdist workers of two threads each spin-wait on each other's core (a
# tiny T5's 40 training steps took 160 s of wall time on two threads on a busy 2-core host, 5 s on one). Results
# then do not depend on the core count either. A run that must use more sets runtime.threads, as a user would.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # torch is imported already: its pool is sized
# Prefect's state, the SQLite database of each run's temporary server included, in a home of this session's own
# (each xdist worker is a session): two sessions creating ~/.prefect's database at once would race on its migrations.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="featcal-tests-prefect-")
atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)

from featcal.config import RunConfig, config_from_dict  # noqa: E402
from featcal.devices import one_thread  # noqa: E402
from featcal_bench.example import example_for_tests  # noqa: E402
from flows.pipeline import run_pipeline  # noqa: E402
from tests.tiny_example_inputs import set_key  # noqa: E402


@pytest.fixture(scope="session")
def tiny_example(tmp_path_factory) -> Path:
    return example_for_tests(tmp_path_factory)


def example_config(root: Path, arch: str, **sections) -> RunConfig:
    """The example's config for one architecture, with whole sections or single keys replaced."""
    raw = yaml.safe_load((root / arch / "example.yaml").read_text())
    for dotted, value in sections.items():
        set_key(raw, dotted, value, sep="__")
    return config_from_dict(raw, root / arch)


@pytest.fixture
def fresh_console():
    """main() adds a console handler on the stderr of its first call; each test's captured stderr needs its own.
    Modules that call main() in-process and read its stderr use it for every test (pytestmark usefixtures)."""
    yield
    ours = logging.getLogger("featcal")
    for handler in [h for h in ours.handlers if h.get_name() == "featcal-console"]:
        ours.removeHandler(handler)
    ours.propagate = True


def plan_or_run_args(command: str, config: Path, run_dir: Path) -> list[str]:
    """The arguments of `featcal plan CONFIG` or of `featcal run` of it into `run_dir` (in-process, no Prefect)."""
    if command == "plan":
        return ["plan", str(config)]
    return ["run", "--no-prefect", str(config), "--run-dir", str(run_dir)]


def one_error_line(err: str) -> str:
    """The one `featcal: error:` line of a refused command's stderr (and no traceback)."""
    lines = [line for line in err.splitlines() if line.startswith("featcal: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


ROOT = Path(__file__).resolve().parent.parent


def featcal_process(*args: str, **kw) -> subprocess.Popen:
    """`featcal ARGS` in a session (and process group) of its own, as a user's terminal would start it."""
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@pytest.fixture(scope="session")
def example_runs(tiny_example, tmp_path_factory) -> Callable[[str], tuple[RunConfig, Path, dict]]:
    """The example of an architecture run as shipped (three experts, evaluation on), once per session: `(config, run
    directory, run_pipeline's records)`. Tests only read it; one that changes a run makes its own."""
    done: dict[str, tuple[RunConfig, Path, dict]] = {}

    def run_of(arch: str) -> tuple[RunConfig, Path, dict]:
        if arch not in done:
            cfg = example_config(tiny_example, arch)
            run_dir = tmp_path_factory.mktemp(f"example-run-{arch}")
            done[arch] = (cfg, run_dir, run_pipeline(cfg, run_dir))
        return done[arch]

    return run_of


@pytest.fixture(scope="session")
def resume_config(tiny_example) -> Path:
    """The tiny BERT example without evaluation: what interrupted-and-resumed runs are compared on."""
    raw = yaml.safe_load((tiny_example / "bert" / "example.yaml").read_text())
    raw["evaluation"] = {"enabled": False}
    path = tiny_example / "bert" / "resume.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="session")
def reference_run(resume_config, tmp_path_factory) -> Path:
    """An uninterrupted run of `resume_config`, for the bits every resumed run must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference")
    proc = featcal_process("run", str(resume_config), "--run-dir", str(run_dir), "--no-prefect")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    return run_dir


@pytest.fixture(scope="session")
def one_thread_run(tiny_example, tmp_path_factory) -> Path:
    """The tiny BERT example in one process, stages one after the other, one torch thread: what runs spread over
    worker processes (Dask, the pool) must reproduce bit for bit, each worker using one thread too (another thread
    count may round differently)."""
    run_dir = tmp_path_factory.mktemp("one-thread")
    with torch_threads_restored():
        run_pipeline(
            example_config(tiny_example, "bert", evaluation={"enabled": False}, runtime={"threads": 1}), run_dir
        )
    return run_dir


@contextlib.contextmanager
def torch_threads_restored() -> Iterator[None]:
    """runtime.threads applies to the whole process: a run in-process may set it; the count is put back after."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """Every test starts at the process's thread count: an in-process run whose config sets runtime.threads (or a
    tool that calls torch.set_num_threads) would otherwise change the rounding of every later in-process run on the
    same worker, and their weights would no longer match a reference run bit for bit."""
    with torch_threads_restored():
        yield


@pytest.fixture
def torch_on_one_thread():
    """Tiny training loops are many small ops: one thread, or they wait on a busy machine's second core."""
    with one_thread():
        yield

