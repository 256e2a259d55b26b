import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"

# 2 threads for in-process tests; under pytest-xdist the workers share the cores (CI: 2 workers,
# 1 thread each). Trainer subprocesses run with OMP_NUM_THREADS=1 (train_utils).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))


@pytest.fixture
def debug_cfg():
    from llmtrain.config import load_config

    return load_config(ROOT / "configs" / "debug.yaml")
