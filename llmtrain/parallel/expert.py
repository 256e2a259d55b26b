"""Expert parallelism: rows sorted by expert travel to the ranks owning those experts and back.

Shape legend: M routed rows on this rank, R rows received, D hidden, E experts,
El = E / ep experts per rank, P = ep ranks of the expert-parallel group.

Dropless: uneven splits are exchanged with all_to_all_single; nothing is padded or dropped.
The split sizes must be known on the host, so each call syncs the host exactly once: one
all-to-all of per-expert counts (on the device), then one copy of the send and receive sizes
together. Everything else (regrouping by expert, expert offsets) stays on the device.
"""

from __future__ import annotations

import torch

from llmtrain.model.moe import gather_rows
from llmtrain.parallel import comm


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x_MD, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return comm.all_to_all_single(x_MD, out_splits, in_splits, group=group)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return comm.all_to_all_single(g, in_splits, out_splits, group=ctx.group), None, None, None


class ExpertParallelDispatcher:
    """Sends each row to the rank holding its expert (rank r holds experts r·El … r·El+El−1)."""

    def __init__(self, group, ep_size: int, ep_rank: int):
        self.group, self.ep_size, self.ep_rank = group, ep_size, ep_rank

    def exchange_counts(self, counts_E: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """recv_PEl[s, e]: rows rank s sends for my local expert e (on the device); and the
        rows sent to / received from each rank, on the host (the one host sync)."""
        p = self.ep_size
        el = counts_E.numel() // p
        # rank r gets my counts for its experts: an even all-to-all of P·El integers
        recv_PEl = comm.all_to_all_single(counts_E, [el] * p, [el] * p, self.group).view(p, el)
        sizes = torch.cat([counts_E.view(p, el).sum(1), recv_PEl.sum(1)]).tolist()
        return recv_PEl, sizes[:p], sizes[p:]

    def __call__(self, x_MD: torch.Tensor, counts_E: torch.Tensor, experts) -> torch.Tensor:
        p = self.ep_size
        el = counts_E.numel() // p
        recv_PEl, send, recv = self.exchange_counts(counts_E)
        x_RD = _AllToAll.apply(x_MD, recv, send, self.group)
        # received rows are grouped by source rank, then expert: regroup by expert
        local_R = torch.repeat_interleave(
            torch.arange(el, device=x_MD.device).repeat(p),
            recv_PEl.reshape(-1),
            output_size=sum(recv),  # known on the host: no hidden sync
        )
        order_R = torch.argsort(local_R, stable=True)
        # both reorders through the permutation and its inverse: gathers forward and backward
        # (x[order]'s backward would sort and scatter, as moe.gather_rows explains)
        inv_R = torch.empty_like(order_R).scatter_(
            0, order_R, torch.arange(order_R.numel(), device=order_R.device)
        )
        y_RD = experts(gather_rows(x_RD, order_R, inv_R, 1), recv_PEl.sum(0))
        y_back = gather_rows(y_RD, inv_R, order_R, 1)
        return _AllToAll.apply(y_back, send, recv, self.group)
