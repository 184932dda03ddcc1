"""The recipes we ship, in the order `featcal bench list` shows them. Adding a built-in benchmark is one folder
(featcal_bench/NAME/ with its recipe.py registering a Recipe) and one line here (docs/adding-a-benchmark.md)."""

from featcal_bench.minilm import recipe as minilm  # noqa: F401
from featcal_bench.tinyllama import recipe as tinyllama  # noqa: F401
from featcal_bench.clip import recipe as clip  # noqa: F401
from featcal_bench.t5 import recipe as t5  # noqa: F401
from featcal_bench.llm import recipe as mergebench  # noqa: F401
