"""Reading runs for the fitters: CSV files (column names configurable) and our run directories."""

from __future__ import annotations

import csv
import json
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
    except ValueError as e:
        raise ScalingError(f"{where}: column {col!r} holds {raw!r}, not a number") from e


def read_csv(
    path: Path,
    n_col="N",
    d_col="D",
    c_col="C",
    loss_col="loss",
    final_col="portion_steps_elapsed",
    k: float = 6.0,
) -> Runs:
    """Columns N and D (or C: then D = C/(k·N); or N missing: N = C/(k·D)) and loss."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ScalingError(f"{path} holds no rows")
    cols = set(rows[0])
    if loss_col not in cols:
        raise ScalingError(
            f"{path}: no loss column {loss_col!r} (columns: {sorted(cols)}); set --loss-col"
        )
    have_n, have_d, have_c = n_col in cols, d_col in cols, c_col in cols
    if sum([have_n, have_d, have_c]) < 2:
        raise ScalingError(f"{path}: need two of the columns N={n_col!r}, D={d_col!r}, C={c_col!r} "
                           f"(columns: {sorted(cols)}); set --n-col/--d-col/--c-col")  # fmt: skip
    N, D, C, L, F = [], [], [], [], []
    for i, row in enumerate(rows, start=2):
        where = f"{path}:{i}"
        n = _num(row, n_col, where) if have_n else math.nan
        d = _num(row, d_col, where) if have_d else math.nan
        c = _num(row, c_col, where) if have_c else math.nan
        if not have_d:
            d = c / (k * n)
        if not have_n:
            n = c / (k * d)
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

    cfg_file, met = path / "config.yaml", path / "metrics.jsonl"
    if not cfg_file.is_file() or not met.is_file():
        raise ScalingError(f"{path} is not a run directory (needs config.yaml and metrics.jsonl)")
    cfg = load_config(cfg_file)
    c = count(cfg.model, seq_len=cfg.train.seq_len)
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    recs = [json.loads(l) for l in met.read_text().splitlines() if l.strip()]
    if not recs:
        raise ScalingError(f"{path}: metrics.jsonl is empty (the run never logged a step)")
    N, D, C, L, F = [], [], [], [], []
    for r in recs:
        d = r["step"] * tokens_per_step
        final = r["step"] == cfg.train.max_steps
        loss = r.get("val_loss", r["loss"]) if final else r["loss"]
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
                raise ScalingError(f"{p} holds no CSV and no run directories")
            parts.extend(read_run_dir(q.parent) for q in subs)
        else:
            raise ScalingError(f"{p} does not exist")
    r = Runs(*(np.concatenate([getattr(x, f) for x in parts]) for f in ("N", "D", "C", "loss", "final")),
             [name for x in parts for name in x.run])  # fmt: skip
    return r.subset(r.final) if final_only else r
