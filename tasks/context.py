"""What every stage needs, rebuilt from the run directory alone (so a stage can run in any process)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import yaml

from featcal import secrets
from featcal.config import RunConfig, config_from_dict
from featcal.devices import activation_dtype, resolve_device
from featcal.hub import local_dir
from featcal.modeling import Skeleton, expert_checkpoint
from storage.activations import BFLOAT16, ActivationStore
from storage.checkpoint import CanonicalCheckpoint
from storage.lora import LoraCheckpoint, config_directory
from storage.rundir import CONFIG_NAME, RunDir
from tasks.resident import Resident, resident_choice


class RunContext:
    def __init__(self, run_dir: str | Path):
        root = Path(run_dir).resolve()
        raw = yaml.safe_load((root / CONFIG_NAME).read_text())
        # run.yaml holds credentials as placeholders; the values come from this process's memory (featcal/secrets.py).
        self.cfg: RunConfig = config_from_dict(raw, root=root, source=str(root / CONFIG_NAME))
        secrets.require_known(self.cfg.model_dump(mode="json", by_alias=True), str(root / CONFIG_NAME))
        runtime = self.cfg.runtime
        self.run = RunDir(root, ActivationStore.of_run(root, runtime.activation_store, runtime.storage_options))
        if self.cfg.runtime.threads:
            torch.set_num_threads(self.cfg.runtime.threads)
        self.device = resolve_device(runtime.device)  # block forwards, Gram sums
        self.dtype = activation_dtype(runtime.precision)  # block forwards, stored activations
        self.skeleton = Skeleton.from_checkpoint(config_directory(local_dir(self.cfg.experts[self.cfg.tasks[0]]),
                                                                  local_dir(self.cfg.base)))
        self.adapter = self.skeleton.adapter
        # Kept between this process's stages: never in a key (the weights are the same either way).
        self.resident = Resident() if resident_choice(self.cfg, self.adapter)[0] else None
        self._checkpoints: dict[str, CanonicalCheckpoint | LoraCheckpoint] = {}

    @property
    def tasks(self) -> list[str]:
        return self.cfg.tasks

    @property
    def num_blocks(self) -> int:
        return self.adapter.num_blocks()

    @property
    def calibrated_blocks(self) -> int:
        """The blocks the pipeline calibrates, in forward order: the transformer blocks 0..L-1, then, with
        featcal.calibrate_head_side, the head side as block L (its prefix: `Adapter.block_prefix(L)`)."""
        return self.num_blocks + int(self.cfg.featcal.calibrate_head_side)

    def solve_group_count(self, layer: int) -> int:
        """How many solve stages block `layer` has: runtime.solve_groups, but one for the head side (one or two
        modules, fewer than a split may ask for)."""
        return 1 if layer == self.num_blocks else self.cfg.runtime.solve_groups

    @property
    def storage_dtype(self) -> str:
        """The activation store's dtype name for this run's activations."""
        return BFLOAT16 if self.dtype == torch.bfloat16 else "float32"

    def on_device(self, module: torch.nn.Module) -> torch.nn.Module:
        """A block (or head-side module) where and in the dtype this run computes."""
        return module.to(self.device, self.dtype)

    def checkpoint_dir(self, name: str) -> Path:
        """`base`, `merged`, `calibrated`, or a task name (its expert)."""
        if name == "base":
            return Path(local_dir(self.cfg.base))
        if name in ("merged", "calibrated"):
            return self.run / name
        return Path(local_dir(self.cfg.experts[name]))

    def checkpoint(self, name: str) -> CanonicalCheckpoint | LoraCheckpoint:
        """`checkpoint_dir(name)`'s tensors; an expert given as a LoRA adapter is read over the base
        (storage/lora.py)."""
        if name not in self._checkpoints:
            if name in self.cfg.experts:
                self._checkpoints[name] = expert_checkpoint(self.checkpoint_dir(name), self.checkpoint_dir("base"),
                                                            self.skeleton)
            else:
                self._checkpoints[name] = CanonicalCheckpoint(self.checkpoint_dir(name), self.adapter)
        return self._checkpoints[name]

    def canonical(self, name: str) -> CanonicalCheckpoint:
        """`base`, `merged` or `calibrated`: always a full checkpoint (only an expert may be a LoRA adapter)."""
        found = self.checkpoint(name)
        if not isinstance(found, CanonicalCheckpoint):
            raise TypeError(f"{name} is a LoRA adapter; expected a full checkpoint")
        return found


@functools.lru_cache(maxsize=4)
def _cached(run_dir: str, stamp: float) -> RunContext:
    return RunContext(run_dir)


def context(run_dir: str | Path) -> RunContext:
    """One context per run directory and config version in each process (skeleton building is not free)."""
    path = Path(run_dir).resolve()
    return _cached(str(path), (path / CONFIG_NAME).stat().st_mtime)
