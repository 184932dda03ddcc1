"""Hub ids as inputs. Each is resolved once, before any work, to a snapshot directory of the local Hugging Face cache
(downloaded, with a progress bar, when the hub is reachable; looked up when HF_HUB_OFFLINE=1), so every reader
downstream reads a local directory. A resolved id is pinned as `org/name@<commit>`: run.yaml and every cache key
name the exact revision, and a later lookup of the pinned id is a cache hit that needs no network.

Only what a run reads is fetched: a model's configs, tokenizer or processor files and safetensors weights (not its
TensorFlow, Flax or ONNX copies); a dataset's card and the data files of the configuration asked for.
A model repository whose weights exist only as `pytorch_model.bin` is refused in one line by `featcal run` (its
readers read safetensors); the benchmark builds convert such a repository (transformers loads it, save_pretrained
re-saves it as safetensors), so they fetch the .bin files instead.
HF_TOKEN (gated repositories such as meta-llama's) is read by huggingface_hub itself and never recorded here."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("featcal")

_HUB_ID = re.compile(r"(?P<id>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[0-9a-f]{40}))?")
MODEL_FILES = ("*.json", "*.txt", "*.model", "*.tiktoken", "tokenizer*")  # configs, tokenizer, processor
SAFETENSORS = ("*.safetensors", "*.safetensors.index.json")
BIN_WEIGHTS = ("pytorch_model*.bin", "pytorch_model.bin.index.json")
README = "README.md"


class HubError(FileNotFoundError):
    """A hub input that cannot be resolved, or whose repository lacks what the run reads."""


@dataclass(frozen=True)
class Resolved:
    """One hub input, resolved: where the config named it, its id and commit, its local snapshot directory, its size
    on disk and what was downloaded to make it (0 when the cache held it)."""

    field: str
    repo_id: str
    repo_type: str
    revision: str
    path: str
    size: int
    downloaded: int

    @property
    def pinned(self) -> str:
        return f"{self.repo_id}@{self.revision}"


def hub_ref(value: str) -> tuple[str, str | None] | None:
    """(repo id, commit or None) when `value` names a hub repository rather than a local path, else None."""
    if value.startswith((".", "/", "~")) or Path(value).exists():
        return None
    m = _HUB_ID.fullmatch(value)
    return (m["id"], m["revision"]) if m else None


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE  # read per call: HF_HOME set after import (tests) still counts


def _files(directory: str) -> dict[str, int]:
    root = Path(directory)
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def _weights(files: list[str], repo_id: str, field: str, convert_bin: bool) -> tuple[str, ...]:
    """Which weight files to fetch: the safetensors ones; a .bin-only repository's .bin files when the caller
    converts them, else a one-line refusal."""
    if any(f.endswith(".safetensors") for f in files):
        return SAFETENSORS
    if any(re.fullmatch(r"pytorch_model(-\d+-of-\d+)?\.bin", f) for f in files):
        if convert_bin:
            return BIN_WEIGHTS
        raise HubError(f"{field}: hub model {repo_id} holds its weights only as pytorch_model.bin; featcal reads "
                       "safetensors: convert it once (AutoModel.from_pretrained(ID).save_pretrained(DIR)) and give DIR")
    raise HubError(f"{field}: hub model {repo_id} has no weights (expected model.safetensors or sharded "
                   f"model-*.safetensors with model.safetensors.index.json); it has {files[:8]}")


def _data_patterns(card: str, config: str | None) -> tuple[str, ...] | None:
    """The data files of `config` as the dataset card's `configs:` lists them (None: the whole repository)."""
    from huggingface_hub import DatasetCard

    configs = DatasetCard.load(card).data.to_dict().get("configs") or []
    wanted = next((c for c in configs if c.get("config_name") == (config or "default")), None)
    if wanted is None:
        if config is not None and configs:
            raise HubError(f"config {config!r} is not a configuration of the dataset (its card lists "
                           f"{sorted(c.get('config_name') for c in configs)})")
        return None
    files = wanted.get("data_files") or []
    paths = [files] if isinstance(files, str) else [p for entry in files for p in (
        [entry] if isinstance(entry, str) else [entry["path"]] if isinstance(entry["path"], str) else entry["path"])]
    return (README, *paths)


def _failed(field: str, repo_id: str, repo_type: str, exc: Exception) -> HubError:
    where = f"{repo_type}s--{repo_id.replace('/', '--')}"
    if offline():
        return HubError(f"{field}: hub {repo_type} {repo_id} is not in the cache {_cache()} (expected {where}/ with "
                        f"refs/main and its snapshot) and HF_HUB_OFFLINE=1; download it with network, or give a "
                        "local directory")
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    gated = type(exc).__name__ == "GatedRepoError" or " 401 " in f" {first} "
    return HubError(f"{field}: cannot fetch hub {repo_type} {repo_id}: {first}"
                    + (" (a gated repository: set HF_TOKEN or run `hf auth login` after accepting its licence)"
                       if gated else ""))


