"""DeepSpeed's JIT-compiled CPU ops: build them at set-up, and never hang on a stale build lock.

Why: DeepSpeed's wheel ships its C++ ops uncompiled. On CPU every new process JIT-builds (or
loads) `deepspeed_shm_comm` inside `deepspeed.init_distributed` (and `cpu_adam` for optimizer
offload) through torch's `cpp_extension.load`, which serialises builds with a `FileBaton`: it
creates `<TORCH_EXTENSIONS_DIR>/<py>_cpu/<op>/lock` with O_EXCL and waits, polling without a
timeout, until that file is gone. A process killed mid-build leaves the file behind and every
later run waits forever without a word.

Detection: the baton keeps the lock file open (`FileBaton.fd`) from creation until release, so
a live builder on this machine shows up as an open descriptor in /proc/<pid>/fd. A lock that no
readable process holds open, and that stays so over a short re-check, is stale. It is not removed
automatically: the cache can be shared with another machine (a network home) whose builder this
one cannot see, so the error names the file and says when deleting it is safe.

`python -m llmtrain.parallel.ops --build` compiles the ops once (launch/setup.sh runs it), so
runs and tests never build concurrently; `--check` only looks for stale locks.
This module and engine.py are the only ones that import DeepSpeed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# op builder class -> torch extension name (the directory under TORCH_EXTENSIONS_DIR)
CPU_OPS = {"ShareMemCommBuilder": "deepspeed_shm_comm", "CPUAdamBuilder": "cpu_adam"}
RECHECK_S = 2.0  # FileBaton.release closes the descriptor just before removing the file


class StaleLockError(RuntimeError):
    """A JIT build lock that no live process holds; the message names the file to delete."""


def extensions_root() -> Path:
    """torch's build root (the rule of torch.utils.cpp_extension._get_build_directory, which
    also creates directories): TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/<py>_<acc>."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env is not None:
        return Path(env)
    if torch.version.hip is not None:
        acc = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        acc = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        acc = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{acc}"


def lock_files(names: tuple[str, ...] = tuple(CPU_OPS.values())) -> list[Path]:
    root = extensions_root()
    return [root / n / "lock" for n in names if (root / n / "lock").exists()]


def holders(lock: Path) -> list[int]:
    """PIDs of processes on this machine that hold `lock` open (those /proc lets us read)."""
    try:
        st = lock.stat()
    except FileNotFoundError:
        return []
    found = []
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            for fd in (pid_dir / "fd").iterdir():
                try:
                    s = fd.stat()
                except OSError:
                    continue
                if (s.st_ino, s.st_dev) == (st.st_ino, st.st_dev):
                    found.append(int(pid_dir.name))
                    break
        except OSError:  # gone, or another user's process
            continue
    return found


def is_stale(lock: Path, recheck_s: float | None = None) -> bool:
    """True when the lock exists and no process here holds it, twice `recheck_s` apart."""
    recheck_s = RECHECK_S if recheck_s is None else recheck_s
    if not Path("/proc/self/fd").is_dir():  # no /proc: cannot tell, never call it stale
        return False
    for attempt in range(2):
        if not lock.exists() or holders(lock):
            return False
        if attempt == 0:
            time.sleep(recheck_s)
    return lock.exists()


def check_jit_locks(recheck_s: float | None = None) -> None:
    """Raise StaleLockError naming the first stale DeepSpeed JIT lock (CPU runs only)."""
    import torch

    if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "") != "cpu":
        return  # CUDA runs do not JIT-build the CPU comm op at start-up
    for lock in lock_files():
        if is_stale(lock, recheck_s):
            age = time.time() - lock.stat().st_mtime
            raise StaleLockError(
                f"stale DeepSpeed build lock {lock} (left {age:.0f} s ago by a killed build; no "
                f"process here holds it): every run would wait on it forever. Delete it "
                f"(rm {lock}) unless another machine sharing this cache is building right now"
            )


def _meminfo_gib(key: str) -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


