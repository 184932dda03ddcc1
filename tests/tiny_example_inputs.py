"""Copies of the tiny BERT example (tests/conftest.py's `tiny_example`) to break, and the edits that break them:
its config, a split of its data, the tensors of one checkpoint. Shared by the tests of bad input and of degenerate
set-ups; also the one dotted-key setter every test that edits a raw config uses."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import torch
import yaml
from safetensors.torch import load_file, save_file

Tensors = dict[str, torch.Tensor]


def set_key(raw: dict[str, Any], dotted: str, value: Any, sep: str = ".") -> None:
    """Set one key of a raw config given as a path (`merge.scaling`, or with sep="__" `merge__scaling` for keyword
    arguments); missing sections are created."""
    *parents, leaf = dotted.split(sep)
    node = raw
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def key_setting(dotted: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit of a raw config that sets one dotted key (see `set_key`)."""
    return lambda raw: set_key(raw, dotted, value)


def copied_bert_example(tiny_example: Path, tmp_path: Path) -> Path:
    """The BERT example's config and data copied (checkpoints linked: cases that break one copy it first)."""
    root = tmp_path / "ex"
    src = tiny_example / "bert"
    root.mkdir()
    shutil.copy(src / "example.yaml", root / "example.yaml")
    shutil.copytree(src / "data", root / "data")
    for name in ("base", "experts"):
        (root / name).symlink_to(src / name)
    return root


def edit_example_yaml(root: Path, change: Callable[[dict], None]) -> None:
    """Rewrite the copy's example.yaml as `change` edits its raw mapping."""
    raw = yaml.safe_load((root / "example.yaml").read_text())
    change(raw)
    (root / "example.yaml").write_text(yaml.safe_dump(raw))


def edit_split(root: Path, task: str, split: str, change: Callable[[datasets.Dataset], datasets.Dataset]) -> None:
    """Replace one split of the copy's saved dataset `data/TASK` by what `change` makes of it."""
    path = root / "data" / task
    dd = datasets.load_from_disk(str(path))
    fresh = path.with_name(f"{task}.new")
    datasets.DatasetDict({**dd, split: change(dd[split])}).save_to_disk(str(fresh))
    shutil.rmtree(path)
    fresh.rename(path)


def own_checkpoint_copy(root: Path, field: str) -> Path:
    """The checkpoint `field` (base or experts/TASK), its link replaced by a copy of its own, to break."""
    link = root / field
    if field.startswith("experts/"):
        target = (root / "experts").resolve()
        (root / "experts").unlink()
        shutil.copytree(target, root / "experts", symlinks=False)
        return root / field
    target = link.resolve()
    link.unlink()
    shutil.copytree(target, link)
    return link


def rewrite_tensors(root: Path, field: str, change: Callable[[Tensors, Tensors], Tensors]) -> None:
    """The checkpoint `field` (its own copy) with its tensors replaced by `change(tensors, base tensors)`."""
    path = own_checkpoint_copy(root, field) / "model.safetensors"
    base = load_file(root / "base" / "model.safetensors")
    save_file(change(load_file(path), base), path, metadata={"format": "pt"})
