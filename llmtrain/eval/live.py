"""lm-evaluation-harness on the model being trained, on every rank, with nothing gathered.

Why: exporting the whole model to rank 0 and loading it in transformers needs one process to
hold all the weights (1.3 TB in fp32 at 671B) while the other ranks wait. Here the harness runs
on every rank against the training model itself, as sharded as it trains (ZeRO-3 partitions,
experts on their expert-parallel ranks). Every rank builds the same request list; the
log-likelihood requests are split across ranks (each runs its share, padded with one-token
forwards so that every rank joins the same number of forwards, hence the same collectives) and
the scores are all-gathered. Greedy generation runs every request on every rank, with rank 0's
token broadcast at each step so that every rank stops at the same point.

Scoring follows the harness's own `HFLM` for causal models: the same pair encoding (inherited
from `TemplateLM`), prefix token (end-of-text), truncation of the left context to `max_length`,
rolling windows and stop-sequence handling; `tests/test_eval.py` checks the scores against
`HFLM` on the exported model.

Shape legend: B batch, T tokens, V vocabulary.
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

from llmtrain.model.attention import MLACache
from llmtrain.parallel import comm


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class TrainingModelLM(TemplateLM):
    """The harness's model interface over our (possibly sharded) model and a `tokenizers`
    tokenizer. `forward(x_BT) -> logits_BTV` defaults to `model(x).logits`; all ranks must
    make the same calls (the harness is deterministic given the same tasks and limit)."""

    ROWS = 1024  # positions turned into fp32 log-probabilities at once

    def __init__(self, model, tokenizer, eot_id: int, max_length: int, batch_size: int = 8,
                 device: torch.device | str = "cpu", forward=None):  # fmt: skip
        super().__init__()
        self.model = model
        self.tok = tokenizer
        self._eot = int(eot_id)
        self._max_length = int(max_length)
        self.batch_size = max(1, int(batch_size))
        self._device = torch.device(device)
        self._forward = forward or (lambda x_BT: model(x_BT).logits)
        self.my_rank, self.n_ranks = _world()

    # ------------------------------------------------------------ the harness's interface

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        # HFLM encodes without special tokens for causal models (no BOS unless asked)
        return self.tok.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=False)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
        """[(logprob, is_greedy)] of each continuation given its context, in request order."""
        inputs = []
        for _, ctx, cont in requests:
            whole = (list(ctx) + list(cont))[-(self.max_length + 1) :]
            inputs.append((whole[:-1], list(cont)))
        # longest first, like HFLM's collator: any out-of-memory shows up on the first batch
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i][0]))
        per = -(-len(order) // self.n_ranks)
        mine = order[self.my_rank * per : (self.my_rank + 1) * per]
        got = torch.zeros(per, 2, dtype=torch.float64)
        for b in range(0, per, self.batch_size):
            idx = mine[b : b + self.batch_size]
            batch = [inputs[i] for i in idx] or [([self._eot], [])]  # a rank with nothing left
            for j, res in enumerate(self._score(batch)):
                if j < len(idx):
                    got[b + j] = torch.tensor(res, dtype=torch.float64)
        if self.n_ranks > 1:
            got = torch.cat(comm.all_gather(got))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(inputs)
        for k, i in enumerate(order):  # rank r's slot j holds order[r * per + j]
            out[i] = (float(got[k, 0]), bool(got[k, 1] > 0.5))
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
        """Greedy continuations cut at the first stop sequence (default: the end-of-text text)."""
        out = []
        for ctx, kwargs in (r.args for r in requests):
            kwargs = dict(kwargs or {})
            if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
                raise ValueError("periodic evaluation generates greedily; use do_sample: false")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            eot_text = self.tok_decode([self._eot])
            if eot_text not in until:
                until.append(eot_text)
            max_new = int(kwargs.get("max_gen_toks", 256))
            ids = self.tok_encode(ctx)[-max(1, self.max_length - max_new) :]
            text = self.tok_decode(self._greedy(ids, max_new, until))
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            out.append(text)
        return out

    # ------------------------------------------------------------ helpers

    @torch.no_grad()
    def _score(self, batch: list[tuple[list[int], list[int]]]) -> list[tuple[float, float]]:
        """One right-padded forward; causal attention keeps padding out of the real positions."""
        longest = max(len(x) for x, _ in batch)
        x_BT = torch.full((len(batch), longest), self._eot, dtype=torch.long)
        for j, (x, _) in enumerate(batch):
            x_BT[j, : len(x)] = torch.tensor(x, dtype=torch.long)
        logits_BTV = self._forward(x_BT.to(self._device))
        res = []
        for j, (x, cont) in enumerate(batch):
            if not cont:
                res.append((0.0, 0.0))
                continue
            # only the continuation's rows, in fp32 a block at a time: [B, T, V] in fp32 (HFLM's
            # way) is 17 GB at T = 4096, V = 129K, B = 8
            start = len(x) - len(cont)
            cont_T = torch.tensor(cont, dtype=torch.long, device=logits_BTV.device)
            total, greedy = 0.0, True
            for a in range(0, len(cont), self.ROWS):
                b = min(a + self.ROWS, len(cont))  # rows past the continuation are padding
                lp_TV = F.log_softmax(logits_BTV[j, start + a : start + b].float(), dim=-1)
                want_T = cont_T[a:b]
                total += float(lp_TV.gather(-1, want_T[:, None]).sum())
                greedy = greedy and bool((lp_TV.argmax(-1) == want_T).all())
            res.append((total, float(greedy)))
        return res

    @torch.no_grad()
    def _greedy(self, ids: list[int], max_new: int, until: list[str]) -> list[int]:
        """Greedy decoding against the latent cache; every rank takes rank 0's token."""
        cache = MLACache(self.model.cfg.num_layers)
        feed = torch.tensor([ids], dtype=torch.long, device=self._device)
        new: list[int] = []
        for _ in range(max_new):
            nxt = self.model(feed, cache=cache).logits[:, -1].argmax(-1)
            if self.n_ranks > 1:
                comm.broadcast(nxt, src=0)
            new.append(int(nxt))
            if new[-1] == self._eot:
                break
            text = self.tok_decode(new)
            if any(s and s in text for s in until):
                break
            feed = nxt[:, None]
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


_TASK_MANAGERS: dict = {}


def cached_task_manager(tasks: list[str], include_path: list[str] | None = None):
    """`task_manager`, built once per process for the same tasks: indexing takes seconds."""
    from llmtrain.eval import task_manager

    key = (tuple(tasks), tuple(include_path or ()))
    if key not in _TASK_MANAGERS:
        _TASK_MANAGERS[key] = task_manager(list(tasks), include_path)
    return _TASK_MANAGERS[key]


def evaluate_live(lm: TrainingModelLM, tasks: list[str], limit: int | None = None,
                  include_path: list[str] | None = None) -> dict:  # fmt: skip
    """The harness's results dict for `lm`. Every rank calls it; rank 0 gets the whole dict,
    the others its "results" (the scores)."""
    import lm_eval

    from llmtrain.eval import EvalError

    tm = cached_task_manager(list(tasks), include_path)
    with kept_rng_state():
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
