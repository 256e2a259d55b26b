"""SIGTERM / SIGINT / SIGUSR1 during training (or train.time_limit_minutes, or a RUN/STOP file):
stop at the next step boundary with a checkpoint.

SIGUSR1 is a scheduler's advance warning (SLURM's `--signal=USR1@SECONDS` signals every process
of the job's steps that long before the wall time ends): it is never a reason to exit at once, so
it is recorded even during set-up (the run then stops after its first step) and a second one
changes nothing. Its default action would kill the process and every unsaved step with it.

Why a collective flag: under the deepspeed launcher each rank gets the signal at its own moment
(Ctrl-C reaches every process of the terminal's group; a scheduler that signals the job's
process group reaches every rank). Stopping where each rank happened to be would leave the
others waiting in a collective.

A SIGTERM sent to the `deepspeed` command alone (`kill PID`, a container's PID 1) reaches no
rank: its runner forwards signals only for multi-node pdsh launches (launcher/runner.py, 0.19.8)
and dies, leaving the per-node `deepspeed.launcher.launch` and the ranks running on. So each
rank also watches that chain: when the per-node launcher loses its parent (the runner exited)
or the rank loses its launcher, the rank acts as on SIGTERM. Instead the handler only records the signal, and at every step
boundary the ranks all-reduce (max) their flags: all see the same answer at the same step, all
save the same checkpoint and all stop.

The deepspeed launcher SIGKILLs its ranks 30 s after it forwards a signal
(deepspeed/launcher/launch.py, terminate_process_tree), so the checkpoint must be written in
that time. A second signal of the same kind at least 2 s after the first (Ctrl-C pressed
again) exits at once without saving.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
WARNINGS = (signal.SIGUSR1,)  # stop with a checkpoint, whenever it comes; never force an exit
FORCE_AFTER_S = 2.0
# stops asked for without a signal, agreed on like one (codes above any signal number): the
# save they lead to is not bound by the launcher's 30 s grace, which a large model's may need
TIME_LIMIT, STOP_FILE = 1001, 1002
STOP_FILE_NAME = "STOP"  # RUN/STOP: stop at the next step boundary (removed once taken)


class StopOnSignal:
    """Context manager: records SIGTERM/SIGINT/SIGUSR1 while active; `agreed()` is the collective
    check."""

    def __init__(self, watch_launcher: bool = True) -> None:
        self.received: int | None = None  # what stops the run: a signal, TIME_LIMIT, STOP_FILE
        self.at = 0.0
        self._signalled: int | None = None  # the first signal, for the second to force an exit
        self._signalled_at = 0.0
        # train.time_limit_minutes counts from here (time.time())
        self.started = job_start()
        self.armed = False
        self._old: dict[int, object] = {}
        self._watch = watch_launcher
        self._done = threading.Event()

    def arm(self) -> None:
        """Training has started: from now on a signal is recorded, not acted on at once."""
        self.armed = True

    def _handle(self, signum: int, frame) -> None:
        if signum in WARNINGS:
            if self.received is None:
                self.received, self.at = signum, time.monotonic()
            return
        if not self.armed:  # before the first step there is nothing to save: act as before
            old = self._old.get(signum)
            signal.signal(signum, old if old is not None else signal.SIG_DFL)
            if callable(old):
                old(signum, frame)  # Python's SIGINT handler raises KeyboardInterrupt
            else:
                signal.raise_signal(signum)
            return
        now = time.monotonic()
        if self._signalled == signum and now - self._signalled_at >= FORCE_AFTER_S:
            signal.signal(signum, signal.SIG_DFL)  # asked twice: give up the checkpoint
            signal.raise_signal(signum)
            return
        if self._signalled is None:  # the first signal (a time limit or STOP may be the stop)
            self._signalled, self._signalled_at = signum, now
        if self.received is None:
            self.received, self.at = signum, now

    def __enter__(self) -> StopOnSignal:
        for s in SIGNALS:
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread (e.g. an embedding application): no-op
                pass
        chain = launcher_chain() if self._watch else None
        if chain is not None:
            self._done.clear()
            threading.Thread(target=self._watch_chain, args=chain, daemon=True,
                             name="llmtrain-launcher-watch").start()  # fmt: skip
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def _watch_chain(self, launcher: int, runner: int, poll_s: float = 1.0) -> None:
        while not self._done.wait(poll_s):
            if os.getppid() != launcher or _ppid(launcher) != runner:
                if self.received is None:
                    logger.warning("the deepspeed command exited: stopping at the next step "
                                   "boundary with a checkpoint, as on SIGTERM")  # fmt: skip
                    self.received, self.at = int(signal.SIGTERM), time.monotonic()
                return

    def request(self, code: int) -> None:
        """A stop without a signal (TIME_LIMIT, STOP_FILE), taken at the next `agreed()`."""
        if self.received is None:
            self.received, self.at = code, time.monotonic()

    def check_requests(self, run_dir, limit_minutes: float) -> None:
        """Rank 0 at each step boundary: the time limit passed, or RUN/STOP exists (one stat a
        step; its age is not asked: the file server's clock is not this host's)."""
        if limit_minutes and time.time() - self.started >= limit_minutes * 60:
            self.request(TIME_LIMIT)
        if os.path.exists(os.path.join(run_dir, STOP_FILE_NAME)):
            self.request(STOP_FILE)

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
        if signum == TIME_LIMIT:
            return "train.time_limit_minutes"
        if signum == STOP_FILE:
            return f"RUN/{STOP_FILE_NAME} (removed)"
        return signal.Signals(signum).name


def job_start() -> float:
    """When the job began (time.time()): SLURM's job start (SLURM_JOB_START_TIME), else this
    process's start, so a time limit set from the job's wall time counts its set-up too."""
    try:
        return float(os.environ["SLURM_JOB_START_TIME"])
    except (KeyError, ValueError):
        pass
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # no psutil or no /proc: from now
        return time.time()


def _ppid(pid: int) -> int | None:
    """The parent of `pid` (Linux /proc), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def launcher_chain() -> tuple[int, int] | None:
    """(per-node launcher pid, its parent's pid) when this process runs under DeepSpeed's
    `deepspeed.launcher.launch`; None otherwise (one process, torchrun, no /proc)."""
    launcher = os.getppid()
    try:
        with open(f"/proc/{launcher}/cmdline", "rb") as fh:
            cmd = fh.read()
    except OSError:
        return None
    if b"deepspeed.launcher.launch" not in cmd:
        return None
    runner = _ppid(launcher)
    return None if runner is None or runner <= 1 else (launcher, runner)
