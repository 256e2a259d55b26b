"""Evaluate a run's checkpoints as they land, outside the training job (`llmtrain eval --watch`).

Periodic evaluation inside training (`train.eval_tasks`) stops every rank while it runs. This is
the other way: train with it off and point a watcher at the run directory, on another node, GPU or
CPU. Each complete checkpoint is evaluated once, in step order, through the same path as `llmtrain
eval` (export to a temporary Hugging Face directory, stock transformers, the harness), and one JSON
line per checkpoint is appended to `RUN/eval_watch.jsonl` (metrics named as the trainer's
`eval/TASK/METRIC`) and, when tensorboard is installed, written at the checkpoint's step under
`RUN/tensorboard/eval_watch`. It may start before the training job has made the run directory.

Against the trainer's saves (llmtrain.train.checkpointing: step_N.tmp renamed to step_N when
complete; keep_last's rmtree; a resumed run saving a step again) the watcher evaluates a snapshot:
the checkpoint's files hard-linked under RUN/.eval_watch/ (same filesystem, no copy), which no
later delete or re-save can change. A checkpoint deleted before its snapshot is skipped with a
warning. Rows carry the checkpoint's identity (a hash of its state.json), so a restarted watcher
skips what it scored with the same tasks, limit, context length, dtype and task folders, and a
step saved again with other weights is scored again. One watcher per results file (a lock).

It returns once it has scored the last step the run will save (`train.max_steps`, or the last
multiple of `save_every` with `save_final: false`), or `until_step`; after `timeout` seconds
without a new checkpoint it gives up (`finished` false).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmtrain.checkpoint.format import CheckpointError, complete_checkpoints
from llmtrain.eval import EvalError, check_eval_args, flat_metrics, run_eval
from llmtrain.export import ExportError

logger = logging.getLogger(__name__)

RESULTS_FILE = "eval_watch.jsonl"


@dataclass
class WatchResult:
    rows: list[dict] = field(default_factory=list)  # what this call appended
    finished: bool = False  # the run's last saved step (or until_step) was scored


def last_saved_step(ck: Path, until: int | None = None) -> int | None:
    """The last step the run of checkpoint (or run directory) `ck` will save, from its
    config.yaml: max_steps, or with save_final false the last multiple of save_every; with
    `until`, the last it will save up to that step (0: none). None: unknown."""
    from llmtrain.config import load_config

    try:
        t = load_config(ck / "config.yaml").train
    except Exception:  # a config this version cannot read: rely on until_step / timeout
        return None
    end = t.max_steps if until is None else min(until, t.max_steps)
    if t.save_final and end == t.max_steps:
        return end
    return end - end % t.save_every


def _identity(ck: Path) -> str:
    return hashlib.sha256((ck / "state.json").read_bytes()).hexdigest()[:16]


def _snapshot(ck: Path, into: Path) -> Path | None:
    """Hard links of every file of `ck` under `into`; None if `ck` went away meanwhile; `ck`
    itself where links cannot be made (checkpoints on another filesystem): read in place."""
    snap = Path(tempfile.mkdtemp(prefix=ck.name + "-", dir=into))
    try:
        for root, _, files in os.walk(ck):
            dst = snap / Path(root).relative_to(ck)
            dst.mkdir(exist_ok=True)
            for f in files:
                os.link(Path(root) / f, dst / f)
    except FileNotFoundError:
        shutil.rmtree(snap, ignore_errors=True)
        return None
    except OSError as e:  # EXDEV, EPERM: no snapshot; a delete during the evaluation is caught
        shutil.rmtree(snap, ignore_errors=True)
        logger.warning("cannot hard-link %s (%s): evaluating it in place", ck, e.strerror)
        return ck
    return snap


def _gone_or_changed(ck: Path, ident: str, wait_s: int = 30) -> bool:
    """Whether `ck` was deleted or saved again (keep_last's rmtree may take a while)."""
    for _ in range(wait_s + 1):
        try:
            if _identity(ck) != ident:
                return True
        except OSError:
            return True
        time.sleep(1)
    return False


def _read_rows(results: Path) -> list[dict]:
    rows = []
    if results.is_file():
        for i, line in enumerate(results.read_text().splitlines()):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a crash or a full disk
                logger.warning("%s line %d is not JSON (cut short?): ignored", results, i + 1)
    return rows


def watch(
    run_dir: str | Path,
    tasks: list[str],
    *,
    poll: float = 60.0,
    until_step: int | None = None,
    timeout: float | None = None,
    out: str | Path | None = None,
    on_result: Callable[[dict], None] | None = None,
    evaluate: Callable[[Path], dict] | None = None,
    between_looks: Callable[[], None] | None = None,
    **eval_kwargs: Any,
) -> WatchResult:
    """Score each new complete checkpoint of `run_dir` until the run's last saved step is done
    (module docstring); each appended row is also passed to `on_result` as it lands.
    `eval_kwargs` go to run_eval, or name the scores' settings when `evaluate(checkpoint)`
    scores instead (the sharded watcher's ranks); `between_looks()` runs before each wait."""
    run = Path(run_dir)
    if (run / "state.json").is_file() or (run / "config.json").is_file():
        raise EvalError(
            f"{run} is a checkpoint or a Hugging Face directory, not a run directory; --watch "
            "takes the --run-dir of `llmtrain train` (it may not exist yet)"
        )
    # bad tasks, --limit, --max-length now, not at the first checkpoint hours later
    check_eval_args(list(tasks), eval_kwargs.get("include_path"), eval_kwargs.get("limit"),
                    eval_kwargs.get("max_length"))  # fmt: skip
    results = Path(out) if out else run / RESULTS_FILE
    key = {
        "tasks": sorted(tasks),
        "limit": eval_kwargs.get("limit"),
        "max_length": eval_kwargs.get("max_length"),
        "dtype": eval_kwargs.get("dtype", "float32"),
        "include_path": sorted(
            str(Path(p).resolve()) for p in eval_kwargs.get("include_path") or []
        ),
        # the sharded scorer's a.b=c overrides, in order (train.dtype=bf16 changes the scores)
        "overrides": list(eval_kwargs.get("overrides") or []) or None,
    }
    tb = _LazyTensorboard(run)
    res = WatchResult()
    lock = None
    done: set[tuple[int, str]] = set()
    skipped: set[int] = set()  # steps deleted or saved again before they could be scored
    last_new = time.monotonic()
    work = _work_dir(run, results)  # this results file's snapshots
    try:
        while True:
            if lock is None and run.is_dir():  # one watcher per results file
                lock = _lock(results)
                # a killed watcher's snapshots of this results file (another watcher, with its
                # own --out, keeps its own folder)
                shutil.rmtree(work, ignore_errors=True)
                done = {(r["step"], r.get("checkpoint_id", "")) for r in _read_rows(results)
                        if {k: r.get(k) for k in key} == key}  # fmt: skip
            steps = complete_checkpoints(run)
            # the last step the run saves (up to until_step), from the latest launch's config (a
            # continued run may have raised max_steps), else the newest checkpoint's
            final = last_saved_step(run, until_step)
            if final is None and steps:
                final = last_saved_step(steps[-1][1], until_step)
            if final is None:
                final = until_step  # no readable config: until_step itself
            if final == 0:  # the run saves nothing up to until_step
                res.finished = True
                return res
            todo, current = [], {}
            for s, d in steps:
                if until_step is not None and s > until_step:
                    continue
                try:
                    current[s] = ident = _identity(d)
                except OSError:  # deleted since it was listed
                    continue
                if (s, ident) not in done:
                    todo.append((s, d, ident))
            for step, ck, ident in todo:
                row = _score(run, step, ck, ident, key, work,
                             evaluate or (lambda snap: run_eval(snap, tasks, tasks_checked=True,
                                                                **eval_kwargs)))  # fmt: skip
                done.add((step, ident))
                if row is None:
                    skipped.add(step)
                    continue
                _append(results, row)
                tb.add({k: v for k, v in row.items() if k.startswith("eval/")}, step)
                res.rows.append(row)
                if on_result is not None:
                    on_result(row)
                last_new = time.monotonic()
            # finished: the last step's checkpoint as it is now was scored (rows of another
            # trajectory, before a rollback or a raised max_steps, do not count), or was skipped
            if final is not None and (
                any(s >= final and (s, i) in done for s, i in current.items())
                or any(s >= final and s not in current for s in skipped)  # deleted unscored
            ):
                res.finished = True
                return res
            if todo:
                continue  # look again at once: checkpoints may have landed meanwhile
            if timeout is not None and time.monotonic() - last_new > timeout:
                logger.warning("no new checkpoint for %.0f s%s: stopping", timeout,
                               f" before step {final}" if final is not None else
                               " (the run has not written its config yet)")  # fmt: skip
                return res
            if between_looks is not None:
                between_looks()
            time.sleep(poll)
    finally:
        tb.close()
        if lock is not None:
            lock.close()


def _work_dir(run: Path, results: Path) -> Path:
    """Where the watcher writing `results` keeps its snapshots: one folder per results file."""
    tag = hashlib.sha256(str(Path(results).resolve()).encode()).hexdigest()[:12]
    return run / ".eval_watch" / tag


def _score(run: Path, step: int, ck: Path, ident: str, key: dict, work: Path,
           evaluate: Callable[[Path], dict]):  # fmt: skip
    """One checkpoint's row, evaluated on a hard-linked snapshot in `work` (None: it was deleted
    or saved again first)."""
    try:
        work.mkdir(parents=True, exist_ok=True)
        snap = _snapshot(ck, work)
    except OSError as e:  # a run directory this watcher may read but not write
        logger.warning("cannot make %s (%s): evaluating %s in place", work, e.strerror, ck.name)
        snap = ck
    try:
        if snap is not None and (snap / "state.json").is_file() and _identity(snap) == ident:
            t0 = time.monotonic()
            try:
                res = evaluate(snap)
                return {"step": step, "checkpoint": ck.name, "checkpoint_id": ident, **key,
                        "seconds": round(time.monotonic() - t0, 1), **flat_metrics(res)}  # fmt: skip
            except (OSError, CheckpointError, ExportError):
                # files deleted before they were linked (or, in place, during the evaluation);
                # any other failure (a task, the device, memory) is the evaluation's own: raised
                if not _gone_or_changed(ck, ident):
                    raise
        logger.warning("step %d was deleted or saved again before it could be evaluated "
                       "(train.keep_last, a resumed run): skipped", step)  # fmt: skip
        return None
    finally:
        if snap is not None and snap != ck:
            shutil.rmtree(snap, ignore_errors=True)


def _append(results: Path, row: dict) -> None:
    """One write on an O_APPEND descriptor: a reader never sees half of a row from us."""
    results.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(results, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        # a row cut short by a crash has no newline: start on a line of our own
        cut = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
        os.write(fd, (("\n" if cut else "") + json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)


def _lock(results: Path):
    try:
        results.parent.mkdir(parents=True, exist_ok=True)
        f = open(results.with_name(results.name + ".lock"), "w")  # noqa: SIM115 (held while watching)
    except OSError as e:
        raise EvalError(f"cannot write the results next to {results} ({e.strerror}); give "
                        "--out FILE in a directory this watcher may write") from None  # fmt: skip
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise EvalError(
            f"another watcher is writing {results}; stop it, or give this one --out FILE"
        ) from None
    return f


class _LazyTensorboard:
    """A SummaryWriter under RUN/tensorboard/eval_watch, made at the first result (the run
    directory may not exist when the watcher starts); none when tensorboard is missing."""

    def __init__(self, run: Path):
        self.run, self.writer, self.missing = run, None, False

    def add(self, metrics: dict[str, float], step: int) -> None:
        try:
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
        except OSError as e:  # a run directory this watcher may read but not write
            logger.warning("cannot write TensorBoard events under %s (%s): the results file "
                           "alone gets the scores", self.run, e.strerror)  # fmt: skip
            if self.writer is not None:
                try:
                    self.writer.close()
                except OSError:
                    pass
            self.writer, self.missing = None, True

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
