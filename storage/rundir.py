"""The run directory: where every stage writes, what each finished stage produced, and who holds it.

Resume never trusts a database: a stage counts as done only when its record (key + output digests)
is on disk *and* its outputs still match those digests, or were deliberately released once every
consumer had finished with them.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from storage.activations import ROOT as ACTS
from storage.activations import ActivationStore
from storage.atomic import digest, read_json, remove, write_json
from storage.checkpoint import MODEL_CARD

Record = dict[str, Any]
CONFIG_NAME = "run.yaml"  # the resolved config the run directory belongs to (featcal/config_diff.py)
SPARE = "spare"  # released files kept for later outputs to be written over (RunDir.claim_spare)


class RunDirError(RuntimeError):
    """The run directory cannot be used: held by another run, or not writable."""


class RunDirLocked(RunDirError):
    pass



class MissingOutput(RuntimeError):
    """A stage's input is gone (released or corrupted): the stage that produced it must run again."""

    def __init__(self, producers: list[str], paths: list[str]):
        super().__init__(f"inputs {paths} are no longer on disk; their producers {producers} must run again")
        self.producers = producers
        self.paths = paths


def _in_store(rel: str) -> bool:
    return rel.partition("/")[0] == ACTS


def _safe(stage: str) -> str:
    return stage.replace("/", "__")


