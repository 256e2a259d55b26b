"""Speed of a full Approach-3 fit: the 4,500-start grid on the 240 Epoch/Chinchilla points,
then 1,000 bootstrap resamples (each refit from the full-data optimum). Target: < 2 minutes on
2 cores. Prints the time, the fit and the intervals; writes JSON.

    .venv/bin/python benchmarks/scaling_fit.py [--bootstrap 1000]
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--data",
        default=str(ROOT / "tests/data/scaling/epoch_chinchilla/svg_extracted_data.csv"),
    )
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scaling_fit.json"))
    args = ap.parse_args()
    from llmtrain.scaling.fit import Runs, fit_approach3

    rows = list(csv.DictReader(open(args.data)))
    N = np.array([float(r["Model Size"]) for r in rows])
    C = np.array([float(r["Training FLOP"]) for r in rows])
    L = np.array([float(r["loss"]) for r in rows])
    keep = L < np.sort(L)[-5]
    runs = Runs(N[keep], C[keep] / (6 * N[keep]), C[keep], L[keep], np.ones(keep.sum(), bool))
    t0 = time.perf_counter()
    out = fit_approach3(runs, bootstrap=args.bootstrap, seed=0)
    dt = time.perf_counter() - t0
    p = out["params"]
    ci = out["bootstrap"]["ci95"] if args.bootstrap else {k: (float("nan"),) * 2 for k in p}
    print(
        f"{len(runs)} points, {out['starts']} starts + {args.bootstrap} bootstrap refits: {dt:.1f} s (target < 120 s)"
    )
    for k in ("E", "A", "B", "alpha", "beta", "a_exp", "b_exp"):
        print(f"  {k:<6} {p[k]:>10.4g}  [{ci[k][0]:.4g}, {ci[k][1]:.4g}]")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"seconds": dt, "points": len(runs), "params": p, "ci95": ci}, indent=2)
    )


if __name__ == "__main__":
    main()
