"""Evaluate a run's checkpoints as they land, outside the training job (`llmtrain eval --watch`).

Periodic evaluation inside training (`train.eval_tasks`) stops every rank while it runs. This is
the other way: train with it off and point a watcher at the run directory, on another node, GPU or
CPU. Each complete checkpoint is evaluated once, in step order, through the same path as `llmtrain
eval` (export to a temporary Hugging Face directory, stock transformers, the harness), and one JSON
line per checkpoint is appended to `RUN/eval_watch.jsonl` (metrics named as the trainer's
`eval/TASK/METRIC`) and, when tensorboard is installed, written at the checkpoint's step under
`RUN/tensorboard/eval_watch`. It may start before the training job has made the run directory. A
restarted watcher skips the checkpoints already in its file with the same tasks, limit and context
length. A checkpoint that the trainer's `keep_last` deletes before its turn is skipped with a
warning. The watcher returns once it has evaluated the run's last step (`train.max_steps` of the
checkpoint's config), or `until_step`, or after `timeout` seconds without a new checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmtrain.checkpoint.format import is_legacy, is_sharded
from llmtrain.eval import EvalError, flat_metrics, run_eval

logger = logging.getLogger(__name__)

RESULTS_FILE = "eval_watch.jsonl"


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint under RUN/checkpoints, in step order. A save
    in progress (no state.json yet, or its tensors not all written) is not listed."""
    out = []
    for d in (Path(run_dir) / "checkpoints").glob("step_*"):
        state = d / "state.json"
        if d.name.endswith(".tmp"):  # a save in progress: renamed to step_N when complete
            continue
        if not d.is_dir() or not state.is_file() or not (is_sharded(d) or is_legacy(d)):
            continue
        try:
            out.append((int(json.loads(state.read_text())["step"]), d))
        except (OSError, ValueError, KeyError):  # being written or removed right now
            continue
    return sorted(out)


def _last_step(ck: Path) -> int | None:
    from llmtrain.config import load_config

    try:
        return load_config(ck / "config.yaml").train.max_steps
    except Exception:  # a config this version cannot read: rely on until_step / timeout
        return None


def watch(
    run_dir: str | Path,
    tasks: list[str],
    *,
    poll: float = 60.0,
    until_step: int | None = None,
    timeout: float | None = None,
    out: str | Path | None = None,
    on_result: Callable[[dict], None] | None = None,
    **eval_kwargs: Any,
) -> list[dict]:
    """Evaluate each new complete checkpoint of `run_dir` until the run's last step is done;
    returns the rows this call appended, each also passed to `on_result` as it lands (module
    docstring). `eval_kwargs` go to run_eval."""
    run = Path(run_dir)
    if (run / "state.json").is_file() or (run / "config.json").is_file():
        raise EvalError(
            f"{run} is a checkpoint or a Hugging Face directory, not a run directory; --watch "
            "takes the --run-dir of `llmtrain train` (it may not exist yet)"
        )
    results = Path(out) if out else run / RESULTS_FILE
    key = {"tasks": sorted(tasks), "limit": eval_kwargs.get("limit"),
           "max_length": eval_kwargs.get("max_length")}  # fmt: skip
    done = set()
    if results.is_file():
        for line in results.read_text().splitlines():
            row = json.loads(line)
            if {k: row.get(k) for k in key} == key:
                done.add(row["step"])
    tb = _LazyTensorboard(run)
    added: list[dict] = []
    last_new = time.monotonic()
    try:
        while True:
            todo = [(s, d) for s, d in complete_checkpoints(run) if s not in done]
            for step, ck in todo:
                t0 = time.monotonic()
                try:
                    res = run_eval(ck, tasks, **eval_kwargs)
                except Exception as e:
                    time.sleep(2)  # keep_last's rmtree takes a moment: was this one deleted?
                    if (ck / "state.json").is_file():
                        raise
                    logger.warning("step %d was deleted (train.keep_last) before its evaluation "
                                   "finished: skipped (%s)", step, type(e).__name__)  # fmt: skip
                    done.add(step)
                    continue
                metrics = flat_metrics(res)
                row = {"step": step, "checkpoint": ck.name, **key,
                       "seconds": round(time.monotonic() - t0, 1), **metrics}  # fmt: skip
                results.parent.mkdir(parents=True, exist_ok=True)
                with results.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                tb.add(metrics, step)
                logger.info("step %d: %s", step,
                            ", ".join(f"{k.removeprefix('eval/')} {v:.4f}"
                                      for k, v in metrics.items()))  # fmt: skip
                done.add(step)
                added.append(row)
                if on_result is not None:
                    on_result(row)
                last_new = time.monotonic()
            if todo:
                continue  # look again at once: checkpoints may have landed meanwhile
            steps = complete_checkpoints(run)
            final = until_step
            if final is None and steps:
                final = _last_step(steps[-1][1])
            if final is not None and any(s >= final for s in done):
                return added
            if timeout is not None and time.monotonic() - last_new > timeout:
                logger.info("no new checkpoint for %.0f s: stopping", timeout)
                return added
            time.sleep(poll)
    finally:
        tb.close()


class _LazyTensorboard:
    """A SummaryWriter under RUN/tensorboard/eval_watch, made at the first result (the run
    directory may not exist when the watcher starts); none when tensorboard is missing."""

    def __init__(self, run: Path):
        self.run, self.writer, self.missing = run, None, False

    def add(self, metrics: dict[str, float], step: int) -> None:
        if self.writer is None and not self.missing:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.missing = True
                return
            self.writer = SummaryWriter(str(self.run / "tensorboard" / "eval_watch"))
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
