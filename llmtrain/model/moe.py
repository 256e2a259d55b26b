"""DeepSeekMoE: a router, fine-grained routed experts, shared experts, dropless dispatch.

Shape legend: T tokens (batch × sequence, flattened), D hidden, F expert width, E routed
experts (El: held by this rank), K experts per token, G groups, M = T·K routed rows, R rows
of a gather, N rows of its source.

Dispatch never builds a dense [T, E] one-hot: the T·K assignments are sorted by expert and
the experts run as one grouped GEMM over contiguous slices (a per-expert loop where grouped_mm
is unavailable). How sorted rows reach the experts is the dispatcher's business: the local one
calls them directly; an expert-parallel one (llmtrain.parallel) all-to-alls rows to the ranks
that own them. This module knows no ranks.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.config import ModelConfig
from llmtrain.model.layers import MLP


class ExpertFn(Protocol):
    def __call__(self, x_MD: torch.Tensor, counts_El: torch.Tensor) -> torch.Tensor: ...


class LocalDispatcher:
    """All experts live here: the sorted rows go straight to the expert computation."""

    ep_size = 1
    ep_rank = 0

    def __call__(self, x_MD: torch.Tensor, counts_E: torch.Tensor, experts: ExpertFn):
        return experts(x_MD, counts_E)


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the shared experts (streams are costly to create)."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


class _GatherRows(torch.autograd.Function):
    """rows = x[idx] where idx reads every row of x `fold` times and back_idx[r·fold + j] is the
    position of row r's j-th copy: the backward is then a gather and a sum over the copies.

    Autograd's backward of x[idx] sorts the index and scatters, and the combine's index_add
    forward scatters with atomics: on an H200 the dispatch's gather-backward and the
    combine's index_add took 16% of a 1B MoE's forward + backward (profile). A permutation's
    inverse is known here, so neither is needed, and the result is deterministic."""

    @staticmethod
    def forward(ctx, x_ND, idx_R, back_idx_R, fold: int):
        ctx.save_for_backward(back_idx_R)
        ctx.fold = fold
        return x_ND.index_select(0, idx_R)

    @staticmethod
    def backward(ctx, g_RD):
        (back_idx_R,) = ctx.saved_tensors
        g_RD = g_RD.index_select(0, back_idx_R)
        if ctx.fold > 1:
            g_RD = g_RD.view(-1, ctx.fold, g_RD.shape[-1]).sum(1)
        return g_RD, None, None, None


def gather_rows(x_ND: torch.Tensor, idx_R: torch.Tensor, back_idx_R: torch.Tensor, fold: int):
    """x_ND[idx_R], differentiable through the inverse index (see `_GatherRows`)."""
    return _GatherRows.apply(x_ND, idx_R, back_idx_R, fold)


def _top(x: torch.Tensor, k: int, by_sort: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest along the last dim, which here is short (experts of
    a group, groups, experts). On CUDA (`by_sort` None) a sort of the row: topk's radix select
    took 4.6 ms of a 1B MoE's 114 ms compiled forward + backward on an H200 (3 calls a layer);
    sorted, the profile shows no routing kernel of its own (Inductor fuses the short sorts). On
    CPU topk, whose choice among exact ties is the reference implementations' (parity tests)."""
    if by_sort if by_sort is not None else x.is_cuda:
        v, i = x.sort(dim=-1, descending=True)
        return v[..., :k].contiguous(), i[..., :k].contiguous()  # as topk's: callers .view them
    return x.topk(k, dim=-1)


