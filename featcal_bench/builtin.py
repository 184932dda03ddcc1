"""The recipes themselves, loaded from the catalog (featcal_bench/catalog.py: every recipe we ship, in the order
`featcal bench list` shows them, and the one that builds a user's recipe file); and the look-ups by name, preset and
built directory. Adding a built-in benchmark is one folder (featcal_bench/NAME/, its recipe.py defining RECIPE) and
one entry in the catalog (docs/adding-a-benchmark.md).

It sits at the top of featcal_bench: it imports every recipe (by the module its catalog entry names, when first asked
for), and only the generic machinery that runs any recipe (stages.py, method.py, cli.py) imports it."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from pathlib import Path

from featcal_bench.catalog import CATALOG, Entry
from featcal_bench.recipe import Recipe


def loaded(listed: Entry) -> Recipe:
    """The recipe a catalog entry names, imported now: a listing never gets here."""
    recipe = importlib.import_module(listed.module).RECIPE
    if recipe.entry is not listed:
        raise ValueError(f"{listed.module}.RECIPE is recipe {recipe.name!r}, not {listed.name!r} as "
                         "featcal_bench/catalog.py says")
    return recipe


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
    """Every recipe, in the order the catalog lists them."""
    return registry([loaded(listed) for listed in CATALOG])


def recipe_for(preset: str) -> Recipe:
    """The recipe whose presets include `preset`."""
    for listed in CATALOG:
        if preset in listed.presets:
            return loaded(listed)  # that recipe's code alone: `bench build NAME` imports no other
    known = [p for listed in CATALOG for p in listed.presets]
    raise ValueError(f"unknown benchmark {preset!r}; known: {sorted(known)} (or --recipe FILE.yaml)")


def recipe_of(bench: str | Path) -> Recipe:
    """The recipe that built directory `bench`, told by the spec file it holds."""
    for recipe in recipes().values():
        if recipe.spec.is_built(bench):
            return recipe
    files = sorted({r.spec.SPEC_FILE for r in recipes().values()})
    raise FileNotFoundError(f"{bench}: no benchmark spec ({', '.join(files)}): build it first (featcal bench build "
                            f"... --out {bench})")
