"""Periodic lm-evaluation-harness tasks during training (train.eval_tasks, train.eval_tasks_every).

The harness runs on every rank against the model being trained (`llmtrain.eval.live`): nothing is
exported or gathered, so no rank holds more of the model than it trains with, at any size or
layout. Log-likelihood requests are split over the ranks; contexts are cut to `train.seq_len`,
the length the model trains at (HFLM's `max_length`). The scores, which equal the harness's own
HFLM on the exported model (tests/test_eval.py), join that step's metrics record, so they land
in metrics.jsonl and TensorBoard as `eval/TASK/METRIC`. Keep periodic tasks small
(train.eval_tasks_limit): training waits for them; evaluate exported checkpoints at full size
with `llmtrain eval` in a separate job.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def due(t, done: int) -> bool:
    if not t.eval_tasks:
        return False
    every = t.eval_tasks_every or t.eval_every
    return done % every == 0 or done == t.max_steps


def check_eval_tasks(t) -> None:
    """Before training starts: the harness is installed, every task loads, and generation
    tasks decode greedily within train.seq_len (EvalError, a one-line user error, otherwise)."""
    if not t.eval_tasks:
        return
    from llmtrain.eval import _require_lm_eval

    _require_lm_eval()
    from llmtrain.eval.live import check_tasks

    check_tasks(list(t.eval_tasks), t.seq_len)


def periodic_evals(run, done: int) -> dict:
    """All ranks call it after each step; {} unless tasks are due, else every rank gets the
    scores."""
    t = run.cfg.train
    if not due(t, done):
        return {}
    from llmtrain.eval import _require_lm_eval, flat_metrics

    _require_lm_eval()
    from llmtrain.eval.live import engine_lm, evaluate_live

    engine = run.engine
    lm = engine_lm(run.model, engine, run.tokenizer_file, t.seq_len, t.micro_batch_size,
                   run.device)  # fmt: skip
    engine.train(False)
    try:
        res = evaluate_live(lm, list(t.eval_tasks), limit=t.eval_tasks_limit or None)
    finally:
        engine.train(True)
    scores = flat_metrics(res)
    if run.rank == 0:
        logger.info("step %d evals: %s", done, ", ".join(f"{k}={v:.4g}" for k, v in scores.items()))
    return scores
