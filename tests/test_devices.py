"""runtime.device and runtime.precision: resolving devices, refusing bad ones, and one forward + Gram on the
device FEATCAL_TEST_DEVICE names (default cpu; benchmarks/gpu_check.sh sets cuda) against the CPU result."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

import featcal.devices
import featcal_kernels
from featcal.config import ConfigError, RuntimeConfig, config_from_dict
from featcal.devices import (
    activation_dtype,
    bf16_warning,
    check_worker_devices,
    device_for_worker,
    gpu_devices,
    peak_device_mib,
    pin_worker_device,
    reset_device_peak,
    resolve_device,
    solve_device,
    to_device,
)
from featcal_kernels.bf16 import cpu_has_native_bf16
from tests.conftest import ROOT

TEST_DEVICE = torch.device(os.environ.get("FEATCAL_TEST_DEVICE", "cpu"))
GOOD = {"base": "base", "experts": {"a": "ea"}, "calibration": {"data": {"a": {"path": "da"}}}}


def _pretend_cuda(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """What torch would report with `count` CUDA devices, without touching CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_defaults_and_explicit_cpu(tmp_path):
    runtime = config_from_dict(GOOD, tmp_path).runtime
    assert (runtime.device, runtime.precision) == ("auto", "fp32")
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_picks_cuda_0_only_when_torch_sees_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    _pretend_cuda(monkeypatch, 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_cuda_without_cuda_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(ValueError) as err:
            resolve_device(spec)
        assert str(err.value) == (f"runtime.device: {spec!r} asked for but torch sees no CUDA device "
                                  f"(torch {torch.__version__}); use 'cpu' or 'auto'")


def test_cuda_index_beyond_the_devices_is_refused(monkeypatch):
    _pretend_cuda(monkeypatch, 2)
    with pytest.raises(ValueError, match=r"^runtime.device: 'cuda:2' asked for but torch sees 2 CUDA device\(s\), "
                                         r"cuda:0 to cuda:1$"):
        resolve_device("cuda:2")


def test_gpus_are_the_first_n_cuda_devices_and_no_more_than_torch_sees(monkeypatch):
    _pretend_cuda(monkeypatch, 2)
    assert gpu_devices(2) == ["cuda:0", "cuda:1"]
    assert gpu_devices(1) == ["cuda:0"]
    with pytest.raises(ValueError) as err:
        gpu_devices(3)
    assert str(err.value) == (f"--gpus 3: torch sees 2 CUDA device(s) (torch {torch.__version__}); ask for at most "
                              "that many, or run without --gpus")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^--gpus 1: torch sees 0 CUDA device\(s\)"):
        gpu_devices(1)
    with pytest.raises(ValueError, match=r"^--gpus must be at least 1, got 0$"):
        gpu_devices(0)


def test_local_cluster_worker_i_gets_device_i_and_other_names_are_refused():
    devices = ["cuda:0", "cuda:1"]
    assert [device_for_worker(i, devices) for i in (0, 1)] == devices
    for name in (2, -1, "0", "tcp://10.0.0.1:4000"):
        with pytest.raises(ValueError) as err:
            device_for_worker(name, devices)
        assert str(err.value) == (f"Dask worker {name!r}: a worker pinned to one of 2 devices needs a name from 0 to 1 "
                                  "(a local cluster's)")


@pytest.mark.parametrize("spec", ["auto", "cuda"])
def test_worker_devices_go_with_auto_or_their_own_kind(spec):
    check_worker_devices(["cuda:0", "cuda:1"], spec)


@pytest.mark.parametrize("spec", ["cpu", "cuda:1"])
def test_worker_devices_that_contradict_runtime_device_are_refused(spec):
    with pytest.raises(ValueError) as err:
        check_worker_devices(["cuda:0", "cuda:1"], spec)
    assert str(err.value) == (f"runtime.device: {spec!r} contradicts the workers' devices cuda:0, cuda:1; set it to "
                              "'auto' (or drop --gpus)")


def test_a_pinned_worker_resolves_auto_and_its_kind_to_its_own_device(monkeypatch):
    _pretend_cuda(monkeypatch, 2)
    monkeypatch.setattr(featcal.devices, "_worker_device", torch.device("cuda", 1))
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    pin_worker_device("cpu")  # a CPU pin touches no CUDA state; monkeypatch restores the unpinned process after
    assert featcal.devices._worker_device == torch.device("cpu") == resolve_device("auto")


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cuda:-1", "cuda:", "CPU", "cuda:0 ", "mps"])
def test_bad_device_specs_are_refused_by_the_config(tmp_path, spec):
    with pytest.raises(ConfigError) as err:
        config_from_dict({**GOOD, "runtime": {"device": spec}}, tmp_path)
    assert str(err.value) == (f"runtime.device: Value error, {spec!r} is not a device: expected auto, cpu, cuda or "
                              f"cuda:N (N = 0, 1, ...) (got {spec!r}, from config)")
    with pytest.raises(ValueError, match=r"^runtime.device: .* is not a device: expected auto, cpu, cuda or cuda:N"):
        resolve_device(spec)


def test_good_device_specs_pass_the_config():
    assert [RuntimeConfig(device=s).device for s in ("auto", "cpu", "cuda", "cuda:0", "cuda:12")] == [
        "auto", "cpu", "cuda", "cuda:0", "cuda:12"]


def test_precision_maps_to_the_activation_dtype_and_fp16_is_refused(tmp_path):
    assert activation_dtype("fp32") == torch.float32
    assert activation_dtype("bf16") == torch.bfloat16
    assert RuntimeConfig(precision="bf16").precision == "bf16"
    with pytest.raises(ValidationError, match="precision"):
        RuntimeConfig(precision="fp16")
    with pytest.raises(ConfigError, match=r"^runtime.precision: Input should be 'fp32' or 'bf16' \(got 'fp16'"):
        config_from_dict({**GOOD, "runtime": {"precision": "fp16"}}, tmp_path)
    with pytest.raises(ValueError, match=r"^runtime.precision: expected one of \['bf16', 'fp32'\], got 'fp16'$"):
        activation_dtype("fp16")


def test_bf16_on_a_cpu_without_bf16_instructions_is_said_not_refused():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert bf16_warning(cpu, "bf16", native_bf16=False) == (
        "runtime.precision: bf16 on a CPU without bf16 instructions (no AVX512-BF16 or AMX): torch emulates them, "
        "and a run took 3.3× as long as in fp32 on such a CPU; use fp32 here")
    assert bf16_warning(cpu, "bf16", native_bf16=True) is None
    assert bf16_warning(cpu, "fp32", native_bf16=False) is None
    assert bf16_warning(cuda, "bf16", native_bf16=False) is None  # GPUs: bf16 tensor cores
    assert isinstance(cpu_has_native_bf16(), bool)


def test_to_device_on_cpu_returns_the_same_tensors():
    batch = {"input_ids": torch.arange(6).reshape(2, 3), "pixel_values": torch.randn(2, 3)}
    moved = to_device(batch, torch.device("cpu"))
    assert all(moved[k] is batch[k] for k in batch) and moved.keys() == batch.keys()


def test_solve_device_follows_free_memory(monkeypatch):
    assert solve_device(torch.device("cpu"), 4096, 4096) == torch.device("cpu")
    dim, cols = 1000, 500
    needed = 1.5 * 8 * (4 * dim * dim + 2 * dim * cols)  # 60 MB
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(needed), 80 * 2**30))
    assert solve_device(cuda, dim, cols) == cuda
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(needed) - 1, 80 * 2**30))
    assert solve_device(cuda, dim, cols) == torch.device("cpu")


