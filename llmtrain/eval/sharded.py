"""`llmtrain eval CHECKPOINT --sharded`: the harness on a checkpoint held as the run trained it.

Why: the default path exports the whole model to one process and loads it in transformers,
which needs one device (or host) to hold every weight: 1.3 TB in fp32 at 671B. Here every rank
of a `deepspeed` launch builds the run's own model at its layout (ZeRO-3 partitions, routed
experts over the expert-parallel ranks, as `llmtrain/train/loop.py` builds them) with a
`WeightsEngine` (its weights and nothing for training: no fp32 masters, gradient buffers, Adam
moments or reduce buckets), reads only the byte ranges of its own weight pieces from the
checkpoint (no gather), and runs the harness through `llmtrain.eval.live`, the path periodic
evaluation takes during training: requests dealt over the ranks, scores all-gathered, rank 0
reports.

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
# divides it), eager blocks (no compile time), no weights from elsewhere, no periodic tasks, no
# optimizer to offload (a WeightsEngine has none)
_EVAL_ONLY = ["train.micro_batch_size=1", "train.compile=false", "train.compile_mode=default",
              "train.init_from=", "train.eval_tasks=[]", "train.offload_optimizer=false"]  # fmt: skip


def evaluate_sharded(
    model: str | Path, tasks: list[str], overrides: list[str] | tuple[str, ...] = (), **kw
) -> dict | None:
    """Every rank calls it; rank 0 gets the harness's results dict, the others None. `kw`:
    include_path, limit, batch_size, max_length, as `llmtrain eval`'s flags."""
    from llmtrain.checkpoint import format as fmt
    from llmtrain.errors import once_a_node
    from llmtrain.eval import check_tokenizer

    path = Path(model)
    with once_a_node():  # before any process group, from files a node's ranks read alike
        if (path / "config.json").is_file() and not (path / "state.json").is_file():
            raise EvalError(f"{path} is a Hugging Face directory: --sharded evaluates one of "
                            "our runs or checkpoints; drop --sharded to evaluate it in one "
                            "process")  # fmt: skip
        ck = fmt.resolve_checkpoint(path)  # each rank, for the config's backend; rank 0's used
        check_tokenizer(ck)
        scorer = _Scorer(overrides, tasks, **kw)  # checks the tasks before any process group
        cfg, _ = scorer.config(ck)  # an impossible layout says what to change, before NCCL
    # DeepSpeed prints to stdout (its CPU comm op's build line): stdout is the scores' alone
    with contextlib.redirect_stdout(sys.stderr), _process_group(cfg.parallel.backend) as rank:
        from llmtrain.parallel import comm

        ck = Path(comm.broadcast_object(str(ck)))  # one checkpoint for all, as a resume reads
        res = scorer(ck)
        return res if rank == 0 else None


def watch_sharded(
    run_dir: str | Path,
    tasks: list[str],
    overrides: list[str] | tuple[str, ...] = (),
    *,
    watch_kwargs: dict,
    **kw,
):
    """`--watch --sharded`: rank 0 runs the watcher (llmtrain.eval.watch: snapshots, results
    file, TensorBoard) and tells the other ranks, once per look, to wait on or to score a
    snapshot with it; the engine is built at the first checkpoint and refilled for each next one.
    `watch_kwargs` go to `watch` (poll, until_step, timeout, out, on_result); `kw` as
    `evaluate_sharded`'s. Returns rank 0's WatchResult, None elsewhere."""
    from llmtrain.errors import once_a_node
    from llmtrain.eval.watch import watch

    with once_a_node():
        scorer = _Scorer(overrides, tasks, **kw)
    shown, stdout = watch_kwargs.pop("on_result", None), sys.stdout

    def on_result(row: dict) -> None:  # the rows to the real stdout (DeepSpeed's go to stderr)
        if shown is not None:
            with contextlib.redirect_stdout(stdout):
                shown(row)

    with contextlib.redirect_stdout(sys.stderr), _process_group("auto") as rank:
        from llmtrain.parallel import comm

        if rank != 0:
            while True:  # rank 0's commands, one per look (short waits: no collective timeout)
                cmd, arg = comm.broadcast_object(None)
                if cmd == "stop":
                    return None
                if cmd == "score":
                    try:
                        scorer(Path(arg))
                    except Exception as e:  # rank 0 meets it too, and decides: skip or stop
                        logger.debug("scoring %s failed here: %s", arg, e)

        def evaluate(snap: Path) -> dict:
            comm.broadcast_object(("score", str(snap)))
            return scorer(snap)

        try:
            return watch(run_dir, tasks, evaluate=evaluate,
                         between_looks=lambda: comm.broadcast_object(("wait", None)),
                         on_result=on_result, dtype="sharded", limit=scorer.limit,
                         max_length=scorer.max_length, include_path=scorer.include_path,
                         overrides=scorer.overrides, **watch_kwargs)  # fmt: skip
        finally:  # whatever ended the watch, the other ranks leave with it
            comm.broadcast_object(("stop", None))


@contextlib.contextmanager
def _process_group(backend: str):
    from llmtrain.parallel.engine import init_distributed, shutdown_distributed

    rank, _, _ = init_distributed(backend)
    try:
        yield rank
    finally:
        shutdown_distributed()


class _Scorer:
    """The run's model and engine at its layout, built from the first checkpoint scored; each
    checkpoint's weight pieces are then read into it (this rank's byte ranges alone)."""

    def __init__(self, overrides, tasks, include_path=None, limit=None, batch_size=8,
                 max_length=None):  # fmt: skip
        from llmtrain.eval import check_eval_args

        self.overrides, self.tasks, self.include_path = list(overrides), list(tasks), include_path
        self.limit, self.batch_size, self.max_length = limit, batch_size, max_length
        self.ckpt = self.lm = None
        # what needs no weights, before any process group; decoding is greedy, as training's
        check_eval_args(self.tasks, include_path, limit, max_length, greedy=True)

    def config(self, ck: Path):
        from llmtrain.config import load_config
        from llmtrain.parallel.layout import make_layout

        world = int(os.environ.get("WORLD_SIZE", "1"))
        cfg = load_config(ck / "config.yaml",
                          [*self.overrides, *_EVAL_ONLY, f"train.global_batch_size={world}"])  # fmt: skip
        return cfg, make_layout(cfg, world)

    def _build(self, ck: Path) -> None:
        import torch.distributed as dist

        from llmtrain.eval.live import engine_lm
        from llmtrain.parallel.engine import WeightsEngine, device_for
        from llmtrain.train.checkpointing import Checkpointer
        from llmtrain.train.loop import build_model_and_engine

        cfg, layout = self.config(ck)
        rank = dist.get_rank()
        if rank == 0:
            logger.info("evaluating %s at %s", ck, layout.describe())
        device = device_for(int(os.environ.get("LOCAL_RANK", 0)))
        # the weights alone: no master copies, gradient buffers, moments or reduce buckets
        model, engine = build_model_and_engine(cfg, layout, device, Engine=WeightsEngine)
        self.ckpt = Checkpointer(ck.parent, model, rank, keep_last=0)
        self.ckpt.engine = engine
        self.lm = engine_lm(model, engine, ck / "tokenizer.json",
                            self.max_length or cfg.model.max_position_embeddings,
                            self.batch_size, device)  # fmt: skip
        engine.train(False)

    def __call__(self, ck: Path) -> dict:
        from llmtrain.eval.live import evaluate_live

        if self.ckpt is None:
            self._build(ck)
        self.ckpt.restore(ck, weights_only=True)
        return evaluate_live(self.lm, self.tasks, limit=self.limit, include_path=self.include_path)
