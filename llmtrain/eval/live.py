"""lm-evaluation-harness on the model being trained, on every rank, with nothing gathered.

Why: exporting the whole model to rank 0 and loading it in transformers needs one process to
hold all the weights (1.3 TB in fp32 at 671B) while the other ranks wait. Here the harness runs
on every rank against the training model itself, as sharded as it trains (ZeRO-3 partitions,
experts on their expert-parallel ranks). Every rank builds the same request list; the
log-likelihood requests are dealt round-robin over the ranks by length (each runs its share,
padded with one-token forwards so that every rank joins the same number of forwards, hence the
same collectives) and the scores are all-gathered. Generation requests are dealt the same way:
each rank decodes its share greedily, in batches, left-padded to the longest context on any rank
(the same prefill forwards everywhere), and decodes on until every rank's batch has stopped (one
flag all-reduced per token); the texts are all-gathered.
Anything that would fail on one rank (a continuation longer than the context, a sampling task)
is checked on the request list, which every rank holds, so every rank raises the same error.

Scoring follows the harness's own `HFLM` for causal models: the same pair encoding (inherited
from `TemplateLM`), truncation of the left context to `max_length`, rolling windows, generation
arguments and stop-sequence handling; `tests/test_eval.py` checks the scores against `HFLM` on
the exported model. Documents are conditioned on the end-of-text token and encoded without
special tokens, as training packs them; HFLM prefers a BOS token when the tokenizer has one.
Logits are computed only at the positions scored (`logits_at`), and turned into fp32
log-probabilities `ROWS` positions at a time.

Shape legend: B batch, T tokens, N scored positions, V vocabulary.
"""

from __future__ import annotations

import random
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from llmtrain.eval import EvalError
from llmtrain.model.attention import MLACache
from llmtrain.model.generate import PREFILL, decode_step, prefill
from llmtrain.parallel import comm

DEFAULT_MAX_GEN_TOKS = 256  # HFLM's


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def generation_args(gen_kwargs: dict | None, max_length: int, eos_text: str) -> tuple:
    """(until, max_gen_toks) as HFLM reads a request's generation_kwargs; EvalError for what
    greedy decoding within `max_length` cannot do."""
    kw = normalize_gen_kwargs(dict(gen_kwargs or {}), DEFAULT_MAX_GEN_TOKS)
    if kw.get("do_sample"):
        raise EvalError(
            "evaluation on the training model (periodic, --sharded) decodes greedily, but a task "
            "samples (do_sample: true or temperature > 0); set do_sample: false in its "
            "generation_kwargs, or evaluate it through the export (llmtrain eval, no --sharded)"
        )
    max_gen = int(kw["max_gen_toks"])
    if max_gen >= max_length:
        raise EvalError(
            f"a task generates up to {max_gen} tokens but contexts are {max_length} tokens "
            "(train.seq_len); lower its max_gen_toks or raise train.seq_len"
        )
    return handle_stop_sequences(kw.get("until"), eos=eos_text), max_gen


