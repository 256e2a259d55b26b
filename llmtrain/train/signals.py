"""SIGTERM / SIGINT during training: stop at the next step boundary with a checkpoint.

Why a collective flag: under the deepspeed launcher each rank gets the signal at its own moment
(Ctrl-C reaches every process of the terminal's group; a scheduler's SIGTERM reaches the launcher,
which forwards SIGTERM to every rank). Stopping where each rank happened to be would leave the
others waiting in a collective. Instead the handler only records the signal, and at every step
boundary the ranks all-reduce (max) their flags: all see the same answer at the same step, all
save the same checkpoint and all stop.

The deepspeed launcher SIGKILLs its ranks 30 s after it forwards a signal
(deepspeed/launcher/launch.py, terminate_process_tree), so the checkpoint must be written in
that time. A second signal of the same kind at least 2 s after the first (Ctrl-C pressed
again) exits at once without saving.
"""

from __future__ import annotations

import logging
import signal
import time

import torch

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
FORCE_AFTER_S = 2.0


class StopOnSignal:
    """Context manager: records SIGTERM/SIGINT while active; `agreed()` is the collective check."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.at = 0.0
        self.armed = False
        self._old: dict[int, object] = {}

    def arm(self) -> None:
        """Training has started: from now on a signal is recorded, not acted on at once."""
        self.armed = True

    def _handle(self, signum: int, frame) -> None:
        if not self.armed:  # before the first step there is nothing to save: act as before
            old = self._old.get(signum)
            signal.signal(signum, old if old is not None else signal.SIG_DFL)
            if callable(old):
                old(signum, frame)  # Python's SIGINT handler raises KeyboardInterrupt
            else:
                signal.raise_signal(signum)
            return
        if self.received == signum and time.monotonic() - self.at >= FORCE_AFTER_S:
            signal.signal(signum, signal.SIG_DFL)  # asked twice: give up the checkpoint
            signal.raise_signal(signum)
            return
        if self.received is None:
            self.received, self.at = signum, time.monotonic()

    def __enter__(self) -> StopOnSignal:
        for s in SIGNALS:
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread (e.g. an embedding application): no-op
                pass
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def agreed(self) -> int | None:
        """Collective: the signal number if any rank received one, else None (same on all)."""
        import torch.distributed as dist

        flag = torch.tensor([float(self.received or 0)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            from llmtrain.parallel import comm

            comm.all_reduce(flag, op=dist.ReduceOp.MAX)
        n = int(flag.item())
        return n or None

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name
