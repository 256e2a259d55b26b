"""Expert parallelism: rows sorted by expert travel to the ranks owning those experts and back.

Shape legend: M routed rows on this rank, R rows received, D hidden, E experts,
El = E / ep experts per rank, P = ep ranks of the expert-parallel group.

Dropless: uneven splits are exchanged with all_to_all_single; nothing is padded or dropped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x_MD, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x_MD.new_empty((sum(out_splits), x_MD.shape[1]))
        dist.all_to_all_single(out, x_MD.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        gx = g.new_empty((sum(in_splits), g.shape[1]))
        dist.all_to_all_single(gx, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return gx, None, None, None


class ExpertParallelDispatcher:
    """Sends each row to the rank holding its expert (rank r holds experts r·El … r·El+El−1)."""

    def __init__(self, group, ep_size: int, ep_rank: int):
        self.group, self.ep_size, self.ep_rank = group, ep_size, ep_rank

    def __call__(self, x_MD: torch.Tensor, counts_E: torch.Tensor, experts) -> torch.Tensor:
        p = self.ep_size
        el = counts_E.numel() // p
        gathered = [torch.empty_like(counts_E) for _ in range(p)]
        dist.all_gather(gathered, counts_E, group=self.group)
        # recv_PEl[s, e]: rows rank s sends for my local expert e
        recv_PEl = torch.stack(gathered)[:, self.ep_rank * el : (self.ep_rank + 1) * el]
        send = counts_E.view(p, el).sum(1).tolist()
        recv = recv_PEl.sum(1).tolist()
        x_RD = _AllToAll.apply(x_MD, recv, send, self.group)
        # received rows are grouped by source rank, then expert: regroup by expert
        local_R = torch.repeat_interleave(
            torch.arange(el, device=x_MD.device).repeat(p), recv_PEl.reshape(-1).to(x_MD.device)
        )
        order_R = torch.argsort(local_R, stable=True)
        y_RD = experts(x_RD[order_R], recv_PEl.sum(0).to(x_MD.device))
        y_back = torch.empty_like(y_RD).index_copy(0, order_R, y_RD)
        return _AllToAll.apply(y_back, send, recv, self.group)
