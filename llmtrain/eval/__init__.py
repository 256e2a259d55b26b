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
from contextlib import contextmanager
from pathlib import Path

from llmtrain.errors import LlmtrainError

logger = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).parent / "tasks"


class EvalError(LlmtrainError, ValueError):
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


def _quiet_harness() -> None:
    """Our tasks build their documents in Python (`custom_dataset`); the harness then warns, at
    every load of every such task, that kwargs could be passed through --metadata: advice for
    its own CLI, noise in ours (four lines per `llmtrain eval`)."""
    log = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _NoMetadataAdvice) for f in log.filters):
        log.addFilter(_NoMetadataAdvice())


class _NoMetadataAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


def task_manager(tasks: list[str], include_path: list[str] | None = None):
    """Our task folder and the user's; the harness's ~thousands of built-in task files are
    indexed (slow) only when a requested task is not found in those."""
    from lm_eval.tasks import TaskManager

    _quiet_harness()
    paths = [str(TASKS_DIR)]
    for p in include_path or []:
        if not Path(p).is_dir():
            raise EvalError(f"--include-path {p} is not a directory of task YAML files")
        paths.append(str(p))
    tm = TaskManager(include_path=paths, include_defaults=False)
    if any(t not in tm.all_tasks for t in tasks):
        tm = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in tm.all_tasks]
    broken = _unreadable_task_files(include_path or []) if unknown else []
    if broken:  # a task in a file that does not parse is "unknown": say which file and why
        raise EvalError(f"task(s) {', '.join(unknown)} not found, and these task files do not "
                        f"parse: {'; '.join(broken[:3])}")  # fmt: skip
    if unknown:
        raise EvalError(
            f"unknown task(s) {', '.join(unknown)}; the shipped offline tasks are llmtrain_ppl, "
            "llmtrain_mc and llmtrain_gen; add your own with --include-path DIR"
        )
    return tm


def _unreadable_task_files(include_path: list[str]) -> list[str]:
    """'FILE: error' for each task YAML under the folders that YAML cannot parse (the harness
    skips such files silently). Tags such as `!function` are not resolved here."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    out = []
    for folder in include_path:
        for f in sorted(Path(folder).rglob("*.yaml")):
            try:
                yaml.load(f.read_text(), Loader=Loader)  # noqa: S506 (a SafeLoader)
            except (yaml.YAMLError, UnicodeDecodeError) as e:
                out.append(f"{f}: {' '.join(str(e).split())[:200]}")
    return out


@contextmanager
def task_errors(tasks: list[str]):
    """A task's own mistakes (a `!function` module that does not import, a template naming a
    field its documents lack) as one EvalError naming the tasks, not as a bug of ours."""
    try:
        yield
    except ImportError as e:
        raise EvalError(f"task(s) {', '.join(tasks)}: {e}; fix the task's YAML or its Python "
                        "module, or install what it imports") from e  # fmt: skip
    except Exception as e:
        import jinja2

        if not isinstance(e, jinja2.TemplateError):
            raise
        raise EvalError(f"task(s) {', '.join(tasks)}: a template does not render "
                        f"({type(e).__name__}: {e}); fix the task's YAML") from e  # fmt: skip


def check_eval_args(
    tasks: list[str],
    include_path: list[str] | None = None,
    limit: int | None = None,
    max_length: int | None = None,
    greedy: bool = False,
) -> None:
    """What needs no weights, checked before any export or checkpoint is read: the harness, the
    tasks (their files, data and first documents; with `greedy`, what our greedy decoding
    can run), --limit and --max-length."""
    _require_lm_eval()
    if limit is not None and limit < 1:
        raise EvalError(f"--limit {limit}: give at least 1 document per task, or leave it out "
                        "for all of them")  # fmt: skip
    if max_length is not None and max_length < 2:
        raise EvalError(f"--max-length {max_length}: give at least 2 tokens")
    from llmtrain.eval.live import check_tasks

    check_tasks(list(tasks), max_length, include_path, greedy=greedy)


def check_tokenizer(path: Path) -> None:
    """A model without a tokenizer would fail only after the export, inside transformers, with
    advice to install sentencepiece."""
    from llmtrain.checkpoint.format import resolve_checkpoint

    if is_hf_dir(path):
        files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
        if not any((path / f).is_file() for f in files):
            raise EvalError(f"{path} has no tokenizer (none of {', '.join(files)}); copy the "
                            "model's tokenizer files into it")  # fmt: skip
        return
    ck = resolve_checkpoint(path)
    if not (ck / "tokenizer.json").is_file():
        raise EvalError(f"{ck} has no tokenizer.json; copy the run's tokenizer (the "
                        "prepared data's tokenizer.json) into it")  # fmt: skip


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

    from llmtrain.eval.live import cached_task_manager, no_environment_report

    tm = cached_task_manager(list(tasks), include_path)
    from llmtrain.hf import quiet_transformers_load

    with quiet_transformers_load():
        lm = HFLM(pretrained=str(hf_dir), device=device, dtype=dtype, batch_size=batch_size,
                  max_length=max_length)  # fmt: skip
    with task_errors(list(tasks)), no_environment_report():
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
    tasks_checked: bool = False,
) -> dict:
    """`llmtrain eval`: a run dir, checkpoint or HF dir -> harness results. Everything that
    needs no weights is checked before the export (the tasks not again with `tasks_checked`:
    the watcher checked them once, before its first look)."""
    path = Path(model)
    if not path.exists():
        raise EvalError(f"{path} does not exist; give a run directory, checkpoint or HF directory")
    check_tokenizer(path)
    if not tasks_checked:
        check_eval_args(tasks, include_path, limit, max_length)
    if is_hf_dir(path):
        return evaluate_hf_dir(path, tasks, include_path, limit, batch_size, device, dtype,
                               max_length)  # fmt: skip
    from llmtrain.export import export

    with tempfile.TemporaryDirectory(prefix="llmtrain-eval-") as tmp:
        hf = export(path, Path(tmp) / "hf", dtype="fp32" if dtype == "float32" else "bf16")
        return evaluate_hf_dir(hf, tasks, include_path, limit, batch_size, device, dtype,
                               max_length)  # fmt: skip


def flat_metrics(res: dict, prefix: str = "eval/") -> dict[str, float]:
    """{'eval/TASK/METRIC': value} of the numbers in a results dict (for metrics.jsonl / TB);
    a metric under a filter other than `none` is METRIC/FILTER (gsm8k's strict-match and
    flexible-extract exact_match would otherwise overwrite each other)."""
    out = {}
    for task, metrics in res["results"].items():
        for key, v in metrics.items():
            name, _, filt = key.partition(",")  # "acc,none" -> "acc"
            if filt and filt != "none" and "stderr" not in name:
                name = f"{name}/{filt}"
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