class RunDir:
    """Outputs are named relative to the run directory; those under `acts/` live in the activation store
    (by default the run directory's own `acts/`, or an fsspec URL: storage/activations.py)."""

    def __init__(self, root: str | Path, store: ActivationStore | None = None):
        self.root = Path(root).resolve()
        self.store = store if store is not None else ActivationStore.of_run(self.root, None)

    def __truediv__(self, rel: str) -> Path:
        return self.root / rel

    # ---- layout (docs/design.md §3) -------------------------------------------------------------
    @staticmethod
    def acts(task: str, layer: int, side: str) -> str:
        return f"acts/{task}/l{layer:02d}/{side}"

    @staticmethod
    def encoder_output(task: str, side: str) -> str:
        """An encoder–decoder's encoder output for one stream, read by every decoder block."""
        return f"acts/{task}/encoder/{side}"

    @staticmethod
    def inputs(task: str) -> str:
        return f"acts/{task}/inputs"

    @staticmethod
    def stats(task: str, layer: int) -> str:
        return f"stats/l{layer:02d}/{task}.safetensors"

    @staticmethod
    def block(layer: int, group: int = 0, groups: int = 1) -> str:
        """One solve stage's share of block `layer`: the whole block, or group `group` of `groups`."""
        return f"blocks/l{layer:02d}.safetensors" if groups == 1 else f"blocks/l{layer:02d}.g{group}.safetensors"

    # ---- lock ------------------------------------------------------------------------------
    @contextmanager
    def lock(self) -> Iterator[None]:
        """One run per directory: a second one is refused with who holds it (released even on kill -9)."""
        path = self.root / ".lock"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fh = open(path, "a+")
        except OSError as exc:
            raise RunDirError(f"run directory {self.root} is not writable: {exc.strerror} ({exc.filename})") from None
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            raise RunDirLocked(f"run directory {self.root} is in use by {holder}; "
                               "wait for it or use another --run-dir") from None
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
            fh.flush()
        except OSError as exc:
            fh.close()
            raise RunDirError(f"run directory {self.root} is not writable: {exc.strerror} ({path})") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
            fh.close()

    def check_usable(self) -> None:
        """Refuse a busy or unwritable run directory in a second, creating nothing: `featcal run` asks this
        before Prefect starts or any input is read; the run itself then holds the lock throughout."""
        if self.root.exists():
            with self.lock():
                return
        parent = self.root.parent
        while not parent.exists():
            parent = parent.parent
        if not os.access(parent, os.W_OK | os.X_OK):
            raise RunDirError(f"run directory {self.root} cannot be created: {parent} is not writable")

    # ---- records -----------------------------------------------------------------------------
    def _record_path(self, stage: str) -> Path:
        return self.root / "records" / f"{_safe(stage)}.json"

    def _release_path(self, rel: str) -> Path:
        return self.root / "records" / "released" / f"{_safe(rel)}.json"

    def record(self, stage: str) -> Record | None:
        path = self._record_path(stage)
        if not path.is_file():
            return None
        try:
            return read_json(path)
        except (json.JSONDecodeError, OSError):
            return None

    def save_record(self, record: Record) -> None:
        write_json(self._record_path(record["stage"]), record)

    def invalidate(self, stage: str) -> None:
        remove(self._record_path(stage))

    def output_ok(self, rel: str, expected: str) -> bool:
        released = self._release_path(rel)
        if released.is_file() and read_json(released).get("digest") == expected:
            return True
        return self.exists(rel) and self.digest(rel) == expected

    def exists(self, rel: str) -> bool:
        return self.store.exists(self.store.location(rel)) if _in_store(rel) else (self.root / rel).exists()

    def digest(self, rel: str) -> str:
        if _in_store(rel):
            return self.store.digest(self.store.location(rel))
        return digest(self.root / rel, skip=(MODEL_CARD,))  # the card is rewritten after the run: no digest covers it

    def verified(self, stage: str, key: str) -> Record | None:
        """The stage's record if it was made under `key` and every output is intact (or released)."""
        rec = self.record(stage)
        if rec is None or rec.get("key") != key:
            return None
        if all(self.output_ok(rel, d) for rel, d in rec["outputs"].items()):
            return rec
        return None

    def release(self, rel: str, expected: str, reuse: bool = False) -> None:
        """Delete an intermediate nobody needs any more, leaving a marker that it existed with this digest. With
        `reuse`, a plain file is kept as a spare instead (`claim_spare`), for a later output of its size to be written
        over in place."""
        write_json(self._release_path(rel), {"digest": expected, "at": time.time()})
        self._delete(rel, reuse)

    def claim_spare(self, into: Path) -> bool:
        """Move a released file kept as a spare to `into` (a fresh temporary name), if one is left: written over in
        place, its pages are already in the page cache and its blocks on disk. A new file's pages are not: where the
        page cache is full (model shards), each new page first evicts one, and a Llama-3.2-3B block's statistics (0.82
        GiB a task) took 1.5–1.9 s of system time to write afresh against 0.1 s over a spare. Claims are renames, so
        stages that run at once never share one."""
        for spare in sorted((self.root / SPARE).glob("*")):
            try:
                os.replace(spare, into)
            except FileNotFoundError:  # claimed by another stage first
                continue
            return True
        return False

    def drop_spares(self) -> None:
        """Delete the spares left: no later stage will write over them."""
        remove(self.root / SPARE)

    def stage_records(self) -> dict[str, Record]:
        """Every stage's record on disk, by stage name (other files under records/ are not records)."""
        found = (self.record(path.stem.replace("__", "/")) for path in sorted((self.root / "records").glob("*.json")))
        return {rec["stage"]: rec for rec in found if rec and "key" in rec}

    def drop_stages_except(self, keep: set[str]) -> list[str]:
        """Delete the records of stages not in `keep`, and the outputs (or release markers) only they made: what
        a run of another config left behind. Returns the stages dropped."""
        records = self.stage_records()
        kept = {rel for stage, rec in records.items() if stage in keep for rel in rec["outputs"]}
        dropped = sorted(set(records) - keep)
        for stage in dropped:
            self.invalidate(stage)  # first: a record never outlives its outputs
            for rel in records[stage]["outputs"]:
                if rel not in kept:
                    remove(self._release_path(rel))
                    self._delete(rel)
        return dropped

    def _delete(self, rel: str, reuse: bool = False) -> None:
        """Remove an output (or keep a plain file as a spare, with `reuse`) and the directories it leaves empty."""
        if _in_store(rel):
            self.store.remove(self.store.location(rel))
            if not self.store.local:
                return  # an object store has no empty directories to tidy
            path, top = Path(self.store.location(rel)), Path(self.store.root)
        else:
            path, top = self.root / rel, self.root
            if reuse and path.is_file():
                (self.root / SPARE).mkdir(exist_ok=True)
                os.replace(path, self.root / SPARE / _safe(rel))
            else:
                remove(path)
        parent = path.parent
        while parent != top and top in parent.parents and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent

    def require(self, needs: dict[str, str]) -> None:
        """Check inputs {rel: producer stage} exist before a stage reads them (their digests were
        checked when the producer's record was verified)."""
        gone = {rel: prod for rel, prod in needs.items() if not self.exists(rel)}
        if gone:
            for rel in gone:
                remove(self._release_path(rel))
            raise MissingOutput(sorted(set(gone.values())), sorted(gone))

    # ---- events (what actually ran, for progress and for tests of resume) --------------------
    def event(self, stage: str, what: str, **info: Any) -> None:
        line = json.dumps({"t": time.time(), "pid": os.getpid(), "stage": stage, "event": what, **info})
        (self.root / "records").mkdir(parents=True, exist_ok=True)
        with open(self.root / "records" / "events.jsonl", "a") as fh:
            fh.write(line + "\n")

    def events(self) -> list[dict[str, Any]]:
        path = self.root / "records" / "events.jsonl"
        if not path.is_file():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a kill is not an event
        return out
