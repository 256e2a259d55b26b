"""`llmtrain eval CHECKPOINT --sharded`: the harness on a checkpoint held as the run trained it.

Why: the default path exports the whole model to one process and loads it in transformers,
which needs one device (or host) to hold every weight: 1.3 TB in fp32 at 671B. Here every rank
of a `deepspeed` launch builds the run's own model and engine at its layout (ZeRO partitions,
routed experts over the expert-parallel ranks, as `llmtrain/train/loop.py` builds them), reads
only the byte ranges of its own weight pieces from the checkpoint (no optimizer moments, no
gather), and runs the harness through `llmtrain.eval.live`, the path periodic evaluation takes
during training: requests dealt over the ranks, scores all-gathered, rank 0 reports. No rank holds
more of the model than it trained with.

The layout comes from the checkpoint's config.yaml; `a.b=c` overrides change it (another
`parallel.ep_size` or `parallel.zero_stage` for another world size). The scores are computed in
the run's `train.dtype`; with fp32 they equal the export path's (tests/test_eval.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

from llmtrain.eval import EvalError

logger = logging.getLogger(__name__)

# what evaluation changes of the run's config: one sequence per rank per "step" (any world size
# divides it), eager blocks (no compile time), no weights from elsewhere, no periodic tasks
_EVAL_ONLY = ["train.micro_batch_size=1", "train.compile=false", "train.compile_mode=default",
              "train.init_from=", "train.eval_tasks=[]"]  # fmt: skip


def evaluate_sharded(
    model: str | Path,
    tasks: list[str],
    overrides: list[str] | tuple[str, ...] = (),
    include_path: list[str] | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
) -> dict | None:
    """Every rank calls it; rank 0 gets the harness's results dict, the others None."""
    from llmtrain.checkpoint import format as fmt
    from llmtrain.config import load_config
    from llmtrain.eval import check_eval_args, check_tokenizer
    from llmtrain.parallel.layout import make_layout

    path = Path(model)
    if (path / "config.json").is_file() and not (path / "state.json").is_file():
        raise EvalError(f"{path} is a Hugging Face directory: --sharded evaluates one of our "
                        "runs or checkpoints; drop --sharded to evaluate it in one process")  # fmt: skip
    ck = fmt.resolve_checkpoint(path)  # each rank, for the config's backend; rank 0's is used
    check_tokenizer(ck)
    check_eval_args(tasks, include_path, limit, max_length)  # before any process group
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(ck / "config.yaml",
                      [*overrides, *_EVAL_ONLY, f"train.global_batch_size={world_env}"])  # fmt: skip
    layout = make_layout(cfg, world_env)  # an impossible layout says what to change, before NCCL
    # DeepSpeed prints to stdout (its CPU comm op's build line): stdout is the scores' alone
    with contextlib.redirect_stdout(sys.stderr):
        return _evaluate(ck, cfg, layout, list(tasks), include_path, limit, batch_size, max_length)


def _evaluate(ck, cfg, layout, tasks, include_path, limit, batch_size, max_length) -> dict | None:
    from tokenizers import Tokenizer

    from llmtrain.data.tokenizer import eos_id
    from llmtrain.parallel import comm
    from llmtrain.parallel.engine import device_for, init_distributed, shutdown_distributed
    from llmtrain.train.checkpointing import Checkpointer
    from llmtrain.train.loop import build_model_and_engine

    rank, world, local_rank = init_distributed(cfg.parallel.backend)
    try:
        ck = Path(comm.broadcast_object(str(ck)))  # one checkpoint for all, as a resume reads
        if rank == 0:
            logger.info("evaluating %s at %s", ck, layout.describe())
        device = device_for(local_rank)
        model_, engine = build_model_and_engine(cfg, layout, device)
        ckpt = Checkpointer(ck.parent.parent, model_, rank, keep_last=0)
        ckpt.engine = engine
        ckpt.restore(ck, weights_only=True)
        tok = Tokenizer.from_file(str(ck / "tokenizer.json"))
        from llmtrain.eval.live import TrainingModelLM, evaluate_live

        def forward(x_BT, rows_N):  # through the engine: ZeRO-3 gathers each layer in turn
            return engine(x_BT, logits_at=rows_N).logits

        lm = TrainingModelLM(model_, tok, eos_id(tok),
                             max_length=max_length or cfg.model.max_position_embeddings,
                             batch_size=batch_size, device=device, forward=forward)  # fmt: skip
        engine.train(False)
        res = evaluate_live(lm, tasks, limit=limit, include_path=include_path)
        return res if rank == 0 else None
    finally:
        shutdown_distributed()
