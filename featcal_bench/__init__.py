"""The benchmarks: recipes (featcal_bench/recipe.py) registered once, built and run by one generic machinery
(stages.py, method.py), one folder per built-in recipe. This package sits above flows/: it may import flows, tasks,
featcal and storage; none of them imports it."""
