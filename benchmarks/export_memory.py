"""Peak memory of a streamed export, against the bound 1.5 x largest output shard + one input shard.

Builds a model whose weights are several times the output shard size, writes it as one of our
checkpoints in input shards of --in-shard bytes, then exports it (fp32, --shard-size) in a fresh
process and reads that process's peak RSS above its RSS just before the export started.

    .venv/bin/python benchmarks/export_memory.py [--shard-size 50MB] [--in-shard 100MB]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, resource, sys
from pathlib import Path
import torch, transformers, safetensors, yaml  # code is loaded before the baseline is read
import llmtrain.model, llmtrain.accounting, llmtrain.checkpoint, llmtrain.scaling.laws
from llmtrain.export import export
from llmtrain.config import ModelConfig
llmtrain.model.build_model(ModelConfig(), device="meta")  # first meta build loads torch internals
def status(key):  # VmRSS now, VmHWM peak of this process image (ru_maxrss would include the parent's)
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
base = status("VmRSS")
out = export(sys.argv[1], sys.argv[2], dtype="fp32", shard_size=sys.argv[3])
print(json.dumps({"base": base, "peak": status("VmHWM")}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shard-size", default="50MB")
    ap.add_argument("--in-shard", default="100MB")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "export_memory.json"))
    args = ap.parse_args()

    from llmtrain.config import load_config
    from llmtrain.export import parse_size
    from llmtrain.model import build_model
    from llmtrain.tensor_io import write_sharded

    cfg = load_config(ROOT / "configs" / "bench_28m.yaml", [
        "model.hidden_size=512", "model.num_layers=8", "model.n_routed_experts=32", "model.moe_intermediate_size=512",
        "model.intermediate_size=2048", "model.num_heads=8"])  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="llmtrain-exportmem-"))
    model = build_model(cfg.model)
    tensors = {k: v.detach() for k, v in model.state_dict().items()
               if not k.endswith(("last_counts", "load_since_update", "inv_freq"))}  # fmt: skip
    ckdir = tmp / "ck"
    ckdir.mkdir()
    in_files = write_sharded(tensors, ckdir, "model", parse_size(args.in_shard))

    (ckdir / "config.yaml").write_text(__import__("yaml").safe_dump(cfg.to_dict()))
    (ckdir / "state.json").write_text(json.dumps({"step": 0}))
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    env = dict(__import__("os").environ)
    del model, tensors
    p = subprocess.run([sys.executable, "-c", CHILD, str(ckdir), str(tmp / "hf"), args.shard_size], env=env,
                       capture_output=True, text=True, cwd=ROOT, check=True)  # fmt: skip
    r = json.loads(p.stdout.strip().splitlines()[-1])
    out_sizes = [f.stat().st_size for f in (tmp / "hf").glob("*.safetensors")]
    in_sizes = [(ckdir / f).stat().st_size for f in in_files]
    bound = 1.5 * max(out_sizes) + max(in_sizes)
    used = r["peak"] - r["base"]
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"model weights {total / 1e6:.0f} MB; {len(in_files)} input shards (largest {max(in_sizes) / 1e6:.0f} MB); "
          f"{len(out_sizes)} output shards (largest {max(out_sizes) / 1e6:.0f} MB)")  # fmt: skip
    print(f"export peak RSS above baseline: {used / 1e6:.0f} MB; bound 1.5 x largest output + one input = "
          f"{bound / 1e6:.0f} MB -> {'within' if used <= bound else 'OVER'} ({used / bound:.2f} of the bound)")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"weights_bytes": total, "peak_above_baseline": used, "bound": bound,
                                          "largest_out_shard": max(out_sizes), "largest_in_shard": max(in_sizes),
                                          "out_shards": len(out_sizes)}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