class OpBuildError(RuntimeError):
    """A DeepSpeed CPU op failed to compile, twice; the message says what to look at."""

    def __init__(self, ext: str, cause: BaseException):
        avail, shmem = _meminfo_gib("MemAvailable"), _meminfo_gib("Shmem")
        mem = f"; {avail:.1f} GiB of RAM available" if avail is not None else ""
        shm = (f", {shmem:.1f} GiB held by shared memory (/dev/shm: `python -m "
               f"llmtrain.parallel.ops --clean-shm` frees DeepSpeed workspaces no run uses)"
               if shmem is not None and shmem > 1 else "")  # fmt: skip
        super().__init__(
            f"compiling DeepSpeed's {ext} op failed ({str(cause).splitlines()[0][:200]}){mem}{shm}."
            f" The compiler needs about 2 GiB; for its full output rerun "
            f"`LLMTRAIN_DEBUG=1 python -m llmtrain.parallel.ops --build`"
        )


def stale_shm_workspaces(min_age_s: float = 60.0) -> list[Path]:
    """DeepSpeed CPU all-reduce workspaces in /dev/shm (this user's) that no process here maps:
    left by runs of DeepSpeed before `engine.release_shm_names`, or killed during start-up.
    Each holds 64 MiB of RAM until removed. Only those older than `min_age_s`: a rank starting
    now creates its workspace before it maps it, and its peers wait for the name forever if it
    goes in between."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not Path("/proc/self/maps").exists():
        return []
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_"
    now = time.time()
    found = []
    for p in sorted(shm.glob(prefix + "*")):
        try:
            if p.is_file() and now - p.stat().st_mtime >= min_age_s:
                found.append(p)
        except FileNotFoundError:  # removed since the listing
            continue
    if not found:
        return []
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(None, 5)[-1].strip() for line in maps.read_text().splitlines()
                          if "/dev/shm/" in line)  # fmt: skip
        except OSError:  # gone, or another user's process
            continue
    return [p for p in found if str(p) not in mapped]


def build(names: list[str] | None = None) -> list[str]:
    """Compile (or load, when cached) DeepSpeed's CPU ops; returns the ones ready. On a CUDA
    machine (unless DS_ACCELERATOR=cpu) there is nothing to do: no CPU op is built at start-up."""
    import torch

    if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "") != "cpu":
        return []
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    check_jit_locks()
    done = []
    for cls, ext in CPU_OPS.items():
        if names and ext not in names:
            continue
        builder = get_accelerator().create_op_builder(cls)
        if builder is None or not builder.is_compatible(verbose=False):
            logger.warning("DeepSpeed op %s is not available on this machine; skipped", ext)
            continue
        t0 = time.perf_counter()
        try:
            builder.load(verbose=False)
        except Exception as e:  # most often the compiler killed for memory (cc1plus, -O3)
            if os.environ.get("MAX_JOBS") == "1":
                raise OpBuildError(ext, e) from e
            logger.warning("building %s failed (%s); retrying with one compiler job", ext, e)
            os.environ["MAX_JOBS"] = "1"  # torch's cpp_extension passes it to ninja -j
            try:
                builder.load(verbose=False)
            except Exception as e2:
                raise OpBuildError(ext, e2) from e2
        logger.info("DeepSpeed op %s ready in %.1f s", ext, time.perf_counter() - t0)
        done.append(ext)
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmtrain.parallel.ops", description=__doc__)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--build", action="store_true", help="compile DeepSpeed's CPU ops now")
    g.add_argument("--check", action="store_true", help="fail on a stale JIT build lock")
    g.add_argument("--clean-shm", action="store_true",
                   help="remove DeepSpeed shared-memory workspaces no process maps")  # fmt: skip
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.clean_shm:
            stale = stale_shm_workspaces()
            for path in stale:
                path.unlink(missing_ok=True)
            print(f"removed {len(stale)} stale DeepSpeed shm workspace(s) from /dev/shm")
        elif args.build:
            print("DeepSpeed CPU ops ready:", ", ".join(build()) or "none needed")
        else:
            check_jit_locks()
            print("no stale DeepSpeed build lock")
    except (StaleLockError, OpBuildError) as e:
        if os.environ.get("LLMTRAIN_DEBUG"):
            raise
        sys.stderr.write(f"llmtrain ops: error: {e}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
