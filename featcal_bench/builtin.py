"""The one place a recipe is registered: the recipes we ship, in the order `featcal bench list` shows them, and the
one that builds a user's recipe file. Adding a built-in benchmark is one folder (featcal_bench/NAME/, its recipe.py
defining RECIPE) and one line here (docs/adding-a-benchmark.md)."""

from featcal_bench import user
from featcal_bench.clip import recipe as clip
from featcal_bench.llm import recipe as mergebench
from featcal_bench.minilm import recipe as minilm
from featcal_bench.t5 import recipe as t5
from featcal_bench.tinyllama import recipe as tinyllama

RECIPES = (minilm.RECIPE, tinyllama.RECIPE, clip.RECIPE, t5.RECIPE, mergebench.RECIPE, user.RECIPE)
