"""Shared fixtures: one tiny example build per test session."""

import os
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from featcal.config import RunConfig, config_from_dict  # noqa: E402
from featcal.example import example_for_tests  # noqa: E402


@pytest.fixture(scope="session")
def tiny_example(tmp_path_factory) -> Path:
    return example_for_tests(tmp_path_factory)


def example_config(root: Path, arch: str, **sections) -> RunConfig:
    """The example's config for one architecture, with whole sections or single keys replaced."""
    raw = yaml.safe_load((root / arch / "example.yaml").read_text())
    for dotted, value in sections.items():
        node = raw
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return config_from_dict(raw, root / arch)
