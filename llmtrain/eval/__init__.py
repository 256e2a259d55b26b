"""Evaluation with EleutherAI's lm-evaluation-harness, on the exported model in stock transformers.

A run directory or one of our checkpoints is first exported (fp32 by default, llmtrain.export)
to a temporary Hugging Face directory; a Hugging Face directory is used as is. The harness then
loads it with `AutoModelForCausalLM` (its `hf` model), so the scores are what anyone loading the
published model would get. Offline task fixtures ship in `llmtrain/eval/tasks/`:
`llmtrain_ppl` (held-out perplexity on text, loglikelihood_rolling), `llmtrain_mc` (multiple
choice) and `llmtrain_gen` (greedy completion, exact match); more task folders come in through
`include_path`. Periodic evaluation during training runs the same tasks on the training model
itself, on every rank (`llmtrain.eval.live`); `--sharded` does that for a saved checkpoint, under
the deepspeed launcher, for models no single device holds (`llmtrain.eval.sharded`).
"""

from __future__ import annotations

import logging
import math
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).parent / "tasks"


class EvalError(ValueError):
    """The evaluation cannot run as asked; the message says what to change."""


def _require_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise EvalError(
            "lm-evaluation-harness is not installed: pip install 'llmtrain[eval]' (or lm-eval)"
        ) from e


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / "state.json").is_file()


def task_manager(tasks: list[str], include_path: list[str] | None = None):
    """Our task folder and the user's; the harness's ~thousands of built-in task files are
    indexed (slow) only when a requested task is not found in those."""
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)]
    for p in include_path or []:
        if not Path(p).is_dir():
            raise EvalError(f"--include-path {p} is not a directory of task YAML files")
        paths.append(str(p))
    tm = TaskManager(include_path=paths, include_defaults=False)
    if any(t not in tm.all_tasks for t in tasks):
        tm = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        raise EvalError(
            f"unknown task(s) {', '.join(unknown)}; the shipped offline tasks are llmtrain_ppl, "
            "llmtrain_mc and llmtrain_gen; add your own with --include-path DIR"
        )
    return tm


def evaluate_hf_dir(
    hf_dir: str | Path,
    tasks: list[str],
    include_path: list[str] | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    dtype: str = "float32",
    max_length: int | None = None,
) -> dict:
    """Run harness tasks on a Hugging Face directory; returns the harness's results dict."""
    _require_lm_eval()
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    tm = task_manager(list(tasks), include_path)
    from llmtrain.hf import quiet_transformers_load

    with quiet_transformers_load():
        lm = HFLM(pretrained=str(hf_dir), device=device, dtype=dtype, batch_size=batch_size,
                  max_length=max_length)  # fmt: skip
    res = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=tm, limit=limit,
                                  log_samples=False, bootstrap_iters=0, verbosity="WARNING")  # fmt: skip
    if res is None:
        raise EvalError("the harness returned no results (not rank 0 of its own launcher?)")
    return res


def run_eval(
    model: str | Path,
    tasks: list[str],
    include_path: list[str] | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    dtype: str = "float32",
    max_length: int | None = None,
) -> dict:
    """`llmtrain eval`: a run dir, checkpoint or HF dir -> harness results."""
    _require_lm_eval()
    if max_length is not None and max_length < 2:
        raise EvalError(f"--max-length {max_length}: give at least 2 tokens")
    path = Path(model)
    if not path.exists():
        raise EvalError(f"{path} does not exist; give a run directory, checkpoint or HF directory")
    if is_hf_dir(path):
        return evaluate_hf_dir(path, tasks, include_path, limit, batch_size, device, dtype,
                               max_length)  # fmt: skip
    from llmtrain.export import export

    with tempfile.TemporaryDirectory(prefix="llmtrain-eval-") as tmp:
        hf = export(path, Path(tmp) / "hf", dtype="fp32" if dtype == "float32" else "bf16")
        return evaluate_hf_dir(hf, tasks, include_path, limit, batch_size, device, dtype,
                               max_length)  # fmt: skip


def flat_metrics(res: dict, prefix: str = "eval/") -> dict[str, float]:
    """{'eval/TASK/METRIC': value} of the numbers in a results dict (for metrics.jsonl / TB)."""
    out = {}
    for task, metrics in res["results"].items():
        for key, v in metrics.items():
            name = key.split(",")[0]  # "acc,none" -> "acc"
            # sample_len: how many documents were scored, not a metric
            if name in ("alias", "sample_len") or "stderr" in name or isinstance(v, bool):
                continue
            if isinstance(v, (int, float)) and math.isfinite(v):
                out[f"{prefix}{task}/{name}"] = float(v)
    return out


def format_results(res: dict) -> str:
    rows = [(k.removeprefix("eval/"), v) for k, v in flat_metrics(res).items()]
    w = max((len(k) for k, _ in rows), default=10)
    return "\n".join(f"{k:<{w}}  {v:.4f}" for k, v in rows)
