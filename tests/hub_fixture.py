"""A Hugging Face hub cache filled offline, under the real repository ids, file names, configurations, splits and
column layouts the hub recipes read (docs/hub-layouts.md lists them with their sources), with tiny models and a few
rows each: what `snapshot_download` would have left in `HF_HOME/hub` after fetching them.

The cache layout (huggingface_hub's): `{models,datasets}--ORG--NAME/` holding `refs/main` (the commit of `main`),
`blobs/<sha256>` (each file's content) and `snapshots/<commit>/<path>` (a relative symlink to its blob).
A dataset's card (README.md) carries the YAML `configs:` that maps each configuration's splits to its data files,
and `dataset_info:` with its features, as the hub's parquet datasets do."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import datasets
import torch
import yaml
from safetensors.torch import load_file


def commit_of(repo_id: str) -> str:
    """A fixed 40-hex commit per repository (the hub's are git SHA-1s)."""
    return hashlib.sha1(repo_id.encode()).hexdigest()


def _storage(cache: Path, repo_type: str, repo_id: str) -> Path:
    return cache / f"{repo_type}s--{repo_id.replace('/', '--')}"


def add_files(cache: Path, repo_type: str, repo_id: str, files: Mapping[str, bytes]) -> Path:
    """`files` (path in the repository → content) as the cache holds them; returns the snapshot directory."""
    storage, commit = _storage(cache, repo_type, repo_id), commit_of(repo_id)
    snapshot = storage / "snapshots" / commit
    for rel, content in files.items():
        blob = storage / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return snapshot


def add_model(cache: Path, repo_id: str, saved: Path, weights: str = "safetensors") -> Path:
    """A `save_pretrained` directory as hub model `repo_id`, its weights as `model.safetensors` ("safetensors"), as
    `pytorch_model.bin` alone ("bin": repositories from before safetensors), or both ("both": a `.bin` repository
    that later gained a safetensors copy)."""
    files = {p.relative_to(saved).as_posix(): p.read_bytes() for p in sorted(saved.rglob("*")) if p.is_file()}
    if weights != "safetensors":
        tmp = saved / "pytorch_model.bin"
        torch.save(load_file(saved / "model.safetensors"), tmp)
        files["pytorch_model.bin"] = tmp.read_bytes()
        tmp.unlink()
    if weights == "bin":
        files.pop("model.safetensors")
    return add_files(cache, "model", repo_id, files)


def card_glob(data_file: str) -> str:
    """A data file's pattern as `push_to_hub` writes it into the card's `configs:` (`mnli/validation_matched-*`): the
    hub's cards name globs, not files."""
    return re.sub(r"-\d{5}-of-\d{5}\.parquet$", "-*", data_file)


def add_dataset(cache: Path, repo_id: str, configs: Mapping[str, datasets.DatasetDict],
                data_file: Callable[[str, str], str], default: str | None = None) -> Path:
    """Each configuration's splits as parquet files at `data_file(config, split)`, with the card that maps them (by
    glob); `default` names the configuration `load_dataset(ID)` picks without one."""
    files, card_configs, infos = {}, [], []
    for config, splits in configs.items():
        for split, ds in splits.items():
            tmp = cache / ".parquet"
            ds.to_parquet(str(tmp))
            files[data_file(config, split)] = tmp.read_bytes()
            tmp.unlink()
        entry = {"config_name": config, "data_files": [{"split": s, "path": card_glob(data_file(config, s))}
                                                       for s in splits]}
        card_configs.append({**entry, **({"default": True} if config == default else {})})
        first = next(iter(splits.values()))
        infos.append({"config_name": config, "features": first.features._to_yaml_list(),
                      "splits": [{"name": s, "num_bytes": d.data.nbytes, "num_examples": len(d)}
                                 for s, d in splits.items()]})
    card = yaml.safe_dump({"configs": card_configs, "dataset_info": infos}, sort_keys=False)
    files["README.md"] = f"---\n{card}---\n# {repo_id} (a test fixture)\n".encode()
    return add_files(cache, "dataset", repo_id, files)


def remove_repo(cache: Path, repo_type: str, repo_id: str) -> None:
    shutil.rmtree(_storage(cache, repo_type, repo_id))
