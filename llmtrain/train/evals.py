"""Periodic lm-evaluation-harness tasks during training (train.eval_tasks, train.eval_tasks_every).

Every rank takes part in gathering the current weights (one tensor at a time, the same
collectives a checkpoint uses); rank 0 streams them into a temporary consolidated checkpoint,
exports it to a temporary Hugging Face directory (llmtrain.export) and runs the harness on it in
stock transformers. The scores join that step's metrics record, so they land in metrics.jsonl
and TensorBoard as `eval/TASK/METRIC`. The other ranks wait in the next step's collective
meanwhile: keep periodic tasks small (train.eval_tasks_limit), or evaluate saved checkpoints
with `llmtrain eval` in a separate job.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import yaml

from llmtrain.parallel import comm

logger = logging.getLogger(__name__)


def due(t, done: int) -> bool:
    if not t.eval_tasks:
        return False
    every = t.eval_tasks_every or t.eval_every
    return done % every == 0 or done == t.max_steps


def _write_current_weights(engine, model, cfg, out: Path, tokenizer_file: Path, rank: int):
    from llmtrain.parallel.engine import is_expert_param
    from llmtrain.tensor_io import ShardWriter
    from llmtrain.train.checkpoint import SHARD_BYTES, _ep_gather

    ep = engine.layout.ep_size
    group = model.moe_layers()[0].dispatcher.group if ep > 1 else None
    w = ShardWriter(out, SHARD_BYTES, "model") if rank == 0 else None
    for name, p in model.named_parameters():
        full = engine.full_param(p)
        full = _ep_gather(full, group, ep) if is_expert_param(name) else full
        if w is not None:
            w.add(name, full)
    if w is None:
        return
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            w.add(name, b.detach().float().cpu())
    w.finish()
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (out / "state.json").write_text(json.dumps({"step": 0, "tokens_seen": 0, "flops": 0}))
    if tokenizer_file.is_file():
        shutil.copy(tokenizer_file, out / "tokenizer.json")


def periodic_evals(cfg, engine, model, done: int, rank: int, tokenizer_file: Path) -> dict:
    """All ranks call it after each step; {} unless tasks are due. Rank 0 gets the scores."""
    t = cfg.train
    if not due(t, done):
        return {}
    scores: dict = {}
    with tempfile.TemporaryDirectory(prefix="llmtrain-evals-") as tmp:
        ck = Path(tmp) / "ck"
        if rank == 0:
            ck.mkdir()
        _write_current_weights(engine, model, cfg, ck, tokenizer_file, rank)
        if rank == 0:
            from llmtrain.eval import evaluate_hf_dir, flat_metrics
            from llmtrain.export import export

            hf = export(ck, Path(tmp) / "hf", dtype="fp32", mtp=False)
            res = evaluate_hf_dir(hf, list(t.eval_tasks), limit=t.eval_tasks_limit or None,
                                  batch_size=t.micro_batch_size)  # fmt: skip
            scores = flat_metrics(res)
            logger.info(
                "step %d evals: %s", done, ", ".join(f"{k}={v:.4g}" for k, v in scores.items())
            )
    comm.barrier()
    return scores
