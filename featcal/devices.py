"""Where a run computes (runtime.device) and in which dtype it keeps activations (runtime.precision).

Block forwards and Gram sums run on the resolved device; float64 solves run there only when it has room,
else on the CPU (the Gram sums are float64 either way, so the weights do not depend on where they ran).

Several GPUs: each worker process of a local Dask cluster is given one device (`featcal run --gpus N`), and its
stages run there whatever runtime.device ('auto' or 'cuda') would pick: `pin_worker_device`.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator

import torch

from featcal.config import DEVICE_FORMS, DEVICE_SPEC

# runtime.precision -> dtype of block forwards and stored activations (Grams still sum in fp32, then float64).
STORAGE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
# A float64 solve needs up to 4 [dim, dim] matrices (the summed Gram, one task's Gram while summing or the Cholesky
# factor after, the solver's workspace, one to spare) plus the right-hand side and solution; this factor leaves room
# for the allocator's fragmentation and other tensors.
SOLVE_MEMORY_MARGIN = 1.5


# This process's device when it is one worker of a run spread over several devices (None: runtime.device decides).
_worker_device: torch.device | None = None


def gpu_devices(count: int) -> list[str]:
    """The devices of `--gpus N`: cuda:0 to cuda:N-1, refused up front when torch sees fewer."""
    if count < 1:
        raise ValueError(f"--gpus must be at least 1, got {count}")
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen < count:
        raise ValueError(f"--gpus {count}: torch sees {seen} CUDA device(s) (torch {torch.__version__}); "
                         "ask for at most that many, or run without --gpus")
    return [f"cuda:{i}" for i in range(count)]


def check_worker_devices(devices: list[str], spec: str) -> None:
    """Workers pinned to `devices` replace what runtime.device `spec` would pick; they may not contradict it."""
    kinds = {torch.device(d).type for d in devices}
    if spec not in ("auto", *kinds):
        raise ValueError(f"runtime.device: {spec!r} contradicts the workers' devices {', '.join(devices)}; "
                         "set it to 'auto' (or drop --gpus)")


def device_for_worker(name: object, devices: list[str]) -> str:
    """The device of worker `name` (a local cluster names its workers 0, 1, ...): one worker per device."""
    if not isinstance(name, int) or not 0 <= name < len(devices):
        raise ValueError(f"Dask worker {name!r}: a worker pinned to one of {len(devices)} devices needs a name from 0 "
                         f"to {len(devices) - 1} (a local cluster's)")
    return devices[name]


def pin_worker_device(device: str) -> None:
    """Every stage this process runs from now on computes on `device` (checked now: one line, not a CUDA error
    mid-stage); a CUDA device also becomes the current one, where Triton launches its kernels."""
    global _worker_device
    _worker_device = resolve_device(device)
    if _worker_device.type == "cuda":
        torch.cuda.set_device(_worker_device)


def resolve_device(spec: str) -> torch.device:
    """The torch device a runtime.device value names, refused up front when torch cannot reach it; in a worker
    pinned to one device, 'auto' and that device's kind name it."""
    match = DEVICE_SPEC.fullmatch(spec)
    if match is None:
        raise ValueError(f"runtime.device: {spec!r} is not a device: expected {DEVICE_FORMS}")
    if _worker_device is not None and spec in ("auto", _worker_device.type):
        return _worker_device
    if spec == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"runtime.device: {spec!r} asked for but torch sees no CUDA device "
                         f"(torch {torch.__version__}); use 'cpu' or 'auto'")
    index, count = int(match.group(1) or 0), torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"runtime.device: {spec!r} asked for but torch sees {count} CUDA device(s), "
                         f"cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def activation_dtype(precision: str) -> torch.dtype:
    """The dtype of block forwards and stored activations for a runtime.precision value."""
    if precision not in STORAGE_DTYPES:
        raise ValueError(f"runtime.precision: expected one of {sorted(STORAGE_DTYPES)}, got {precision!r}")
    return STORAGE_DTYPES[precision]