def test_peak_memory_is_zero_on_cpu():
    reset_device_peak(torch.device("cpu"))
    assert peak_device_mib(torch.device("cpu")) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_gram_on_the_test_device_match_the_cpu(dtype):
    """On a GPU machine (FEATCAL_TEST_DEVICE=cuda) this runs the forward and featcal::dual_gram on CUDA."""
    if TEST_DEVICE.type == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"FEATCAL_TEST_DEVICE={TEST_DEVICE} but torch sees no CUDA device (torch {torch.__version__})")
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(48, 48).to(dtype)
    x = torch.randn(300, 48, generator=g).to(dtype)
    w = torch.rand(300, generator=g) + 0.5
    reset_device_peak(TEST_DEVICE)
    y_cpu = linear(x)
    with torch.no_grad():
        y_dev = linear.to(TEST_DEVICE)(to_device({"x": x}, TEST_DEVICE)["x"])
    assert y_dev.device.type == TEST_DEVICE.type and y_dev.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y_dev.float().cpu(), y_cpu.detach().float(), rtol=tol, atol=tol)
    # The same inputs on both sides, so only the kernels differ: fp32 sums in another order (or Triton's terms).
    xs, xe = x, y_cpu.detach()
    on_dev = to_device({"xs": xs, "xe": xe, "w": w}, TEST_DEVICE)
    want = featcal_kernels.dual_gram(xs, xe, w)
    got = featcal_kernels.dual_gram(on_dev["xs"], on_dev["xe"], on_dev["w"])
    for name, a, b in zip(want._fields, got, want):
        assert a.device.type == TEST_DEVICE.type, name
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-3, msg=name)
    assert want.sum_w.item() == pytest.approx(w.sum().item(), rel=1e-6)
    assert (peak_device_mib(TEST_DEVICE) > 0) == (TEST_DEVICE.type == "cuda")


