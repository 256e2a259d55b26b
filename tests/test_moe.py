import dataclasses

import pytest
import torch

from llmtrain.config import ModelConfig
from llmtrain.model.moe import MoE


def _cfg(**kw):
    base = dict(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.0)  # fmt: skip
    base.update(kw)
    c = ModelConfig(**base)
    c.validate()
    return c


def _moe(cfg, seed=0):
    torch.manual_seed(seed)
    m = MoE(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
        m.gate.e_score_correction_bias.normal_(0, 0.1)
    return m


def _dense_reference(m: MoE, x_BTD):
    """Every token through its experts one by one: the slow, obvious computation."""
    x = x_BTD.reshape(-1, x_BTD.shape[-1])
    w, idx, _, _ = m.gate(x)
    f = m.cfg.moe_intermediate_size
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            h = x[t] @ m.experts.w_gate_up[e]
            out[t] += w[t, j] * ((torch.nn.functional.silu(h[:f]) * h[f:]) @ m.experts.w_down[e])
    if m.shared_experts is not None:
        out = out + m.shared_experts(x)
    return out.view_as(x_BTD)


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_dispatch_matches_per_token_reference_with_grads(impl, scoring):
    cfg = _cfg(moe_impl=impl, scoring_func=scoring)
    m = _moe(cfg)
    x = torch.randn(2, 7, 32, requires_grad=True)
    y, _ = m(x)
    ref = _dense_reference(m, x)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    gy = torch.autograd.grad((y * g).sum(), [x, m.experts.w_gate_up, m.gate.weight])
    gr = torch.autograd.grad((ref * g).sum(), [x, m.experts.w_gate_up, m.gate.weight])
    for a, b in zip(gy, gr):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_grouped_mm_and_loop_agree():
    cfg = _cfg()
    a = _moe(dataclasses.replace(cfg, moe_impl="grouped_mm"))
    b = _moe(dataclasses.replace(cfg, moe_impl="loop"))
    x = torch.randn(3, 11, 32)
    torch.testing.assert_close(a(x)[0], b(x)[0], atol=1e-5, rtol=1e-5)


def test_counts_reported_and_bias_only_affects_selection():
    cfg = _cfg(n_group=1, topk_group=1)
    m = _moe(cfg)
    x = torch.randn(4, 16, 32)
    m.train()
    m(x)
    assert m.last_counts.sum() == 4 * 16 * 2
    assert torch.equal(m.load_since_update, m.last_counts)
    # a huge bias on expert 0 makes every token pick it, yet its weight stays the raw score
    with torch.no_grad():
        m.gate.e_score_correction_bias.zero_()
        m.gate.e_score_correction_bias[0] = 100.0
    w, idx, scores, _ = m.gate(x.reshape(-1, 32))
    assert (idx == 0).any(dim=1).all()
    raw = scores.gather(1, idx)
    torch.testing.assert_close(w, raw / raw.sum(-1, keepdim=True) * cfg.routed_scaling_factor)


def test_aux_loss_free_bias_update_rule():
    cfg = _cfg(bias_update_speed=0.01)
    m = _moe(cfg)
    with torch.no_grad():
        m.gate.e_score_correction_bias.zero_()
    load = torch.tensor([10.0, 0, 5, 5, 5, 5, 5, 5])  # mean 5
    m.update_bias(load)
    expect = torch.tensor([-0.01, 0.01, 0, 0, 0, 0, 0, 0])
    torch.testing.assert_close(m.gate.e_score_correction_bias, expect)
    assert m.load_since_update.sum() == 0


def test_bias_update_balances_load_over_steps():
    cfg = _cfg(bias_update_speed=0.02, n_group=1, topk_group=1, num_experts_per_tok=1)
    m = _moe(cfg)
    with torch.no_grad():
        m.gate.weight[0] += 2.0  # expert 0 is everybody's favourite
        m.gate.e_score_correction_bias.zero_()
    m.train()
    x = torch.randn(8, 32, 32)
    m(x)
    first = m.last_counts.max() / m.last_counts.mean()
    for _ in range(150):
        m(x)
        m.update_bias()
    last = m.last_counts.max() / m.last_counts.mean()
    assert last < first and last < 2.0


def test_sequence_balance_loss_formula():
    cfg = _cfg(aux_loss_alpha=0.5)
    m = _moe(cfg)
    b, t = 2, 5
    x = torch.randn(b, t, 32)
    m.train()
    _, aux = m(x)
    _, idx, scores, _ = m.gate(x.reshape(-1, 32))
    e, k = 8, 2
    total = 0.0
    for s in range(b):
        sl = slice(s * t, (s + 1) * t)
        f = torch.zeros(e)
        for i in idx[sl].reshape(-1):
            f[i] += e / (k * t)
        p = (scores[sl] / scores[sl].sum(-1, keepdim=True)).mean(0)
        total += (f * p).sum()
    torch.testing.assert_close(aux, 0.5 * total / b)
    assert aux.requires_grad


def test_z_loss_and_no_aux_in_eval():
    m = _moe(_cfg(router_z_loss_coef=1e-3))
    x = torch.randn(2, 4, 32)
    m.train()
    assert m(x)[1] > 0
    m.eval()
    assert m(x)[1] == 0


def test_load_counts_once_under_activation_checkpointing(debug_cfg):
    """The recompute in backward runs each checkpointed block's forward again: the routed-token
    counts behind the bias update (and their 2**24 exact-count headroom) count once."""
    import dataclasses

    from llmtrain.model import build_model

    cfg = dataclasses.replace(debug_cfg.model, mtp_depth=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    got = {}
    for ckpt in (False, True):
        m = build_model(cfg, seed=0)
        m.train()
        m.gradient_checkpointing = ckpt
        m(ids[:, :-1], labels=ids[:, 1:]).loss.backward()
        got[ckpt] = [int(x.load_since_update.sum()) for x in m.moe_layers()]
    k = cfg.num_experts_per_tok
    assert got[False] == got[True] == [2 * 32 * k] * (len(got[True]) - 1) + [2 * 31 * k]


def test_gather_rows_matches_autograd_index_for_dispatch_and_combine():
    """The dispatch gather (each token read K times) and the combine gather (a permutation)
    give autograd's values and gradients through their inverse-index backward."""
    from llmtrain.model.moe import gather_rows

    g = torch.Generator().manual_seed(0)
    t, k, d, e = 37, 3, 5, 6
    idx_M = torch.randint(0, e, (t * k,), generator=g)
    order_M = torch.argsort(idx_M, stable=True)
    inv_M = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(t * k))
    x = torch.randn(t, d, dtype=torch.float64, generator=g, requires_grad=True)
    gy = torch.randn(t * k, d, dtype=torch.float64, generator=g)
    ours = gather_rows(x, order_M // k, inv_M, k)
    ref = x[order_M // k]
    assert torch.equal(ours, ref)
    (ga,) = torch.autograd.grad(ours, x, gy)
    (gb,) = torch.autograd.grad(ref, x, gy)
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-12)

    y = torch.randn(t * k, d, dtype=torch.float64, generator=g, requires_grad=True)
    ours = gather_rows(y, inv_M, order_M, 1)
    ref = y[inv_M]
    assert torch.equal(ours, ref)
    (ga,) = torch.autograd.grad(ours, y, gy)
    (gb,) = torch.autograd.grad(ref, y, gy)
    assert torch.equal(ga, gb)  # a permutation: each gradient row is copied, not summed
    assert torch.autograd.gradcheck(lambda v: gather_rows(v, order_M // k, inv_M, k), (x,))


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_sort_routing_cuda_takes_matches_topk(scoring, monkeypatch):
    """The routing CUDA takes (a row sort, `_top(by_sort=True)`), run here on CPU: the same
    experts, outputs and gradients as topk, group-limited routing and the balance loss included
    (whose .view needs the indices contiguous, as topk returns them)."""
    from llmtrain.model import moe as M

    cfg = _cfg(scoring_func=scoring, n_group=2, topk_group=1, aux_loss_alpha=0.01)
    m = _moe(cfg)
    m.train()
    x = torch.randn(2, 9, 32, requires_grad=True)
    ref = m(x)
    ref_g = torch.autograd.grad(ref[0].square().sum() + ref[1], [x, m.gate.weight])
    top = M._top
    monkeypatch.setattr(M, "_top", lambda v, k: top(v, k, by_sort=True))
    got = m(x)
    got_g = torch.autograd.grad(got[0].square().sum() + got[1], [x, m.gate.weight])
    for a, b in zip((*got, *got_g), (*ref, *ref_g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    v, i = top(torch.randn(5, 8), 3, by_sort=True)
    assert v.is_contiguous() and i.is_contiguous()


def test_expert_stats_name_the_busiest_expert_parallel_rank():
    """Global loads [3]*E/2 + [1]*E/2 over 2 EP ranks: rank 0 computes 3/2 of the mean rank's
    rows; over 4 ranks the same loads give 3/2 too, and per expert max/mean is 3/2."""
    from llmtrain.model import build_model
    from llmtrain.train.metrics import expert_stats

    cfg = _cfg()
    model = build_model(cfg, seed=0)
    e, n = cfg.n_routed_experts, len(model.moe_layers())
    loads = torch.tensor([3.0] * (e // 2) + [1.0] * (e // 2)).repeat(n, 1)
    one = expert_stats(model, loads)
    assert one["moe/max_over_mean"] == pytest.approx(1.5) and "moe/ep_rank_max_over_mean" not in one
    for ep in (2, 4):
        assert expert_stats(model, loads, ep_size=ep)["moe/ep_rank_max_over_mean"] == pytest.approx(
            1.5
        )
    even = torch.tensor([3.0, 1.0] * (e // 2)).repeat(n, 1)  # each rank gets hot and cold experts
    assert expert_stats(model, even, ep_size=2)["moe/ep_rank_max_over_mean"] == pytest.approx(1.0)
