"""tests/gpu: run by launch/gpu_check.sh on a CUDA machine; collected and skipped elsewhere."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (launch/gpu_check.sh runs these)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_cache(tmp_path_factory):
    """Prepared data shared by the GPU tests (LLMTRAIN_CACHE when the check script sets it)."""
    import os

    return os.environ.get("LLMTRAIN_CACHE") or str(tmp_path_factory.mktemp("cache"))