def _rss_anon_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_release_freed_memory_returns_the_heap_a_stage_freed() -> None:
    """Tensors below glibc's mmap threshold come from its heap, which keeps their pages when they are freed (a live
    one at the top stops the heap from shrinking by itself): released, those pages leave the process's RSS."""
    from featcal.devices import release_freed_memory

    release_freed_memory()
    freed = [torch.ones(16384) for _ in range(3200)]  # 64 KiB each, 200 MiB in all
    top = torch.ones(16384)
    del freed
    before = _rss_anon_mib()
    release_freed_memory()
    after = _rss_anon_mib()
    assert top.sum() == 16384
    assert before - after > 150, (before, after)


def _freed_mib_left_in_rss(keep: bool) -> float:
    """MiB of a freed 64 MiB tensor still in the process's RSS, in a child process: keep_freed_memory changes the C
    heap for the rest of a process's life, which this one must not get."""
    code = (
        "import torch\n"
        "from featcal.devices import keep_freed_memory\n"
        "from tests.test_devices import _rss_anon_mib\n"
        f"if {keep}: keep_freed_memory()\n"
        "t = torch.empty(2**24).fill_(1.0)\n"  # 64 MiB
        "held = _rss_anon_mib()\n"
        "del t\n"
        "print(64 - (held - _rss_anon_mib()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    return float(out.stdout.split()[-1])


def test_keep_freed_memory_keeps_a_freed_block_for_the_next_stage() -> None:
    """glibc maps a 64 MiB block on its own and unmaps it when freed, so the next stage faults every page in again;
    with keep_freed_memory the block comes from the heap, which keeps its pages when it is freed."""
    assert _freed_mib_left_in_rss(keep=False) < 8
    assert _freed_mib_left_in_rss(keep=True) > 56


def test_keep_freed_memory_is_refused_where_the_c_library_has_no_mallopt(monkeypatch) -> None:
    monkeypatch.setattr(featcal.devices, "_MALLOPT", None)
    with pytest.raises(ValueError, match=r"^runtime\.keep_freed_memory: true needs glibc's mallopt"):
        featcal.devices.keep_freed_memory()
    featcal.devices.check_keep_freed_memory(False)  # not asked: nothing to refuse
