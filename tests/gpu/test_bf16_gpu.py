"""bf16 vs fp32 through DeepSpeed's engine on one GPU (NCCL world of one): the same harness
and stated tolerances as the CPU test (tests/test_bf16.py)."""

from __future__ import annotations

import json

import pytest

from tests.test_bf16 import EARLY_ATOL, LATE_MEAN_ATOL, _loss_worker, _spawn, _sync_worker


def test_bf16_loss_tracks_fp32_on_gpu(tmp_path):
    pytest.importorskip("deepspeed")
    steps = 30
    for dtype in ("fp32", "bf16"):
        _spawn(_loss_worker, 1, dtype, steps, str(tmp_path), "cuda")
    f32 = json.loads((tmp_path / "fp32.json").read_text())
    b16 = json.loads((tmp_path / "bf16.json").read_text())
    diff = [abs(a - b) for a, b in zip(f32, b16)]
    print("fp32", f32, "\nbf16", b16, "\ndiff", diff)
    assert f32[-1] < f32[0] - 0.5
    assert max(diff[:10]) < EARLY_ATOL, diff
    assert sum(diff[-10:]) / 10 < LATE_MEAN_ATOL, diff


def test_engine_micro_batches_never_synchronise_the_gpu(tmp_path):
    """As tests/test_bf16.py checks on CPU: under NCCL on a GPU, no micro-batch but a step's
    last one calls the accelerator's synchronize (DeepSpeed's throughput timer is off)."""
    pytest.importorskip("deepspeed")
    _spawn(_sync_worker, 1, str(tmp_path), "cuda")
    res = json.loads((tmp_path / "syncs.json").read_text())
    assert res["inside"] == 0, res