class TrainingModelLM(TemplateLM):
    """The harness's model interface over our (possibly sharded) model and a `tokenizers`
    tokenizer. `forward(x_BT, rows_N) -> logits_NV` defaults to `model(x, logits_at=rows)`;
    all ranks must make the same calls (the harness is deterministic given the same tasks and
    limit)."""

    ROWS = 1024  # positions turned into fp32 log-probabilities at once
    PREFILL = PREFILL  # context tokens per forward when generating (a test sets a small one)

    def __init__(self, model, tokenizer, eot_id: int, max_length: int, batch_size: int = 8,
                 device: torch.device | str = "cpu", forward=None):  # fmt: skip
        super().__init__()
        self.model = model
        self.tok = tokenizer
        self._eot = int(eot_id)
        self._max_length = int(max_length)
        self.batch_size = max(1, int(batch_size))
        self._device = torch.device(device)
        self._forward = forward or (lambda x_BT, rows_N: model(x_BT, logits_at=rows_N).logits)
        self.my_rank, self.n_ranks = _world()

    # ------------------------------------------------------------ the harness's interface

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        return self.tok.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(tokens, skip_special_tokens=skip_special_tokens)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.my_rank != 0)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
        """[(logprob, is_greedy)] of each continuation given its context, in request order."""
        inputs = []
        for _, ctx, cont in requests:  # every rank checks every request: errors are on all
            if not ctx or not cont or len(cont) > self.max_length:
                raise EvalError(
                    f"a request has {len(ctx)} context and {len(cont)} continuation tokens; "
                    f"both must be non-empty and the continuation at most {self.max_length} "
                    "(train.seq_len)"
                )
            whole = (list(ctx) + list(cont))[-(self.max_length + 1) :]
            inputs.append((whole[:-1], list(cont)))
        # longest first, like HFLM's collator (memory trouble shows on the first batch), dealt
        # round-robin so that every rank gets its share of the long ones
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i][0]))
        mine = order[self.my_rank :: self.n_ranks]
        per = -(-len(order) // self.n_ranks)
        got = torch.zeros(per, 2, dtype=torch.float64)
        for b in range(0, per, self.batch_size):
            batch = [inputs[i] for i in mine[b : b + self.batch_size]]
            for j, res in enumerate(self._score(batch or [([self._eot], [])])):
                if j < len(batch):
                    got[b + j] = torch.tensor(res, dtype=torch.float64)
        if self.n_ranks > 1:
            got = torch.cat(comm.all_gather(got))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(inputs)
        for r in range(self.n_ranks):  # rank r's slot j holds order[r + j * n_ranks]
            for j, i in enumerate(order[r :: self.n_ranks]):
                out[i] = (float(got[r * per + j, 0]), bool(got[r * per + j, 1] > 0.5))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Summed log-likelihood of each whole text over disjoint windows of `max_length`, each
        conditioned on the token before it (the first on the end-of-text token), as HFLM."""
        windows, counts = [], []
        for (text,) in (r.args for r in requests):
            ws = [
                lm_utils.make_disjoint_window(w)
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1,
                )
            ]  # fmt: skip
            windows += [(None, ctx, cont) for ctx, cont in ws]
            counts.append(len(ws))
        scores = self._loglikelihood_tokens(windows)
        out, at = [], 0
        for n in counts:
            out.append(sum(s for s, _ in scores[at : at + n]))
            at += n
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations cut at the first stop sequence, as HFLM's: requests with the
        same generation arguments go in batches of `batch_size`, longest context first."""
        eos_text = self.tok_decode([self._eot], skip_special_tokens=False)
        args = [r.args for r in requests]
        groups: dict[str, list[int]] = {}
        for i, (_, kw) in enumerate(args):
            groups.setdefault(repr(sorted((kw or {}).items())), []).append(i)
        mine: dict[int, str] = {}
        for idx in groups.values():
            until, max_gen = generation_args(args[idx[0]][1], self.max_length, eos_text)
            ctx = {i: self.tok_encode(args[i][0])[-(self.max_length - max_gen) :] for i in idx}
            idx = sorted(idx, key=lambda i: -len(ctx[i]))
            share = idx[self.my_rank :: self.n_ranks]  # round-robin: the long ones spread out
            per = -(-len(idx) // self.n_ranks)  # the same number of batches on every rank
            for b in range(0, per, self.batch_size):
                part = share[b : b + self.batch_size]
                # a rank out of requests joins the forwards with one end-of-text token
                news = self._greedy([ctx[i] for i in part] or [[self._eot]], max_gen, until,
                                    idle=not part)  # fmt: skip
                for i, new in zip(part, news):
                    mine[i] = postprocess_generated_text(self.tok_decode(new), until, None)
        out = [""] * len(args)
        for got in comm.all_gather_object(mine) if self.n_ranks > 1 else [mine]:
            for i, text in got.items():
                out[i] = text
        return out

    # ------------------------------------------------------------ helpers

    @torch.no_grad()
    def _score(self, batch: list[tuple[list[int], list[int]]]) -> list[tuple[float, float]]:
        """One right-padded forward; causal attention keeps padding out of the real positions,
        and logits are taken at the continuations' positions only."""
        longest = max(len(x) for x, _ in batch)
        x_BT = torch.full((len(batch), longest), self._eot, dtype=torch.long)
        rows, spans = [], []
        for j, (x, cont) in enumerate(batch):
            x_BT[j, : len(x)] = torch.tensor(x, dtype=torch.long)
            first = j * longest + len(x) - len(cont)
            spans.append((len(rows), len(rows) + len(cont)))
            rows += range(first, first + len(cont))
        rows_N = torch.tensor(rows, dtype=torch.long, device=self._device)
        logits_NV = self._forward(x_BT.to(self._device), rows_N)
        want_N = torch.tensor([t for _, cont in batch for t in cont], dtype=torch.long)
        want_N = want_N.to(logits_NV.device)
        res = []
        for a0, a1 in spans:
            total, greedy = 0.0, True
            for a in range(a0, a1, self.ROWS):
                b = min(a + self.ROWS, a1)
                lp_NV = F.log_softmax(logits_NV[a:b].float(), dim=-1)
                total += float(lp_NV.gather(-1, want_N[a:b, None]).sum())
                greedy = greedy and bool((lp_NV.argmax(-1) == want_N[a:b]).all())
            res.append((total, float(greedy)))
        return res

    @torch.no_grad()
    def _greedy(self, ids: list[list[int]], max_new: int, until: list[str],
                idle: bool = False) -> list[list[int]]:  # fmt: skip
        """Greedy decoding of this rank's batch against the latent cache, in step with the other
        ranks: a sharded model's forward is collective, so every rank pads to the longest
        context on any rank and decodes until every rank's batch has stopped. Contexts are
        left-padded and go in PREFILL tokens a forward (llmtrain.model.generate.prefill: pads
        masked out, positions of real tokens only, one row of logits a sequence). `idle`: a
        stand-in batch (this rank has no requests left) that only joins the forwards, stopped
        from the start."""
        n, longest = len(ids), max(len(x) for x in ids)
        if self.n_ranks > 1:
            longest = int(comm.all_reduce(torch.tensor([longest]), op=dist.ReduceOp.MAX))
        dev = self._device
        x_BL = torch.full((n, longest), self._eot, dtype=torch.long)
        real_BL = torch.zeros(n, longest, dtype=torch.bool)
        for j, x in enumerate(ids):
            x_BL[j, longest - len(x) :] = torch.tensor(x, dtype=torch.long)
            real_BL[j, longest - len(x) :] = True
        x_BL, real_BL = x_BL.to(dev), real_BL.to(dev)
        cache = MLACache(self.model.cfg.num_layers)
        logits_BV, state = prefill(self.model, x_BL, real_BL, cache, self.PREFILL)
        new: list[list[int]] = [[] for _ in range(n)]
        done = [idle] * n
        for _ in range(max_new):
            nxt_B = logits_BV.argmax(-1)
            for j, t in enumerate(nxt_B.tolist()):
                if done[j]:
                    continue
                new[j].append(t)
                # HF's stop criterion: the decoded tail (special tokens kept) holds a stop string
                tail = self.tok_decode(new[j], skip_special_tokens=False)
                done[j] = t == self._eot or any(s in tail for s in until if s)
            running = torch.tensor([0 if all(done) else 1])
            if self.n_ranks > 1:  # every rank's batch stopped: all leave the loop together
                comm.all_reduce(running)
            if not int(running):
                break
            logits_BV, state = decode_step(self.model, nxt_B, cache, state)
        return new


@contextmanager
def kept_rng_state():
    """The harness seeds Python, NumPy and torch; training's own random streams must not move."""
    py, npy, th = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(th)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def engine_lm(model, engine, tokenizer_file, max_length: int, batch_size: int, device):
    """The harness's model over a (sharded) training engine: periodic evaluation and
    `llmtrain eval --sharded` both score through it, as validation does."""
    from tokenizers import Tokenizer

    from llmtrain.data.tokenizer import eos_id

    tok = Tokenizer.from_file(str(tokenizer_file))

    def forward(x_BT, rows_N):  # through the engine: ZeRO-3 gathers each layer in turn
        return engine(x_BT, logits_at=rows_N).logits

    return TrainingModelLM(model, tok, eos_id(tok), max_length=max_length, batch_size=batch_size,
                           device=device, forward=forward)  # fmt: skip


_TASK_MANAGERS: dict = {}


def cached_task_manager(tasks: list[str], include_path: list[str] | None = None):
    """`task_manager`, built once per process for the same tasks: indexing takes seconds."""
    from llmtrain.eval import task_manager

    key = (tuple(tasks), tuple(include_path or ()))
    if key not in _TASK_MANAGERS:
        _TASK_MANAGERS[key] = task_manager(list(tasks), include_path)
    return _TASK_MANAGERS[key]


def check_tasks(
    tasks: list[str],
    max_length: int | None,
    include_path: list[str] | None = None,
    greedy: bool = True,
) -> None:
    """Load the tasks (their data included), render each one's first document, and, for our
    greedy decoding (`greedy`: periodic and sharded evaluation), check that generation tasks do
    not sample and fit in `max_length` (None: any length): before training or an evaluation, so
    that a bad task fails at once rather than at the first evaluation."""
    from llmtrain.eval import task_errors

    tm = cached_task_manager(list(tasks), include_path)
    with kept_rng_state(), task_errors(list(tasks)):
        loaded = tm.load(list(tasks))["tasks"]
        for name, task in loaded.items():
            if not hasattr(task, "config"):  # a group's entry, not a task
                continue
            with task_errors([name]):
                _render_first(task)
            if task.config.output_type == "generate_until" and greedy:
                try:
                    generation_args(task.config.generation_kwargs, max_length or 2**62, "")
                except EvalError as e:
                    raise EvalError(f"task {name}: {e}") from None


def _render_first(task) -> None:
    """The first document through the task's templates: a field name the documents lack fails
    here, not after the model has been loaded."""
    docs = task.eval_docs
    doc = next(iter(docs), None)
    if doc is None:
        raise EvalError(f"task {task.config.task}: no documents to evaluate")
    task.doc_to_text(doc)
    task.doc_to_target(doc)
    if task.config.output_type == "multiple_choice":
        task.doc_to_choice(doc)


@contextmanager
def no_environment_report():
    """simple_evaluate's report of the environment (torch's collect_env, git, nvidia-smi in
    subprocesses: 0.6-2 s) is thrown away here (only "results" is read), and during training the
    other ranks would wait for it at every periodic evaluation."""
    import lm_eval.evaluator as ev

    saved = ev.add_env_info, ev.get_git_commit_hash
    ev.add_env_info, ev.get_git_commit_hash = (lambda results: None), (lambda: None)
    try:
        yield
    finally:
        ev.add_env_info, ev.get_git_commit_hash = saved


def evaluate_live(lm: TrainingModelLM, tasks: list[str], limit: int | None = None,
                  include_path: list[str] | None = None) -> dict:  # fmt: skip
    """The harness's results dict for `lm`. Every rank calls it; rank 0 gets the whole dict,
    the others its "results" (the scores)."""
    import lm_eval

    from llmtrain.eval import task_errors

    tm = cached_task_manager(list(tasks), include_path)
    with kept_rng_state(), task_errors(list(tasks)), no_environment_report():
        res = lm_eval.simple_evaluate(
            model=lm, tasks=list(tasks), task_manager=tm, limit=limit, log_samples=False,
            bootstrap_iters=0, verbosity="WARNING",
        )  # fmt: skip
    rank, world = _world()
    if world > 1:  # the harness returns results where LOCAL_RANK == 0 only: take global rank 0's
        got = comm.broadcast_object({"results": res["results"]} if rank == 0 else None, src=0)
        res = res if rank == 0 else got
    if res is None:
        raise EvalError("the harness returned no results")
    return res
