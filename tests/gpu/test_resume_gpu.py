"""The trainer on one GPU under NCCL (a world of one): bf16, fused AdamW, document masking,
evaluation and checkpoints; killed, then resumed, it continues the uninterrupted run.

NCCL takes only CUDA tensors, so this run is also the strict device check for every
collective the trainer makes (stats, router loads, evaluation, checkpoint gathers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train_utils import ROOT, env, metrics

STEPS = 12
# CUDA kernels are not bitwise deterministic (atomics in index_add_ / attention backward), so
# resumed losses match to a relative 1e-3, not exactly; a resume that lost the optimizer state
# or restarted the schedule is off by far more (the loss moves ~1e-1 per step here).
RTOL = 1e-3


def _over(*extra):  # the data cache comes from LLMTRAIN_CACHE (a data.* key would re-tokenize)
    return [f"train.max_steps={STEPS}", "train.warmup_steps=2",
            "train.sample_tokens=0", "train.eval_every=4", "train.save_every=4",
            "train.tensorboard=false", "train.dtype=bf16", "data.doc_mask=true",
            "parallel.backend=nccl", *extra]  # fmt: skip


def _cmd(run_dir: Path, overrides) -> list[str]:  # no console script needed: python -m
    return [sys.executable, "-m", "llmtrain.cli", "train", "configs/debug.yaml",
            "--run-dir", str(run_dir), *overrides]  # fmt: skip


def _env(cache: str) -> dict:
    return env(
        DS_ACCELERATOR="cuda",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        LLMTRAIN_CACHE=cache,
    )


def _run(run_dir: Path, overrides, cache: str) -> None:
    p = subprocess.run(_cmd(run_dir, overrides), cwd=ROOT, env=_env(cache), capture_output=True,
                       text=True, timeout=400)  # fmt: skip
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}"


def _kill_at(run_dir: Path, overrides, step: int, cache: str) -> str:
    """Start a run, SIGKILL it once `step` steps are logged; returns its output (for failures)."""
    log = run_dir.parent / f"{run_dir.name}.log"
    with log.open("w") as f:
        p = subprocess.Popen(_cmd(run_dir, overrides), cwd=ROOT, env=_env(cache),
                             start_new_session=True, stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.time() + 400
    try:
        while time.time() < deadline and p.poll() is None:
            f = run_dir / "metrics.jsonl"
            if f.exists() and len(f.read_text().splitlines()) >= step:
                break
            time.sleep(0.2)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    return log.read_text(errors="replace")


def test_nccl_world_of_one_save_resume_bf16(gpu_cache, tmp_path):
    pytest.importorskip("deepspeed")
    ref = tmp_path / "ref"
    _run(ref, _over(), gpu_cache)
    run = tmp_path / "run"
    out = _kill_at(run, _over(), 6, gpu_cache)
    assert (run / "checkpoints" / "latest").exists(), out[-5000:]
    _run(run, _over("resume=auto"), gpu_cache)
    a, b = metrics(ref), metrics(run)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= RTOL * abs(x["loss"]), (
            x["step"],
            x["loss"],
            y["loss"],
        )
    assert any("val_loss" in r for r in b)
