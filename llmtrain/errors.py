"""One base for every error a user can act on.

Every exception type llmtrain raises on purpose (bad config, data, checkpoint, export, scaling
input, hostfile) subclasses `LlmtrainError`, so the console script turns them into one line
(`llmtrain CMD: error: ...`, exit 2) and Python callers can catch them all with one `except`.
The concrete types stay in the modules that raise them (``llmtrain.config.ConfigError`` ...) and
keep their historical second base (ValueError / RuntimeError) so old ``except`` clauses still
match. This module imports nothing heavy: the CLI loads it before torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class LlmtrainError(Exception):
    """Something the user can fix; the message says what is wrong and what to do.

    `same_on_every_rank`: the ranks agreed on it collectively (a stop at a step boundary, a
    run of non-finite steps), so every rank raises the same message and only rank 0 prints it.
    `same_on_every_node`: made before any process group from what every rank of a node reads
    alike (the config file, the command line), so each node's local rank 0 prints it (another
    node may read other files: its line is not lost).
    """

    same_on_every_rank: bool = False
    same_on_every_node: bool = False


@contextlib.contextmanager
def once_a_node() -> Iterator[None]:
    """Marks an LlmtrainError raised inside as `same_on_every_node`: for the checks made before
    any process group from what a node's ranks read alike (files, command line, WORLD_SIZE)."""
    try:
        yield
    except LlmtrainError as e:
        e.same_on_every_node = True
        raise


class UsageError(LlmtrainError, ValueError):
    """A command-line argument or API argument is out of range (NaN, negative, wrong path)."""


class OutputPathError(LlmtrainError, OSError):
    """An output path cannot be created (a parent is a file, no permission, disk full)."""


def check_finite_positive(name: str, value: float | None, *, allow_zero: bool = False) -> None:
    """Raise UsageError unless `value` is None or a finite number > 0 (>= 0 with allow_zero)."""
    import math

    if value is None:
        return
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        need = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise UsageError(f"{name}={value} is not usable; give {need}")


def ensure_dir(path, what: str = "output directory"):
    """mkdir -p `path`, turning OS failures into one OutputPathError naming the culprit."""
    from pathlib import Path

    p = Path(path)
    for parent in [p, *p.parents]:
        if parent.exists() and not parent.is_dir():
            raise OutputPathError(
                f"cannot create {what} {p}: {parent} is a file, not a directory; "
                "choose another path or remove that file"
            )
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputPathError(
            f"cannot create {what} {p}: {e.strerror or e}; choose a writable path"
        ) from e
    return p


class MissingFileError(LlmtrainError, FileNotFoundError):
    """An input file or directory we need is not there; the message names it and what to give."""


class WeightsMismatchError(LlmtrainError, ValueError):
    """Weights do not fit the model their config describes (missing, extra or mis-shaped)."""
