"""Reading runs for the fitters: CSV files (column names configurable) and our run directories."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from llmtrain.scaling.fit import Runs
from llmtrain.scaling.laws import ScalingError


def _num(row: dict, col: str, where: str) -> float:
    raw = row.get(col)
    if raw is None or raw == "":
        return math.nan
    try:
        return float(raw)
    except (TypeError, ValueError) as e:
        raise ScalingError(
            f"{where}: column {col!r} holds {raw!r}, not a number; fix or drop that row"
        ) from e


# column names recognised without --n-col/--d-col/--c-col/--loss-col (case and spaces ignored)
ALIASES = {
    "N": ("n", "params", "parameters", "n_params", "num_params", "model_size", "model size"),
    "D": ("d", "tokens", "data", "n_tokens", "num_tokens", "training_tokens", "training tokens"),
    "C": ("c", "flops", "compute", "compute_budget", "training_flop", "training flop",
          "training_flops", "training flops"),
    "loss": ("loss", "final_loss", "val_loss", "validation_loss", "eval_loss"),
}  # fmt: skip


def _pick(cols: list[str], given: str | None, key: str) -> str | None:
    """The column for N / D / C / loss: the one named (exactly), else the first known alias. A
    named column the file lacks is an error: taken as absent, it would be derived from the
    other two (N = C/(6D)) and a misspelt --n-col would pass unnoticed."""
    if given is not None:
        if given not in cols:
            flag = {"N": "n", "D": "d", "C": "c", "loss": "loss"}[key]
            raise ScalingError(f"--{flag}-col {given!r} is not a column of the CSV (columns: "
                               f"{', '.join(cols)})")  # fmt: skip
        return given
    by_norm = {c.strip().lower(): c for c in cols}
    return next((by_norm[a] for a in ALIASES[key] if a in by_norm), None)


def read_csv(
    path: Path,
    n_col: str | None = None,
    d_col: str | None = None,
    c_col: str | None = None,
    loss_col: str | None = None,
    final_col="portion_steps_elapsed",
    k: float = 6.0,
) -> Runs:
    """Columns N and D (or C: then D = C/(k·N); or N missing: N = C/(k·D)) and loss.

    Column names default to the common ones (N/params/parameters, D/tokens/data,
    C/flops/compute, loss/val_loss ...; see ALIASES); name a column to override."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (UnicodeDecodeError, csv.Error) as e:
        raise ScalingError(f"{path} is not a UTF-8 CSV file ({e}); give a CSV of runs") from e
    if not rows:
        raise ScalingError(f"{path} holds no rows; give a CSV with a header and one row per run")
    names = [c for c in rows[0] if c is not None]
    cols = set(names)
    loss_col = _pick(names, loss_col, "loss")
    if loss_col is None:
        raise ScalingError(f"{path}: no loss column (columns: {sorted(cols)}); set --loss-col")
    n_col, d_col, c_col = (_pick(names, n_col, "N"), _pick(names, d_col, "D"),
                           _pick(names, c_col, "C"))  # fmt: skip
    have_n, have_d, have_c = n_col is not None, d_col is not None, c_col is not None
    if sum([have_n, have_d, have_c]) < 2:
        raise ScalingError(f"{path}: need two of the columns parameters (N), tokens (D), "
                           f"compute (C) (columns: {sorted(cols)}); set --n-col/--d-col/--c-col")  # fmt: skip
    N, D, C, L, F = [], [], [], [], []
    for i, row in enumerate(rows, start=2):
        where = f"{path}:{i}"
        n = _num(row, n_col, where) if have_n else math.nan
        d = _num(row, d_col, where) if have_d else math.nan
        c = _num(row, c_col, where) if have_c else math.nan
        with np.errstate(divide="ignore", invalid="ignore"):  # zeros: caught by check_runs
            if not have_d:
                d = float(np.float64(c) / (k * n))
            if not have_n:
                n = float(np.float64(c) / (k * d))
        if not have_c:
            c = k * n * d
        N.append(n), D.append(d), C.append(c), L.append(_num(row, loss_col, where))
        F.append(final_col not in cols or _num(row, final_col, where) >= 1.0)
    return Runs(
        np.array(N),
        np.array(D),
        np.array(C),
        np.array(L),
        np.array(F),
        [f"{path}:{i}" for i in range(2, len(rows) + 2)],
    )


def read_run_dir(path: Path) -> Runs:
    """One training run: every logged step is a point (C = FLOPs/token · tokens so far); the
    last step of the schedule is the finished run, with its validation loss when logged."""
    from llmtrain.accounting import count
    from llmtrain.config import load_config
    from llmtrain.train.metrics import read_records

    cfg_file, met = path / "config.yaml", path / "metrics.jsonl"
    if not cfg_file.is_file() or not met.is_file():
        raise ScalingError(f"{path} is not a run directory (needs config.yaml and metrics.jsonl)")
    cfg = load_config(cfg_file)
    c = count(cfg.model, seq_len=cfg.train.seq_len)
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    recs = read_records(met)
    if not recs:
        raise ScalingError(f"{path}: metrics.jsonl is empty (the run never logged a step)")
    N, D, C, L, F = [], [], [], [], []
    for r in recs:
        d = r["step"] * tokens_per_step
        final = r["step"] == cfg.train.max_steps
        loss = r.get("val_loss", r["loss"]) if final else r["loss"]
        loss = float("nan") if loss is None else loss  # a skipped step's (written null)
        (
            N.append(c.active_params),
            D.append(d),
            C.append(c.flops_per_token * d),
            L.append(loss),
            F.append(final),
        )
    return Runs(np.array(N, float), np.array(D, float), np.array(C, float), np.array(L, float), np.array(F),
                [str(path)] * len(recs))  # fmt: skip


def load_runs(paths: list[str], final_only: bool = False, **cols) -> Runs:
    """CSV files, run directories, or directories of run directories (a sweep), mixed."""
    parts: list[Runs] = []
    for p in map(Path, paths):
        if p.is_file():
            parts.append(read_csv(p, **cols))
        elif (p / "metrics.jsonl").is_file():
            parts.append(read_run_dir(p))
        elif p.is_dir():
            subs = sorted(q for q in p.rglob("metrics.jsonl"))
            if not subs:
                raise ScalingError(f"{p} holds no CSV and no finished run (no metrics.jsonl under "
                                   "it); a planned sweep: run `llmtrain scaling sweep run "
                                   f"{p}` first")  # fmt: skip
            parts.extend(read_run_dir(q.parent) for q in subs)
        else:
            raise ScalingError(f"{p} does not exist")
    r = Runs(*(np.concatenate([getattr(x, f) for x in parts]) for f in ("N", "D", "C", "loss", "final")),
             [name for x in parts for name in x.run])  # fmt: skip
    return r.subset(r.final) if final_only else r
