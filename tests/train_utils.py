"""Run `llmtrain train` in subprocesses (one process, or 2 ranks under the deepspeed launcher)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra) -> dict:
    e = dict(os.environ)
    e.update(
        DS_ACCELERATOR="cpu",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    e.pop("WORLD_SIZE", None)
    e.update(extra)
    return e


def train_cmd(
    run_dir: Path, nproc: int, overrides: list[str], config: str = "configs/debug.yaml"
) -> list[str]:
    args = [config, "--run-dir", str(run_dir), *overrides]
    if nproc == 1:
        return [str(VENV_BIN / "llmtrain"), "train", *args]
    return [str(VENV_BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()),
            "--module", "llmtrain.train", *args]  # fmt: skip


def run_train(run_dir: Path, nproc: int = 1, overrides=(), check: bool = True, **env_extra):
    p = subprocess.run(
        train_cmd(run_dir, nproc, list(overrides)), cwd=ROOT, env=env(**env_extra),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if check and p.returncode != 0:
        raise AssertionError(
            f"training failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
        )
    return p


def in_stop_on_signal(*body: str) -> subprocess.CompletedProcess:
    """Run `body` (lines) inside a fresh process's StopOnSignal `stop` (no launcher watch, a
    second signal forces at once), then print `stop.received`."""
    code = "\n".join([
        "import signal, time", "from llmtrain.train import signals as s", "s.FORCE_AFTER_S = 0.0",
        "with s.StopOnSignal(watch_launcher=False) as stop:", *("    " + b for b in body),
        "print('received', stop.received)",
    ])  # fmt: skip
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def _not_json(name: str):
    raise ValueError(f"metrics.jsonl holds {name}, which is not JSON")


def metrics(run_dir: Path) -> list[dict]:
    """The records, parsed strictly: a NaN or Infinity written bare fails the test."""
    text = (run_dir / "metrics.jsonl").read_text()
    return [json.loads(l, parse_constant=_not_json) for l in text.splitlines() if l]


def kill_when_step(run_dir: Path, nproc: int, overrides, step: int) -> None:
    """Start a run and SIGKILL its whole process group once metrics reach `step`."""
    p = subprocess.Popen(
        train_cmd(run_dir, nproc, list(overrides)), cwd=ROOT, env=env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            f = run_dir / "metrics.jsonl"
            if f.exists() and len(f.read_text().splitlines()) >= step:
                break
            if p.poll() is not None:
                raise AssertionError("run ended before it could be killed")
            time.sleep(0.05)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def run_then_exit(rank: int, fn, *args) -> None:
    """A spawned worker that leaves with os._exit(0) after `fn` succeeds: C++ destructors of
    gloo / DeepSpeed threads occasionally abort a finished process at interpreter exit."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