def _snapshot(repo_id: str, repo_type: str, revision: str | None, patterns: tuple[str, ...] | None,
              field: str) -> str:
    """The repository's files matching `patterns` fetched into the cache (progress shown); their snapshot path."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=_cache(),
                                 allow_patterns=list(patterns) if patterns else None)
    except Exception as exc:
        raise _failed(field, repo_id, repo_type, exc) from exc


def _cached(repo_id: str, repo_type: str, revision: str | None, field: str) -> str:
    """The cache's snapshot directory of `revision` (default: the commit refs/main names), read without the network:
    huggingface_hub's own offline lookup would call a snapshot holding only the files a run reads incomplete."""
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(_cache()) / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    ref = storage / "refs" / "main"
    commit = revision or (ref.read_text().strip() if ref.is_file() else None)
    path = storage / "snapshots" / commit if commit else None
    if path is None or not path.is_dir():
        raise _failed(field, repo_id, repo_type, FileNotFoundError(storage))
    return str(path)


def _to_download(repo_id: str, repo_type: str, revision: str | None, field: str) -> dict[str, tuple[int, bool]]:
    """Every file of the repository at `revision`: (size, would download). Needs the hub (its metadata only)."""
    from huggingface_hub import snapshot_download

    try:
        listing = snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=_cache(), dry_run=True)
    except Exception as exc:
        raise _failed(field, repo_id, repo_type, exc) from exc
    return {f.filename: (f.file_size or 0, f.will_download) for f in listing}


def resolve(value: str, field: str, repo_type: str = "model", config: str | None = None,
            convert_bin: bool = False) -> Resolved | None:
    """Hub input `value` fetched (or found in the cache) and checked to hold what a run reads; None for a local
    path. Online, the bytes to fetch are logged before the download starts."""
    ref = hub_ref(value)
    if ref is None:
        return None
    repo_id, revision = ref
    if offline():
        path = _cached(repo_id, repo_type, revision, field)
        patterns = _patterns(path, repo_id, repo_type, config, field, convert_bin)
        return Resolved(field, repo_id, repo_type, Path(path).name, path, _matched_size(_files(path), patterns), 0)
    listing = _to_download(repo_id, repo_type, revision, field)
    card = _snapshot(repo_id, repo_type, revision, (README,), field) if repo_type == "dataset" else None
    patterns = _patterns(card, repo_id, repo_type, config, field, convert_bin, list(listing))
    wanted = {f: v for f, v in listing.items() if _matches(f, patterns)}
    fetch = sum(size for size, new in wanted.values() if new)
    if fetch:
        log.info("%s: downloading %s from hub %s %s", field, _human(fetch), repo_type, repo_id)
    path = _snapshot(repo_id, repo_type, revision, patterns, field)
    return Resolved(field, repo_id, repo_type, Path(path).name, path, sum(s for s, _ in wanted.values()), fetch)


def _patterns(where: str | None, repo_id: str, repo_type: str, config: str | None, field: str, convert_bin: bool,
              listing: list[str] | None = None) -> tuple[str, ...] | None:
    if repo_type == "dataset":
        card = Path(where) / README if where and Path(where).is_dir() else None
        try:
            return _data_patterns(str(card), config) if card and card.is_file() else None
        except HubError as exc:
            raise HubError(f"{field}: hub dataset {repo_id}: {exc}") from None
    if listing is not None:
        files = listing
    elif where is not None:
        files = list(_files(where))
    else:
        raise HubError(f"{field}: hub {repo_type} {repo_id}: no file listing and no local copy to list")
    return (*MODEL_FILES, *_weights(files, repo_id, field, convert_bin))


def _matches(name: str, patterns: tuple[str, ...] | None) -> bool:
    from fnmatch import fnmatch

    return patterns is None or any(fnmatch(name, p) for p in patterns)


def _matched_size(files: dict[str, int], patterns: tuple[str, ...] | None) -> int:
    return sum(size for name, size in files.items() if _matches(name, patterns))


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"


def local_dir(value: str, repo_type: str = "model") -> str:
    """Where a reader finds input `value`: itself when it is a local path, else its snapshot directory in the cache
    (a lookup, no network: preflight fetched it)."""
    ref = hub_ref(value)
    if ref is None:
        return value
    return _cached(ref[0], repo_type, ref[1], value)
