"""A run directory belongs to one config: what differs between the config it holds and the one asked for.

Compared is what the stages compute: every section, less the `runtime` fields that only say where and how fast
a run goes. `runtime.precision` and `runtime.solve_precision` are in stage keys (flows/pipeline.py) and count."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from featcal.config import ConfigError, RunConfig
from featcal.hub import hub_ref
from featcal.secrets import NAME_MAPS
from storage.rundir import CONFIG_NAME

# runtime fields no stage key holds: they may change between runs into one directory.
RUN_ONLY = frozenset({"keep_activations", "threads", "activation_store", "storage_options", "solve_groups", "device",
                      "keep_freed_memory"})
SHOWN = 3  # changes the refusal names; the rest it counts
WIDTH = 40  # characters of a value shown
_WAYS = "use a new --run-dir, or --reuse to recompute what changed and drop what no longer belongs"
_UNSET = object()


class ConfigChanged(ConfigError):
    """The run directory holds a run of another config: one line naming what changed and what to do."""


def computed(dumped: dict[str, Any]) -> dict[str, Any]:
    """A dumped config less the runtime fields no stage depends on."""
    runtime = {k: v for k, v in (dumped.get("runtime") or {}).items() if k not in RUN_ONLY}
    return {**dumped, "runtime": runtime}


def _shown(value: Any) -> str:
    if value is _UNSET:
        return "unset"
    text = value if isinstance(value, str) else json.dumps(value, separators=(", ", ": "), default=str)
    if len(text) <= WIDTH:
        return text
    return "…" + text[-WIDTH:] if isinstance(value, str) else text[:WIDTH] + "…"  # a path's end says most


def _differences(old: Any, new: Any, path: tuple[str, ...], tasks: set[str]) -> list[str]:
    """`field old → new` per differing leaf; the entries of added or dropped `tasks` are left to the tasks line."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        same = old == new or _pinned_from(old, new)
        return [] if same else [f"{'.'.join(path)} {_shown(old)} → {_shown(new)}"]
    skip = tasks if path in NAME_MAPS else set()
    keys = [*new, *(k for k in old if k not in new)]
    return [line for k in keys if k not in skip
            for line in _differences(old.get(k, _UNSET), new.get(k, _UNSET), (*path, k), tasks)]


def _pinned_from(old: Any, new: Any) -> bool:
    """Whether `old` is hub id `new` as run.yaml records it, pinned to the commit preflight resolved: the same input,
    as a local path is the same input when its files change (a newer commit reruns the stages that read it)."""
    if not (isinstance(old, str) and isinstance(new, str)):
        return False
    ref = hub_ref(new)
    return (ref is not None and ref[1] is None and old.startswith(f"{new}@")
            and hub_ref(old) == (new, old[len(new) + 1:]))


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What changed from config `old` to `new` (both dumped) in what the stages compute, tasks first."""
    before, after = set(old.get("experts") or {}), set(new.get("experts") or {})
    dropped, added = sorted(before - after), sorted(after - before)
    lines = ([f"tasks: dropped {', '.join(dropped)}"] if dropped else []) + \
            ([f"tasks: added {', '.join(added)}"] if added else [])
    return lines + _differences(computed(old), computed(new), (), {*dropped, *added})


def stored_config(run_dir: Path) -> dict[str, Any] | None:
    """The config a run directory holds, dumped with this version's defaults (None: no run there yet)."""
    path = run_dir / CONFIG_NAME
    if not path.is_file():
        return None
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigChanged(f"{path} is not a readable config ({getattr(exc, 'problem', None) or exc}); "
                            f"{_WAYS}") from None
    if not isinstance(raw, dict):
        raise ConfigChanged(f"{path} is not a config (it holds {type(raw).__name__}); {_WAYS}")
    try:  # run.yaml holds credentials as placeholders: dumped as they are, no restoring needed
        return RunConfig.model_validate(raw).model_dump(mode="json", by_alias=True)
    except ValidationError:
        return raw  # written by a version with other fields: compared as written



def check_same_config(cfg: RunConfig, run_dir: str | Path) -> None:
    """Refuse to run `cfg` where a run of another config lives, naming what changed; reads, never writes."""
    root = Path(run_dir).resolve()
    old = stored_config(root)
    changes = [] if old is None else config_changes(old, cfg.redacted())
    if changes:
        more = f" and {len(changes) - SHOWN} more" if len(changes) > SHOWN else ""
        raise ConfigChanged(f"run directory {root} holds a run of another config ({', '.join(changes[:SHOWN])}"
                            f"{more}); {_WAYS}")
