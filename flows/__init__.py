"""Orchestration: the stage order (pipeline), its Prefect flow, and the `featcal` command line."""
