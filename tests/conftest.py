import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def debug_cfg():
    from llmtrain.config import load_config

    return load_config(ROOT / "configs" / "debug.yaml")
