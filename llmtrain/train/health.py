"""Is a step good, and is what we are about to save sound? Non-finite detection and save guards.

Why a module of its own: the rules are few but easy to get subtly wrong, and both the step loop
and the checkpoint writer need them.

- A step is bad when its loss or its gradient norm is non-finite, *or negative*: DeepSpeed's
  ZeRO-1/2 group-norm helpers report an invalid (inf/NaN) norm as the sentinel -1, and a `None`
  norm means it was not computed, so neither may count as a good step.
- DeepSpeed skips the update of a bad step only while its overflow check is on; bf16 lets users
  turn it off (`bf16.check_grad_overflow=false`), after which ZeRO-1/2 apply NaN gradients and
  every weight turns NaN. That override is refused before the engine is built.
- A checkpoint whose tensors hold non-finite values never becomes `latest`: the writer streams
  every tensor through `SaveGuard`, and the ranks agree on the verdict before the rename.
- A save that fails with an OS error (a full disk, a quota, a vanished mount) leaves the previous
  checkpoint and `latest` as they were, removes its partial `.tmp` directory and stops every
  rank with one line that says so (the writing rank records the error and keeps joining the
  save's collectives, so no rank is left waiting).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")


class SaveError(RuntimeError):
    """A checkpoint was not saved; the message says why and what is kept."""


class NonFiniteCheckpointError(SaveError):
    """The state about to be saved holds NaN or inf values; nothing was saved."""


class SaveFailedError(SaveError):
    """The filesystem refused a checkpoint write; the previous checkpoint is untouched."""


def grad_norm_ok(norm: float | None) -> bool:
    """DeepSpeed's norm of a step whose update was applied: finite and not its -1 sentinel."""
    return norm is not None and math.isfinite(norm) and norm >= 0


def step_ok(loss: float, grad_norm: float | None) -> bool:
    """A step counts as good only with a finite loss and a valid gradient norm."""
    return math.isfinite(loss) and grad_norm_ok(grad_norm)


def check_overflow_guard(ds_config: dict[str, Any]) -> None:
    """Refuse DeepSpeed settings under which a non-finite gradient would be applied."""
    from llmtrain.config import ConfigError

    bf16 = ds_config.get("bf16") or {}
    if bf16.get("enabled") and bf16.get("check_grad_overflow", True) is False:
        raise ConfigError(
            "train.deepspeed.bf16.check_grad_overflow=false makes ZeRO apply non-finite "
            "gradients (every weight turns NaN); remove it so a bad step is skipped"
        )


class SaveGuard:
    """One save's verdict, agreed by all ranks before anything is renamed into place.

    It passes the (stem, name, tensor) stream through, remembering the first non-finite tensor,
    and records the first OS error of the writing rank(s) (`with guard.attempt(): ...`) instead
    of raising mid-stream: a rank that stopped early would leave the others waiting in the
    save's collectives. `agree()` is collective; on a failure every rank removes the partial
    files (rank 0) and raises the same one-line error."""

    def __init__(self, step: int, ckdir: Path, group=None):
        self.step, self.ckdir, self.group = step, ckdir, group
        self.first_bad: str | None = None
        self.error: OSError | None = None

    @property
    def ok(self) -> bool:
        return self.first_bad is None and self.error is None

    def wrap(self, items: Iterator[tuple[str, str, torch.Tensor]]) -> Iterator:
        for stem, name, t in items:
            if self.first_bad is None and t.is_floating_point() and not torch.isfinite(t).all():
                self.first_bad = name
            yield stem, name, t

    @contextlib.contextmanager
    def attempt(self):
        try:
            yield
        except OSError as e:
            if self.error is None:
                self.error = e

    def agree(self) -> None:
        """Collective: return when every rank is fine, else clean up and raise on all ranks."""
        import torch.distributed as dist

        err = (self.error.errno or errno.EIO) if self.error is not None else 0
        flags = torch.tensor([0.0 if self.first_bad is None else 1.0, float(err)])
        rank = 0
        if dist.is_initialized():
            from llmtrain.parallel import comm

            comm.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            rank = dist.get_rank()
        bad, err = bool(flags[0]), int(flags[1])
        if not bad and not err:
            return
        if rank == 0:
            remove_partial(self.ckdir, self.step)
        if err:
            e = self.error
            reason = (e.strerror or str(e)) if e is not None else os.strerror(err)
            where = (e.filename if e is not None else None) or self.ckdir
            raise SaveFailedError(_save_failed(self.step, self.ckdir, reason, where))
        where = f" ({self.first_bad})" if self.first_bad else " (on another rank)"
        raise NonFiniteCheckpointError(
            f"step {self.step}: the state to save holds non-finite values{where}; nothing was "
            f"saved and {self.ckdir / 'latest'} still names the last good checkpoint. Lower "
            "train.lr or check the data, then resume=auto"
        )


def _save_failed(step: int, ckdir: Path, reason: str, where) -> str:
    ptr = ckdir / "latest"
    kept = ptr.read_text().strip() if ptr.is_file() else None
    what = f"the previous checkpoint {kept} (latest) is kept" if kept else "no checkpoint is kept"
    return (
        f"saving the checkpoint of step {step} failed: {reason} ({where}); {what} and the "
        f"partial files were removed. Free space in {ckdir}, then resume=auto"
    )


def remove_partial(ckdir: Path, step: int) -> None:
    """Remove the unfinished `.tmp` outputs of the save of `step` (any format's), and put back
    the earlier step_N that save had moved aside, if it never took its place."""
    for p in ckdir.glob(f"step_{step:08d}*.tmp"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    (ckdir / "latest.tmp").unlink(missing_ok=True)
    final = ckdir / f"step_{step:08d}"
    aside = final.with_name(final.name + ".replaced")
    if aside.is_dir() and not final.exists():
        aside.rename(final)


def guarded_save(save: Callable[[], T], run_dir: Path, step: int) -> T:
    """Run a checkpoint save; an OS error (ENOSPC, EDQUOT, EIO ...) that escapes it is cleaned up
    and reported like SaveGuard's. `latest` is replaced only after a complete checkpoint is
    renamed into place, so an error before that leaves the previous checkpoint and `latest`."""
    from llmtrain.checkpoint.format import CheckpointError

    ckdir = run_dir / "checkpoints"
    try:
        return save()
    except OSError as e:
        remove_partial(ckdir, step)
        raise SaveFailedError(
            _save_failed(step, ckdir, e.strerror or str(e), e.filename or ckdir)
        ) from e
    except CheckpointError as e:  # a writer error that is not an OSError: clean up all the same
        remove_partial(ckdir, step)
        raise SaveFailedError(_save_failed(step, ckdir, str(e), ckdir)) from e