def bf16_warning(device: torch.device, precision: str, native_bf16: bool) -> str | None:
    """Why runtime.precision bf16 would make this run slower rather than faster, or None.

    On a CPU without bf16 instructions the block forwards ran 7× slower than fp32 and the whole run 3.3×
    (benchmarks/results/pipeline_cost_vitb32_avx2.md): bf16 still gives the same weights within its tolerance, so
    this is said, not refused."""
    if precision != "bf16" or device.type != "cpu" or native_bf16:
        return None
    return ("runtime.precision: bf16 on a CPU without bf16 instructions (no AVX512-BF16 or AMX): torch emulates "
            "them, and a run took 3.3× as long as in fp32 on such a CPU; use fp32 here")


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A batch on `device`: the batch itself on the CPU; to CUDA through pinned memory, so the copy is
    asynchronous and overlaps the previous block's compute."""
    if device.type != "cuda":
        return batch
    return {name: (t.pin_memory() if t.device.type == "cpu" else t).to(device, non_blocking=True)
            for name, t in batch.items()}


def solve_device(device: torch.device, dim: int, cols: int) -> torch.device:
    """Where a float64 solve of a [dim, dim] system with a [dim, cols] right-hand side runs: on a CUDA device
    when its free memory holds it with margin, else on the CPU (an out-of-memory error mid-run costs more)."""
    if device.type != "cuda":
        return torch.device("cpu")
    free, _ = torch.cuda.mem_get_info(device)
    needed = SOLVE_MEMORY_MARGIN * 8 * (4 * dim * dim + 2 * dim * cols)
    return device if free >= needed else torch.device("cpu")


def peak_device_mib(device: torch.device) -> float:
    """Peak device memory allocated since the last reset, for a stage's record (0.0 on the CPU: see peak RSS)."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0


def reset_device_peak(device: torch.device) -> None:
    """Start a stage's peak device memory from zero (nothing to do on the CPU, nor before this process first used
    CUDA: torch then has no allocator to reset and refuses with 'Invalid device argument')."""
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats(device)


def _libc_function(name: str) -> Callable[..., int] | None:
    """A glibc function, or None where the C library has none (macOS, musl)."""
    try:
        return getattr(ctypes.CDLL(None), name, None)
    except OSError:
        return None


_MALLOC_TRIM = _libc_function("malloc_trim")
_MALLOPT = _libc_function("mallopt")
# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8


def check_keep_freed_memory(asked: bool) -> None:
    """Refuse runtime.keep_freed_memory before any work where the C library cannot apply it (macOS, musl)."""
    if asked and _MALLOPT is None:
        raise ValueError("runtime.keep_freed_memory: true needs glibc's mallopt, which this process's C library "
                         "lacks; set it to false")


def keep_freed_memory() -> None:
    """Have glibc keep the memory a stage frees for the next stage (runtime.keep_freed_memory), for the rest of this
    process's life: every block from one heap (none mapped on its own, one arena for all threads), never trimmed.
    glibc maps each block over 32 MiB on its own and unmaps it when freed, so every stage faulted its float64 sums
    and solve matrices in afresh, and with the model shards in the page cache each fault also reclaimed a page: a
    Llama-3.2-3B block spent 14.0 of its 63.1 s in the kernel, 8.3 of 57.8 s with this
    (benchmarks/results/heap_reuse_llama.md)."""
    check_keep_freed_memory(True)
    assert _MALLOPT is not None  # refused just above otherwise
    # mallopt returns 1 on success; −1 as the trim threshold means never (mallopt(3))
    settings = (("M_MMAP_MAX", M_MMAP_MAX, 0), ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, -1),
                ("M_ARENA_MAX", M_ARENA_MAX, 1))
    refused = [name for name, param, value in settings if _MALLOPT(param, value) != 1]
    if refused:
        raise ValueError(f"runtime.keep_freed_memory: glibc's mallopt refused {', '.join(refused)}; set it to false")


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system. glibc keeps what the Gram stages freed (about 0.5 GiB on
    the ViT-B/32 shape), while a solve's d × d float64 matrices are too large for its heap and are mapped afresh, on
    top of it: released before each solve, the run's peak RSS there fell 1.135 → 1.061 GiB for about 2 % CPU
    (benchmarks/results/peak_rss_changes.md). Not after every stage: each would then fault its heap back in, 10 %
    more CPU on that shape. Skipped under runtime.keep_freed_memory, which keeps that heap for the next stage."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread inside the block: results must not depend on the core count (a fine-tune's weights do),
    and on 2 busy cores one thread is also the faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
