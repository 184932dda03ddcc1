"""Pipeline stages: plain functions over a run directory, each wrapped as one Prefect task."""
