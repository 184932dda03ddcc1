"""The FLAN-T5-base GLUE eight-task benchmark: which hub models and datasets it reads, where a local mirror holds
them, and the sizes of its splits.

The models and data are the ones behind the paper's FLAN-T5 figures (FusionBench's `flan-t5-base_glue` model pool:
the pretrained FLAN-T5-base and one full `T5ForConditionalGeneration` fine-tune per GLUE task). GLUE's test labels
are hidden, so each task is scored on its validation split (mnli: `validation_matched`), as FusionBench does. A local
mirror lays them out under their hub names:

    MODELS/google/flan-t5-base                   the base (config, weights, tokenizer)
    MODELS/tanganke/flan-t5-base_glue-{task}     one fine-tuned T5ForConditionalGeneration per task
    DATA/nyu-mll/glue/{task}                     each task's configuration with `train` and its validation split:
                                                 `load_dataset("nyu-mll/glue", task).save_to_disk(DIR)`
"""

from __future__ import annotations

from dataclasses import dataclass

from featcal_bench.mirror import MirroredSpec

SPEC_FILE = "t5_bench.json"
BASE_MODEL = "google/flan-t5-base"
GLUE = "nyu-mll/glue"


@dataclass(frozen=True)
class GlueTask:
    about: str
    columns: tuple[str, ...]  # the GLUE columns its prompt template reads
    validation: str = "validation"  # the split it is scored on

    def expert(self, task: str) -> str:
        return f"tanganke/flan-t5-base_glue-{task}"


GLUE_TASKS = {
    "cola": GlueTask("CoLA grammatical acceptability", ("sentence",)),
    "mnli": GlueTask("MNLI entailment, neutral or contradiction (matched)", ("premise", "hypothesis"),
                     "validation_matched"),
    "mrpc": GlueTask("MRPC paraphrase", ("sentence1", "sentence2")),
    "qnli": GlueTask("QNLI question answered by the sentence", ("question", "sentence")),
    "qqp": GlueTask("QQP duplicate questions", ("question1", "question2")),
    "rte": GlueTask("RTE entailment", ("sentence1", "sentence2")),
    "sst2": GlueTask("SST-2 sentiment", ("sentence",)),
    "stsb": GlueTask("STS-B similarity score 0–5 (Spearman's ρ)", ("sentence1", "sentence2")),
}


class T5BenchSpec(MirroredSpec):
    """A build of the FLAN-T5 GLUE benchmark: its tasks, split sizes, seed, and where models and data come from (the
    hub when `models_from` / `data_from` are None, else a local mirror laid out as the module docstring says)."""

    SPEC_FILE = SPEC_FILE
    KNOWN_TASKS = tuple(GLUE_TASKS)
    BASE_MODEL = BASE_MODEL

    def expert_id(self, task: str) -> str:
        return GLUE_TASKS[task].expert(task)

    def data_fill(self, task: str) -> str:
        return f"load_dataset('{GLUE}', '{task}').save_to_disk(DIR)"

    def dataset_id(self, task: str) -> tuple[str, str | None]:
        return GLUE, task

    def mirror_data_path(self, task: str) -> str:
        """A mirror holds each task's GLUE configuration in its own directory."""
        return f"{GLUE}/{task}"

T5_PRESETS = {"flan-t5-base-glue8": T5BenchSpec(name="flan-t5-base-glue8", tasks=sorted(GLUE_TASKS))}
