"""Fault injection for tests, switched on by LLMTRAIN_FAULT_* environment variables.

Why in the library: the failures they simulate (a non-finite loss, a non-finite gradient with a
finite loss, a full disk during a save) happen inside the trainer, hours into a run; only a hook
at the exact place shows that the run survives them. Each hook costs one dictionary lookup when
its variable is unset. Steps are numbered as metrics.jsonl and checkpoint names number them,
from 1.

- LLMTRAIN_FAULT_NAN_STEPS=3,5   the loss of these steps is multiplied by NaN
- LLMTRAIN_FAULT_GRAD_STEPS=3    one parameter's gradient becomes NaN on rank 0 (loss stays finite)
- LLMTRAIN_FAULT_ENOSPC_SAVE=4   the checkpoint save of step 4 raises OSError(ENOSPC) midway
- LLMTRAIN_FAULT_KILL_RANK=1@5   rank 1 SIGKILLs itself as step 5 starts (a lost node), so
                                 step 4 is the last one it finished
"""

from __future__ import annotations

import errno
import os
import signal

import torch


def steps(var: str) -> set[int]:
    raw = os.environ.get(var, "")
    return {int(s) for s in raw.split(",") if s.strip()}


def nan_loss_steps() -> set[int]:
    """Steps whose loss is forced non-finite."""
    return steps("LLMTRAIN_FAULT_NAN_STEPS")


class GradFault:
    """Makes one parameter's gradient NaN at chosen steps through a tensor hook, so the loss
    stays finite and only the gradient (hence its norm) is poisoned."""

    def __init__(self, model: torch.nn.Module, rank: int):
        self.steps = steps("LLMTRAIN_FAULT_GRAD_STEPS") if rank == 0 else set()
        self.handle = None
        if self.steps:
            name, p = next((n, p) for n, p in model.named_parameters() if p.requires_grad)
            self.name = name
            self.param = p

    def arm(self, step: int) -> None:
        """Call at the start of each step: installs the hook for a faulty step, removes it else."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if step in self.steps:
            self.handle = self.param.register_hook(lambda g: g * float("nan"))


def maybe_disk_full(step: int, path: os.PathLike | str) -> None:
    """Raise ENOSPC inside the save of `step` when asked to (once some bytes are on disk)."""
    if step in steps("LLMTRAIN_FAULT_ENOSPC_SAVE"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def maybe_kill(rank: int, step: int) -> None:
    """LLMTRAIN_FAULT_KILL_RANK=r@s: rank r dies at once (no cleanup) when step s starts."""
    raw = os.environ.get("LLMTRAIN_FAULT_KILL_RANK", "")
    if raw and raw == f"{rank}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
