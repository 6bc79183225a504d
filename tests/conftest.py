"""Shared test set-up: the examples' small GPT on the path, and GPU tests skipped cleanly without a GPU."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker: gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
