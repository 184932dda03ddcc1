"""The one place a recipe is registered: the recipes we ship, in the order `featcal bench list` shows them, and the
one that builds a user's recipe file; and the look-ups by name, preset and built directory. Adding a built-in benchmark
is one folder (featcal_bench/NAME/, its recipe.py defining RECIPE) and one line here (docs/adding-a-benchmark.md).

It sits at the top of featcal_bench: it imports every recipe, and only the generic machinery that runs any recipe
(stages.py, method.py, cli.py) imports it."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from featcal_bench import user
from featcal_bench.clip import recipe as clip
from featcal_bench.llm import recipe as mergebench
from featcal_bench.minilm import recipe as minilm
from featcal_bench.recipe import Recipe
from featcal_bench.t5 import recipe as t5
from featcal_bench.tinyllama import recipe as tinyllama

RECIPES = (minilm.RECIPE, tinyllama.RECIPE, clip.RECIPE, t5.RECIPE, mergebench.RECIPE, user.RECIPE)


def registry(listed: Sequence[Recipe]) -> dict[str, Recipe]:
    """`listed` by name; two recipes that claim one name, preset or stage kind are refused."""
    out: dict[str, Recipe] = {}
    claimed: dict[str, str] = {}
    for recipe in listed:
        for claim in [f"recipe {recipe.name}", *(f"preset {p}" for p in recipe.presets),
                      *(f"stage kind {k}" for k in recipe.stages)]:
            if claim in claimed:
                raise ValueError(f"recipe {recipe.name}: {claim} is already {claimed[claim]}'s")
            claimed[claim] = recipe.name
        out[recipe.name] = recipe
    return out


@functools.cache
def recipes() -> dict[str, Recipe]:
    """Every recipe, in the order RECIPES lists them."""
    return registry(RECIPES)


def recipe_for(preset: str) -> Recipe:
    """The recipe whose presets include `preset`."""
    for recipe in recipes().values():
        if preset in recipe.presets:
            return recipe
    known = [p for r in recipes().values() for p in r.presets]
    raise ValueError(f"unknown benchmark {preset!r}; known: {sorted(known)} (or --recipe FILE.yaml)")


def recipe_of(bench: str | Path) -> Recipe:
    """The recipe that built directory `bench`, told by the spec file it holds."""
    for recipe in recipes().values():
        if recipe.spec.is_built(bench):
            return recipe
    files = sorted({r.spec.SPEC_FILE for r in recipes().values()})
    raise FileNotFoundError(f"{bench}: no benchmark spec ({', '.join(files)}): build it first (featcal bench build "
                            f"... --out {bench})")
