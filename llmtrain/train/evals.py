"""Periodic lm-evaluation-harness tasks during training (train.eval_tasks, train.eval_tasks_every).

Every rank writes what it holds of the current weights into a sharded checkpoint under the run
directory (the same parallel write as a training checkpoint: nothing is gathered, and every node
sees the run directory); rank 0 exports it to a temporary Hugging Face directory (llmtrain.export,
streamed one tensor at a time) and runs the harness on it in stock transformers. The scores join
that step's metrics record, so they land in metrics.jsonl and TensorBoard as `eval/TASK/METRIC`.
The other ranks wait at a barrier meanwhile: keep periodic tasks small (train.eval_tasks_limit),
or evaluate saved checkpoints with `llmtrain eval` in a separate job.
"""

from __future__ import annotations

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


def periodic_evals(run, done: int) -> dict:
    """All ranks call it after each step; {} unless tasks are due. Rank 0 gets the scores."""
    from llmtrain.train.checkpointing import Checkpointer

    cfg, t, rank = run.cfg, run.cfg.train, run.rank
    if not due(t, done):
        return {}
    scores: dict = {}
    scratch = run.run_dir / ".evals-tmp"
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    comm.barrier()
    writer = Checkpointer(scratch, run.model, rank, keep_last=1)
    writer.engine = run.engine
    state = {"step": done, "tokens_seen": done * run.layout.tokens_per_step, "flops": 0}
    ck = writer.save(done, state, yaml.safe_dump(cfg.to_dict(), sort_keys=False),
                     run.tokenizer_file)  # fmt: skip
    if rank == 0:
        from llmtrain.eval import evaluate_hf_dir, flat_metrics
        from llmtrain.export import export

        with tempfile.TemporaryDirectory(prefix="llmtrain-evals-") as tmp:
            hf = export(ck, Path(tmp) / "hf", dtype="fp32", mtp=False)
            res = evaluate_hf_dir(hf, list(t.eval_tasks), limit=t.eval_tasks_limit or None,
                                  batch_size=t.micro_batch_size)  # fmt: skip
        scores = flat_metrics(res)
        logger.info("step %d evals: %s", done, ", ".join(f"{k}={v:.4g}" for k, v in scores.items()))
        shutil.rmtree(scratch, ignore_errors=True)
    comm.barrier()
    return scores
