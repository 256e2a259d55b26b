"""IsoFLOP sweeps: plan a grid of configs, run them (here, one after another, or print the
deepspeed commands for a cluster), collect the final losses into the CSV `fit` reads."""

from __future__ import annotations

import csv
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from llmtrain.scaling.family import Family, training_config, write_config
from llmtrain.scaling.laws import Law, ScalingError

MANIFEST = "manifest.json"

logger = logging.getLogger(__name__)


def plan(budgets: list[float], family: str, out: Path, law: Law, sizes: int = 4, spread: float = 8.0,
         hyper: bool = False, center_factor: float = 1.0) -> dict:  # fmt: skip
    """Per budget, `sizes` models log-spaced over a factor `spread` around the law's N_opt
    (times `center_factor`, for families whose optimum is known to sit off the law's)."""
    if len(budgets) < 1 or any(b <= 0 for b in budgets):
        raise ScalingError("give one or more positive FLOP budgets")
    if sizes < 3:
        raise ScalingError("an IsoFLOP parabola needs >= 3 sizes per budget")
    fam = Family(family)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for c in sorted(budgets):
        center = law.allocate(c)["n_opt"] * center_factor
        targets = center * spread ** np.linspace(-0.5, 0.5, sizes)
        seen, points = set(), []
        for n in targets:
            cfg, info = training_config(fam, float(n), c, hyper=hyper)
            key = cfg.model.hidden_size
            if key in seen:
                continue  # the family is too coarse here; two targets mapped to one size
            seen.add(key)
            points.append((cfg, info))
        if len(points) < 3:
            why = (f"budget {c:.3g}: the family gives {len(points)} distinct size(s) around N_opt "
                   f"{center:.3g} (an IsoFLOP parabola needs >= 3): the family's sizes do not "
                   "reach there, or --spread is too narrow")  # fmt: skip
            if len(points) < 2:  # one size says nothing about the optimum at this budget
                raise ScalingError(f"{why}; drop this budget, widen --spread or extend the family")
            logger.warning("%s; Approach 2 will leave this budget out (Approach 3 still uses "
                           "its runs)", why)  # fmt: skip
        for cfg, info in points:
            name = f"C{c:.0e}_N{info['active_params']:.3g}".replace("+", "")
            cfg_path = out / "configs" / f"{name}.yaml"
            write_config(
                cfg, cfg_path, f"IsoFLOP sweep point: budget {c:.3g} FLOPs, {json.dumps(info)}"
            )
            runs.append({"name": name, "budget": c, "config": str(cfg_path.relative_to(out)),
                         "run_dir": f"runs/{name}", **info})  # fmt: skip
    manifest = {
        "family": str(Path(family).resolve()),
        "law": law.to_json(),
        "budgets": sorted(budgets),
        "runs": runs,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _manifest(sweep: Path) -> dict:
    f = sweep / MANIFEST
    if not f.is_file():
        raise ScalingError(
            f"{sweep} has no {MANIFEST}; create it with `llmtrain scaling sweep plan`"
        )
    return json.loads(f.read_text())


def is_finished(run_dir: Path, max_steps: int) -> bool:
    """`latest` names the last step (its files may since have been deleted to save space:
    collect reads metrics.jsonl), or the checkpoint `resume=auto` would take is the last step's
    (a save killed before `latest` moved)."""
    from llmtrain.checkpoint import format as fmt

    last = f"step_{max_steps:08d}"
    try:
        if (run_dir / "checkpoints" / "latest").read_text().strip() == last:
            return True
    except (OSError, UnicodeDecodeError):
        pass
    try:
        ck = fmt.latest_checkpoint(run_dir)
    except fmt.CheckpointError:  # damaged: the trainer's resume says how to go on
        return False
    return ck is not None and fmt.checkpoint_step(ck) == max_steps


def _has_checkpoint(run_dir: Path) -> bool:
    from llmtrain.checkpoint import format as fmt

    return (run_dir / "checkpoints" / "latest").is_file() or bool(fmt.complete_checkpoints(run_dir))


def run(
    sweep: Path, print_only: bool = False, nproc: int = 1, extra: list[str] | None = None
) -> dict:
    """Train every planned run not finished yet; a failed run is reported and the sweep goes on."""
    m = _manifest(sweep)
    status = {}
    bin_dir = Path(sys.executable).parent
    for r in m["runs"]:
        cfg, rd = sweep / r["config"], sweep / r["run_dir"]
        if is_finished(rd, r["steps"]):
            status[r["name"]] = "done (skipped)"
            continue
        resume = ["resume=auto"] if _has_checkpoint(rd) else []  # else --overwrite below
        args = [str(cfg), "--run-dir", str(rd), *resume, *(extra or [])]
        if nproc > 1 or print_only:
            cmd = ["deepspeed", "--num_gpus", str(nproc), "--module", "llmtrain.train", *args]
        else:
            cmd = [str(bin_dir / "llmtrain"), "train", *args]
        if print_only:
            print(shlex.join(cmd))
            status[r["name"]] = "printed"
            continue
        if rd.exists() and not resume:
            cmd.append("--overwrite")  # a crashed run before its first checkpoint starts over
        t0 = time.time()
        log = rd.parent / f"{r['name']}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as fh:
            p = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ))
        ok = p.returncode == 0 and is_finished(rd, r["steps"])
        status[r["name"]] = (
            f"done in {time.time() - t0:.0f}s" if ok else f"FAILED (exit {p.returncode}, see {log})"
        )
        print(f"{r['name']}: {status[r['name']]}", flush=True)
    (sweep / "status.json").write_text(json.dumps(status, indent=1))
    return status


def collect(sweep: Path, out_csv: Path | None = None) -> Path:
    """Final losses of finished runs to CSV: N (active params), D, C, loss, budget, run."""
    from llmtrain.train.metrics import read_records

    m = _manifest(sweep)
    rows, missing = [], []
    for r in m["runs"]:
        rd = sweep / r["run_dir"]
        if not is_finished(rd, r["steps"]):
            missing.append(r["name"])
            continue
        last = read_records(rd / "metrics.jsonl")[-1]
        loss = last.get("val_loss", last["loss"])
        loss = float("nan") if loss is None else loss  # a skipped last step's (written null)
        rows.append({"N": r["active_params"], "D": r["tokens"], "C": r["flops_per_token"] * r["tokens"],
                     "loss": loss, "budget": r["budget"], "run": r["name"]})  # fmt: skip
        moe_cols = ("active_params", "total_params", "body_total_params", "experts",
                    "granularity", "top_k")  # fmt: skip
        rows[-1].update({k: r[k] for k in moe_cols if "experts" in r and k in r})  # MoE sweeps
    if not rows:
        raise ScalingError(
            f"no finished runs in {sweep}; run `llmtrain scaling sweep run {sweep}` first"
        )
    out_csv = out_csv or sweep / "results.csv"
    with open(out_csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    if missing:
        print(f"not finished (left out): {', '.join(missing)}", file=sys.stderr)
    return out_csv
