"""The CLIP ViT-B/32 eight-task benchmark: which hub models and datasets it reads, where a local mirror holds them,
and the sizes of its splits.

The models and data are the ones behind the paper's CLIP figures (FusionBench's `clip-vit-base-patch32_TA8` model
pool: the pretrained CLIP, one head-less `CLIPVisionModel` fine-tuned per task, each task's train and test splits).
A local mirror lays them out under their hub names:

    MODELS/openai/clip-vit-base-patch32              the CLIPModel (config, weights, tokenizer, preprocessor)
    MODELS/tanganke/clip-vit-base-patch32_{expert}   one CLIPVisionModel per task
    DATA/{owner}/{dataset}                           each dataset with `train` and `test` splits: `save_to_disk`,
                                                     or a hub snapshot (`huggingface-cli download --repo-type dataset`)
"""

from __future__ import annotations

from dataclasses import dataclass

from featcal_bench.mirror import MirroredSpec

SPEC_FILE = "clip_bench.json"
BASE_MODEL = "openai/clip-vit-base-patch32"


@dataclass(frozen=True)
class ClipTask:
    expert: str  # hub id of the task's fine-tuned CLIPVisionModel
    dataset: str  # hub id of its data (columns `image` and a ClassLabel `label`)
    about: str
    config: str | None = None  # the dataset's configuration, where it has several


# FusionBench's data sources for these experts: the tanganke copies, SVHN's cropped digits and MNIST from their own
# hub repositories (config/dataset/image_classification/{train,test}/*.yaml).
CLIP_TASKS = {
    "sun397": ClipTask("tanganke/clip-vit-base-patch32_sun397", "tanganke/sun397", "SUN397 scenes (397 classes)"),
    "stanford_cars": ClipTask(
        "tanganke/clip-vit-base-patch32_stanford-cars",
        "tanganke/stanford_cars",
        "Stanford Cars: make, model and year (196)",
    ),
    "resisc45": ClipTask("tanganke/clip-vit-base-patch32_resisc45", "tanganke/resisc45", "RESISC45 aerial scenes (45)"),
    "eurosat": ClipTask(
        "tanganke/clip-vit-base-patch32_eurosat", "tanganke/eurosat", "EuroSAT land use from satellite (10)"
    ),
    "svhn": ClipTask(
        "tanganke/clip-vit-base-patch32_svhn", "ufldl-stanford/svhn", "SVHN house-number digits (10)", "cropped_digits"
    ),
    "gtsrb": ClipTask("tanganke/clip-vit-base-patch32_gtsrb", "tanganke/gtsrb", "GTSRB German traffic signs (43)"),
    "mnist": ClipTask("tanganke/clip-vit-base-patch32_mnist", "ylecun/mnist", "MNIST handwritten digits (10)"),
    "dtd": ClipTask("tanganke/clip-vit-base-patch32_dtd", "tanganke/dtd", "DTD describable textures (47)"),
}


class ClipBenchSpec(MirroredSpec):
    """A build of the CLIP benchmark: its tasks, split sizes, seed, and where models and data come from (the hub
    when `models_from` / `data_from` are None, else a local mirror laid out as the module docstring says)."""

    SPEC_FILE = SPEC_FILE
    KNOWN_TASKS = tuple(CLIP_TASKS)
    BASE_MODEL = BASE_MODEL

    def expert_id(self, task: str) -> str:
        return CLIP_TASKS[task].expert

    def data_fill(self, task: str) -> str:
        return (f"`huggingface-cli download --repo-type dataset {CLIP_TASKS[task].dataset} --local-dir DIR`, or "
                "load_dataset(...).save_to_disk(DIR)")

    def dataset_id(self, task: str) -> tuple[str, str | None]:
        return CLIP_TASKS[task].dataset, CLIP_TASKS[task].config

CLIP_PRESETS = {"clip-vit-b32-ta8": ClipBenchSpec(name="clip-vit-b32-ta8", tasks=sorted(CLIP_TASKS))}