class Router(nn.Module):
    """Top-k gate. Selection uses scores + e_score_correction_bias; weights use raw scores.

    Routing runs in fp32 whatever the training precision. DeepSpeed's bf16 mode casts every
    parameter, this weight included (it keeps only buffers in fp32), so the engine hands the
    router the fp32 master copy of its weight (`set_fp32_weight`): the forward then reads those
    exact values and the gradient still flows to the (bf16) parameter the optimizer owns.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        e = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size, dtype=torch.float32))
        # Persistent (HF checkpoints carry it); updated by the aux-loss-free rule, never by grads.
        self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        self.fp32_weight: torch.Tensor | None = None  # not a buffer: no cast, no state_dict
        # exact fp32 values for a weight held in a lower precision before the engine exists
        # (ZeRO-3 builds routers in the training dtype); the engine takes them and clears this
        self.exact_fp32_weight: torch.Tensor | None = None

    def set_fp32_weight(self, w_ED: torch.Tensor | None) -> None:
        """Route with these fp32 values (the optimizer's master weight) while `weight` is not fp32."""
        if w_ED is None:
            self.fp32_weight = None
            return
        w_ED = w_ED.detach().to(self.weight.device, torch.float32)
        if self.fp32_weight is not None and self.fp32_weight.shape == w_ED.shape:
            self.fp32_weight.copy_(w_ED)  # in place: compiled code sees the same tensor each step
        else:
            self.fp32_weight = w_ED.clone()

    def routing_weight(self) -> torch.Tensor:
        """The weight in fp32: the master copy when one was set, with the parameter's gradient."""
        w = self.weight
        if w.dtype == torch.float32:
            return w
        if self.fp32_weight is None or self.fp32_weight.shape != w.shape:
            return w.float()
        # value of the fp32 master, gradient of the parameter (straight through)
        return self.fp32_weight + (w - w.detach()).float()

    def forward(self, x_TD: torch.Tensor):
        cfg = self.cfg
        x = x_TD.float() if x_TD.dtype.itemsize < 4 else x_TD  # routing in >= fp32
        logits_TE = F.linear(x, self.routing_weight().to(x.dtype))
        if cfg.scoring_func == "sigmoid":
            scores_TE = logits_TE.sigmoid()
        else:
            scores_TE = logits_TE.softmax(dim=-1)
        choice_TE = scores_TE.detach() + self.e_score_correction_bias.float()
        if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
            t = choice_TE.shape[0]
            grouped_TGe = choice_TE.view(t, cfg.n_group, -1)
            if cfg.scoring_func == "sigmoid":  # V3: a group scores the sum of its top-2
                group_TG = _top(grouped_TGe, 2)[0].sum(-1)
            else:  # V2 group_limited_greedy: a group scores its best expert
                group_TG = grouped_TGe.max(dim=-1).values
            keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
            keep_TG.scatter_(1, _top(group_TG, cfg.topk_group)[1], True)
            choice_TE = choice_TE.masked_fill(
                ~keep_TG.unsqueeze(-1).expand_as(grouped_TGe).reshape(t, -1), float("-inf")
            )
        idx_TK = _top(choice_TE, cfg.num_experts_per_tok)[1]
        w_TK = scores_TE.gather(1, idx_TK)
        if cfg.norm_topk_prob:
            w_TK = w_TK / (w_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return w_TK * cfg.routed_scaling_factor, idx_TK, scores_TE, logits_TE


def grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch's grouped GEMM needs 16-byte aligned strides; otherwise fall back to the loop.

    Its fast CUDA kernel (and the only one torch.compile can trace) is bf16; other dtypes run
    eagerly (CPU kernels; on CUDA a fallback that reads the offsets on the host)."""
    if not hasattr(F, "grouped_mm") or x.dtype not in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ):
        return False
    if torch.compiler.is_compiling():
        if x.dtype != torch.bfloat16:
            return False
    elif x.is_cuda and (x.data_ptr() % 16 or w.data_ptr() % 16):  # CUDA kernel: 16-B aligned
        return False
    align = 16 // x.element_size()
    return x.shape[-1] % align == 0 and w.shape[-1] % align == 0 and x.dtype == w.dtype


class Experts(nn.Module):
    """Routed experts as stacked weights: w_gate_up [El, D, 2F] (gate | up), w_down [El, F, D]."""

    def __init__(
        self,
        num_local: int,
        hidden: int,
        inner: int,
        impl: str = "auto",
        offset: int = 0,
        total: int = 0,
        param_attrs: dict | None = None,
    ):
        super().__init__()
        self.inner = inner
        self.impl = impl
        self.offset = offset  # global id of the first expert held here (expert parallelism)
        self.total = total or num_local
        self.w_gate_up = nn.Parameter(torch.empty(num_local, hidden, 2 * inner))
        self.w_down = nn.Parameter(torch.empty(num_local, inner, hidden))
        # placement notes from whoever splits the experts (set here, at creation, because a
        # partitioning runtime may take the weights over as soon as this constructor returns)
        for k, v in (param_attrs or {}).items():
            setattr(self.w_gate_up, k, v)
            setattr(self.w_down, k, v)

    def _mm(self, x_MK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor, offs):
        if offs is not None:
            return F.grouped_mm(x_MK, w_EKN, offs=offs)
        outs, start = [], 0
        for e, n in enumerate(counts_E.tolist()):
            if n:
                outs.append(x_MK[start : start + n] @ w_EKN[e])
            start += n
        if not outs:
            return x_MK.new_zeros(0, w_EKN.shape[-1])
        return torch.cat(outs)

    def forward(self, x_MD: torch.Tensor, counts_El: torch.Tensor) -> torch.Tensor:
        """x_MD: rows sorted by local expert, counts_El rows each; returns [M, D] in that order."""
        if x_MD.shape[0] == 0:
            # Nothing routed here. The result still depends on x and the weights so that autograd
            # reaches the all-to-all before it on every rank (else ranks disagree and hang) and
            # the weights get zero gradients rather than none.
            return x_MD * 0.0 + 0.0 * (self.w_gate_up.sum() + self.w_down.sum())
        use_gmm = self.impl in ("auto", "grouped_mm") and grouped_mm_ok(x_MD, self.w_gate_up)
        if self.impl == "grouped_mm" and not use_gmm:
            raise RuntimeError("moe_impl='grouped_mm' but torch grouped_mm cannot run these shapes")
        offs = torch.cumsum(counts_El, 0).to(torch.int32) if use_gmm else None
        h_MF2 = self._mm(x_MD, self.w_gate_up, counts_El, offs)
        a_MF = F.silu(h_MF2[:, : self.inner]) * h_MF2[:, self.inner :]
        return self._mm(a_MF.contiguous(), self.w_down, counts_El, offs)


class MoE(nn.Module):
    """Routed + shared experts on the same normalised input; records per-expert token counts."""

    def __init__(self, cfg: ModelConfig, dispatcher=None):
        super().__init__()
        self.cfg = cfg
        self.dispatcher = dispatcher or LocalDispatcher()
        e_local = cfg.n_routed_experts // self.dispatcher.ep_size
        self.gate = Router(cfg)
        self.experts = Experts(
            e_local, cfg.hidden_size, cfg.moe_intermediate_size, cfg.moe_impl,
            offset=self.dispatcher.ep_rank * e_local, total=cfg.n_routed_experts,
            param_attrs=getattr(self.dispatcher, "expert_param_attrs", None),
        )  # fmt: skip
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts > 0
            else None
        )
        e = cfg.n_routed_experts
        # Token counts for metrics and the bias update: last forward, and summed since the update.
        # fp32 explicitly: exact integer counts up to 2**24 per expert between bias updates.
        self.register_buffer("last_counts", torch.zeros(e, dtype=torch.float32), persistent=False)
        self.register_buffer(
            "load_since_update", torch.zeros(e, dtype=torch.float32), persistent=False
        )
        # a Transformer adds `last_counts` itself after each block's forward (`count_loads`):
        # activation checkpointing runs the forward again in backward, which must not count twice
        self.counts_in_forward = True

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output [B, T, D], auxiliary loss scalar: seq-wise balance + z-loss)."""
        cfg = self.cfg
        b, t, d = x_BTD.shape
        x_TD = x_BTD.reshape(-1, d)
        w_TK, idx_TK, scores_TE, logits_TE = self.gate(x_TD)
        k = idx_TK.shape[1]
        idx_M = idx_TK.reshape(-1)
        # order_M: sorted row -> (token, slot) = t·K + j; sorted_M: its expert
        sorted_M, order_M = idx_M.sort(stable=True)
        token_M = order_M // k
        inv_M = torch.empty_like(order_M).scatter_(  # (token, slot) -> its sorted row
            0, order_M, torch.arange(order_M.numel(), device=order_M.device)
        )
        # rows per expert from where each expert's run starts in the sorted ids. Not bincount:
        # on CUDA it reads the largest id back to size its output (a host sync). Not index_add:
        # on CUDA (compiled: index_put with accumulate) it sorts again and adds each expert's
        # ~T·K/E ones serially, 6.5 ms of a 1B MoE's 92 ms forward + backward on an H200
        bounds_E1 = torch.arange(cfg.n_routed_experts + 1, device=idx_M.device, dtype=idx_M.dtype)
        counts_E = torch.searchsorted(sorted_M, bounds_E1).diff()
        overlap = self.shared_experts is not None and self.overlap_shared(x_TD)
        if overlap:  # shared experts on a side stream while the routed rows are all-to-all'd
            main, side = torch.cuda.current_stream(x_TD.device), _side_stream(x_TD.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared_TD = self.shared_experts(x_TD)
            x_TD.record_stream(side)
        y_MD = self.dispatcher(gather_rows(x_TD, token_M, inv_M, k), counts_E, self.experts)
        y_TKD = gather_rows(y_MD, inv_M, order_M, 1).view(-1, k, d)
        out_TD = (y_TKD * w_TK.unsqueeze(-1).to(y_TKD.dtype)).sum(1).to(x_TD.dtype)
        if overlap:
            main.wait_stream(side)
            shared_TD.record_stream(main)
            out_TD = out_TD + shared_TD
        elif self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)

        with torch.no_grad():
            c = counts_E.to(self.last_counts.dtype)
            self.last_counts.copy_(c)
            if self.training and self.counts_in_forward:
                self.load_since_update.add_(c)

        aux = x_BTD.new_zeros((), dtype=torch.float32)
        if self.training and cfg.aux_loss_alpha > 0:
            aux = aux + cfg.aux_loss_alpha * self.sequence_balance_loss(scores_TE, idx_TK, b, t)
        if self.training and cfg.router_z_loss_coef > 0:
            aux = aux + cfg.router_z_loss_coef * torch.logsumexp(logits_TE, dim=-1).pow(2).mean()
        return out_TD.view(b, t, d), aux

    def overlap_shared(self, x_TD: torch.Tensor) -> bool:
        """Overlap the shared experts with dispatch: CUDA with expert parallelism only (on one
        rank there is no communication to hide, and CPU has no streams)."""
        return x_TD.is_cuda and self.dispatcher.ep_size > 1

    def sequence_balance_loss(self, scores_TE, idx_TK, b: int, t: int) -> torch.Tensor:
        """DeepSeek-V3 eq. 17-20: Σ_i f_i·P_i per sequence, averaged over sequences.

        f_i = E/(K·T) · #tokens of the sequence routed to i; P_i = mean over the sequence of the
        scores normalised to sum 1 over all experts.
        """
        e, k = scores_TE.shape[1], idx_TK.shape[1]
        s_BTE = scores_TE.view(b, t, e)
        p_BE = (s_BTE / s_BTE.sum(-1, keepdim=True)).mean(1)
        hits_BE = torch.zeros(b, e, device=scores_TE.device)
        hits_BE.scatter_add_(1, idx_TK.view(b, t * k), torch.ones(b, t * k, device=hits_BE.device))
        f_BE = hits_BE * (e / (k * t))
        return (f_BE * p_BE).sum(-1).mean()

    def keep_routing_state_fp32(self) -> None:
        """Put the bias and the load counters back in fp32 if something cast them.

        In bf16 the bias loses a γ = 1e-3 step once |bias| >= 0.5 and counts round above 256.
        Buffers are never partitioned by ZeRO, so restoring them after a cast is safe.
        """
        for owner, name in (
            (self.gate, "e_score_correction_bias"),
            (self, "last_counts"),
            (self, "load_since_update"),
        ):
            b = getattr(owner, name)
            if b.dtype != torch.float32:
                setattr(owner, name, b.float())

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing: bias += γ·sign(mean load − load); resets the accumulator.

        Pass `load_E` already summed over data-parallel ranks so every rank applies the same step.
        """
        load = self.load_since_update if load_E is None else load_E
        # float64: a global load passes 2**24 at DeepSeek-V3's batch, where fp32 sums would depend
        # on the reduction order; up to 2**53 every rank computes the same sign exactly
        load = load.to(device=self.load_since_update.device, dtype=torch.float64)
        gamma = self.cfg.bias_update_speed
        if gamma > 0:  # no load at all (a skipped step) gives sign(0) = 0: no host sync to test it
            bias = self.gate.e_score_correction_bias
            bias.add_((gamma * torch.sign(load.mean() - load)).to(bias.dtype))
        self.load_since_update.zero_()
