"""Throughput and memory of `llmtrain data prepare`, against the tokenizer's own encode_batch.

Generates JSONL corpora of each --sizes (MB of text; documents cut from this Python's standard
library sources), trains one byte-level BPE (--vocab) once, then for each size:

- prepare: `llmtrain data prepare` (reading, JSON parsing, encoding, writing shards) with
  data.num_proc = all cores, in a fresh process; tokens/s over its wall time, and the peak RSS
  of the whole process tree (reader + workers), sampled every 0.1 s.
- baseline (the smallest size only, it holds the corpus in memory): the same documents already
  in a Python list, `Tokenizer.encode_batch` with TOKENIZERS_PARALLELISM=true (Rayon threads on
  all cores), in a fresh process; tokens/s of the encode call alone.

Peak memory should not grow with the corpus (bounded work in flight, streamed reading).

    flock /tmp/llmtrain-heavy.lock .venv/bin/python benchmarks/data_prepare.py --sizes 100 1000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASELINE = r"""
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
texts = []
for f in sys.argv[2:]:
    with open(f) as fh:
        texts.extend(json.loads(l)["text"] for l in fh)
tok.encode_batch(texts[:64])  # start the thread pool
t = time.perf_counter()
encs = tok.encode_batch(texts, add_special_tokens=False)
dt = time.perf_counter() - t
print(json.dumps({"tokens": sum(len(e.ids) for e in encs) + len(texts), "seconds": dt}))
"""


def make_corpus(out: Path, mb: int, n_files: int = 8) -> list[Path]:
    """~mb MB of JSONL: documents of 1-8 KB cut from the stdlib sources, cycled with a counter
    so no two documents are identical."""
    import numpy as np

    from llmtrain.data.corpus import stdlib_files

    rng = np.random.default_rng(0)
    pool = [p.read_text(errors="replace") for p in stdlib_files()[:400]]
    out.mkdir(parents=True, exist_ok=True)
    files = [out / f"part{i:02d}.jsonl" for i in range(n_files)]
    handles = [open(f, "w") for f in files]
    target, written, k = mb * 1_000_000, 0, 0
    while written < target:
        src = pool[k % len(pool)]
        a = int(rng.integers(0, max(1, len(src) - 1000)))
        text = f"# doc {k}\n" + src[a : a + int(rng.integers(1000, 8000))]
        line = json.dumps({"text": text}) + "\n"
        handles[k % n_files].write(line)
        written += len(text)
        k += 1
    for h in handles:
        h.close()
    return files


def run_prepare(cfg_path: Path, cache: Path, nproc: int) -> dict:
    import psutil

    cmd = [sys.executable, "-m", "llmtrain.cli", "data", "prepare", str(cfg_path),
           f"data.cache_dir={cache}", f"data.num_proc={nproc}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc, peak = psutil.Process(p.pid), 0
    while p.poll() is None:
        try:
            procs = [proc, *proc.children(recursive=True)]
            peak = max(peak, sum(x.memory_info().rss for x in procs if x.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.1)
    dt = time.perf_counter() - t
    out, err = p.communicate()
    if p.returncode:
        raise SystemExit(f"data prepare failed:\n{err[-3000:]}")
    d = next((cache / "data").iterdir())
    idx = json.loads((d / "index.json").read_text())
    tokens = sum(s["tokens"] for s in idx["splits"].values())
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt, "peak_rss_mb": peak / 1e6,
            "text_mb": idx["bytes"] / 1e6, "line": out.strip()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000], help="MB of text")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--nproc", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_prepare.json"))
    args = ap.parse_args()

    from llmtrain.data.tokenizer import train_bpe

    tmp = Path(tempfile.mkdtemp(prefix="llmtrain-dataprep-"))
    rows, base = [], None
    try:
        sample = make_corpus(tmp / "sample", 5, n_files=1)
        texts = [json.loads(l)["text"] for l in sample[0].read_text().splitlines()]
        tok_file = tmp / "tokenizer.json"
        train_bpe(texts, args.vocab).save(str(tok_file))
        for mb in sorted(args.sizes):
            files = make_corpus(tmp / f"c{mb}", mb)
            cfg = tmp / "cfg.yaml"
            cfg.write_text(json.dumps({
                "model": {"vocab_size": args.vocab},
                "data": {"sources": [str(tmp / f"c{mb}")], "tokenizer": str(tok_file),
                         "val_percent": 1.0}}))  # fmt: skip
            r = run_prepare(cfg, tmp / f"cache{mb}", args.nproc)
            if base is None:  # the in-memory baseline on the same documents
                env = {**os.environ, "TOKENIZERS_PARALLELISM": "true"}
                out = subprocess.run([sys.executable, "-c", BASELINE, str(tok_file), *map(str, files)],
                                     env=env, capture_output=True, text=True, check=True).stdout  # fmt: skip
                b = json.loads(out.strip().splitlines()[-1])
                base = {"size_mb": mb, **b, "tokens_per_s": b["tokens"] / b["seconds"]}
                r["vs_encode_batch"] = r["tokens_per_s"] / base["tokens_per_s"]
                assert abs(b["tokens"] - r["tokens"]) <= 0.001 * b["tokens"], (b, r)
            rows.append({"size_mb": mb, **r})
            shutil.rmtree(tmp / f"c{mb}")
            shutil.rmtree(tmp / f"cache{mb}")
            print(f"{mb:>6} MB  prepare {r['tokens_per_s'] / 1e6:6.2f} M tok/s  "
                  f"({r['seconds']:.1f} s, {r['tokens'] / 1e6:.1f} M tokens)  "
                  f"peak RSS {r['peak_rss_mb']:7.1f} MB"
                  + (f"  = {r['vs_encode_batch']:.2f} x encode_batch "
                     f"({base['tokens_per_s'] / 1e6:.2f} M tok/s)" if "vs_encode_batch" in r else ""),
                  flush=True)  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = {"nproc": args.nproc, "vocab": args.vocab, "baseline": base, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
