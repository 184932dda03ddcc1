"""`featcal push`: a finished run's calibrated (or merged) checkpoint, with its model card, to the Hugging Face hub.

Only an intact checkpoint goes: the run's manifest must say it finished, and the directory must match the digest
its stage recorded. That digest covers every file in it but the model card, so nothing else (a stray credential
file, an editor's backup) can be in the upload without the push refusing first. The token is huggingface_hub's
own (HF_TOKEN or `hf auth login`); featcal neither reads nor writes it. A card whose `base_model` is not a hub id
(a card written before cards left local paths out, or edited since) is refused: it would publish a path of this
machine.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from featcal.hub import hub_ref
from storage.atomic import read_json
from storage.checkpoint import MODEL_CARD
from storage.rundir import RunDir
from tasks.assemble import CALIBRATED
from tasks.merge import MERGED

STAGE_OF = {CALIBRATED: "assemble", MERGED: "merge"}


class PushRefused(ValueError):
    pass


def checkpoint_to_push(run_dir: str | Path, checkpoint: str = CALIBRATED) -> Path:
    """The run's `checkpoint` directory, once it is known to be finished, intact and carded."""
    run = RunDir(run_dir)
    manifest = run / "manifest.json"
    if not manifest.is_file() or read_json(manifest).get("status") != "complete":
        raise PushRefused(f"{run.root}: not a finished run (manifest.json does not say complete); finish it with "
                          "`featcal run` first")
    record = run.record(STAGE_OF[checkpoint])
    if record is None or not (run / checkpoint).is_dir():
        raise PushRefused(f"{run.root / checkpoint}: missing; rerun `featcal run` to write it")
    if not run.output_ok(checkpoint, record["outputs"][checkpoint]):
        raise PushRefused(f"{run.root / checkpoint}: does not match the checksum its {STAGE_OF[checkpoint]} stage "
                          "recorded (a file was changed, added or removed); rerun `featcal run` to rebuild it")
    card = run / checkpoint / MODEL_CARD
    if not card.is_file():
        raise PushRefused(f"{card}: missing; rerun `featcal run` to write it")
    base_model = card_metadata_of(card).get("base_model")
    if base_model is not None and (not isinstance(base_model, str) or hub_ref(base_model) is None):
        raise PushRefused(f"{card}: base_model {base_model!r} is not a hub id (org/name); a local path is not "
                          "published: rerun `featcal run` to rewrite the card, or set base_model to the hub id")
    return run / checkpoint


def card_metadata_of(card: Path) -> dict[str, object]:
    """The YAML block between the `---` lines at the top of a model card ({} when there is none)."""
    text = card.read_text(encoding="utf-8")
    if not text.startswith("---\n"):
        return {}
    meta = yaml.safe_load(text[4:].split("\n---", 1)[0])
    return meta if isinstance(meta, dict) else {}


def push(run_dir: str | Path, repo_id: str, private: bool = False, checkpoint: str = CALIBRATED) -> str:
    """Create `repo_id` (kept if it exists) and upload the checkpoint to it; returns the commit's URL."""
    from huggingface_hub import HfApi

    folder = checkpoint_to_push(run_dir, checkpoint)
    api = HfApi()
    api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
    commit = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                               commit_message=f"FeatCal {checkpoint} checkpoint")
    return str(commit)
