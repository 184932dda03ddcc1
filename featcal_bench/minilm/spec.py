"""What a benchmark is: its tasks, split sizes, fine-tune recipe, competence rule and seed."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from featcal_bench.finetune import FineTune
from featcal_bench.minilm.task_data import RECIPES, SplitSizes
from featcal_bench.recipe import SavedSpec

class Competence(BaseModel):
    """A rule every expert must meet on its test split, checked by `bench build` (featcal_bench/minilm/competence.py):
    accuracy at least the majority-class rate + `over_majority`; at least task arithmetic's (at `scaling`, over
    all the benchmark's experts, on the expert's own task) + `over_merge`; and, where `over_probe` is given, at
    least a linear probe's on the frozen base features + `over_probe`. All in accuracy units."""

    model_config = ConfigDict(extra="forbid")

    over_majority: float = Field(0.15, ge=0)
    over_merge: float = Field(0.05, ge=0)
    over_probe: float | None = Field(None, ge=0)
    scaling: float = Field(0.3, gt=0)


class BenchSpec(SavedSpec):
    """A build of a MiniLM benchmark: its tasks, split sizes, fine-tune recipe, competence rule, seed and sources."""

    model_config = ConfigDict(extra="forbid")
    SPEC_FILE = "bench.json"

    name: str
    tasks: list[str]
    test: int = Field(500, ge=1)
    calibration: int = Field(256, ge=1, description="size of the calibration pool per task")
    train_max: int = Field(2000, ge=1)
    validation: int = Field(0, ge=0, description="rows held out of training to choose each expert (finetune.select)")
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

    @model_validator(mode="after")
    def _validation_for_selection(self) -> BenchSpec:
        if self.finetune.select is not None and not self.validation:
            raise ValueError("finetune.select chooses experts on a validation split: set validation > 0")
        if self.competence is not None and self.competence.over_probe is not None and not self.validation:
            raise ValueError("competence.over_probe: the probe's regularisation is chosen on a validation split: set validation > 0")
        return self

    @property
    def sizes(self) -> SplitSizes:
        return SplitSizes(self.test, self.calibration, self.train_max, self.validation)
