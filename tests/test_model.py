import dataclasses
import json

import pytest
import torch

from llmtrain.accounting import count
from llmtrain.config import ModelConfig, load_config
from llmtrain.hf import model_config_from_hf
from llmtrain.model import MLACache, build_model, generate
from llmtrain.model.attention import MLA

from .conftest import FIXTURES, ROOT


def _ids(cfg, b=2, t=24, seed=0):
    return torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def test_forward_backward_and_losses(debug_cfg):
    cfg = debug_cfg.model
    model = build_model(cfg)
    ids = _ids(cfg)
    out = model(ids[:, :-1], labels=ids[:, 1:], return_logits=True)
    assert out.logits.shape == (2, 23, cfg.vocab_size)
    assert model(ids[:, :-1], labels=ids[:, 1:]).logits is None  # fused loss: no logits kept
    assert (
        out.loss.isfinite()
        and abs(out.lm_loss.item() - torch.log(torch.tensor(cfg.vocab_size)).item()) < 0.5
    )
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


def test_parameter_count_matches_accounting_without_allocating():
    """The accounting (config only) and the meta-built model agree, up to DeepSeek-V3 size."""
    for name in ["deepseek_v3", "deepseek_v2", "deepseek_v2_lite"]:
        cfg = model_config_from_hf(json.loads((FIXTURES / f"{name}_config.json").read_text()))
        cfg.mtp_depth = 1
        model = build_model(cfg, device="meta")
        n = sum(p.numel() for p in model.parameters())
        c = count(cfg)
        assert n == c.total_params + c.mtp_params, name
        assert next(model.parameters()).is_meta


@pytest.mark.parametrize("tied", [False, True])
def test_debug_model_count_matches(debug_cfg, tied):
    cfg = dataclasses.replace(debug_cfg.model, tie_word_embeddings=tied, mtp_depth=2)
    model = build_model(cfg)
    c = count(cfg)
    assert sum(p.numel() for p in model.parameters()) == c.total_params + c.mtp_params
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_out_of_vocab_ids_raise_clear_error(debug_cfg):
    model = build_model(debug_cfg.model)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([[1, 2, debug_cfg.model.vocab_size]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([[-1, 2]]))


@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_attention_backends_agree(debug_cfg, rope):
    cfg = dataclasses.replace(
        debug_cfg.model,
        rope=dataclasses.replace(
            debug_cfg.model.rope,
            type=rope,
            factor=4.0 if rope == "yarn" else 1.0,
            original_max_position_embeddings=32,
        ),
    )
    model = build_model(cfg)
    ids = _ids(cfg, t=40)
    outs = {}
    for b in ["reference", "sdpa", "auto"]:
        model.cfg.attn_backend = b
        with torch.no_grad():
            outs[b] = model(ids).logits
    torch.testing.assert_close(outs["sdpa"], outs["reference"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["auto"], outs["reference"], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn backend needs CUDA")
def test_flash_backend_matches_sdpa_on_gpu(debug_cfg):  # pragma: no cover - GPU only
    pytest.importorskip("flash_attn")
    model = build_model(debug_cfg.model, device="cuda", dtype=torch.bfloat16)
    ids = _ids(debug_cfg.model, t=64).cuda()
    with torch.no_grad():
        model.cfg.attn_backend = "flash"
        a = model(ids).logits.float()
        model.cfg.attn_backend = "sdpa"
        b = model(ids).logits.float()
    assert (a - b).abs().max() < 5e-2


def test_gradient_checkpointing_same_grads(debug_cfg):
    cfg = debug_cfg.model
    ids = _ids(cfg)
    grads = []
    for ckpt in (False, True):
        model = build_model(cfg, seed=3)
        model.train()
        model.gradient_checkpointing = ckpt
        model(ids[:, :-1], labels=ids[:, 1:]).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


def test_mtp_loss_and_grads(debug_cfg):
    cfg = dataclasses.replace(debug_cfg.model, mtp_depth=2, mtp_loss_weight=0.3)
    model = build_model(cfg)
    model.train()
    ids = _ids(cfg, t=20)
    out = model(ids[:, :-1], labels=ids[:, 1:])
    assert out.mtp_loss is not None and out.mtp_loss.isfinite()
    torch.testing.assert_close(out.loss, out.lm_loss + out.aux_loss + 0.3 * out.mtp_loss)
    out.loss.backward()
    assert all(p.grad is not None for p in model.mtp.parameters())
    # depth k=1 must predict t_{i+2}: its loss changes when only those targets change
    model.eval()
    with torch.no_grad():
        base = model(ids[:, :-1], labels=ids[:, 1:]).mtp_loss
        lab = ids[:, 1:].clone()
        lab[:, 1:] = (lab[:, 1:] + 1) % cfg.vocab_size
        assert model(ids[:, :-1], labels=lab).mtp_loss != base


def test_mtp_depths_take_the_normed_hidden_state(debug_cfg):
    """Depth 1 reads the main model's state after `model.norm` (what vLLM/SGLang feed
    DeepSeek-V3's MTP layer when drafting, and Megatron-Core trains on); depth 2 reads depth 1's
    normed output. A non-uniform final-norm weight tells pre- from post-norm apart."""
    cfg = dataclasses.replace(debug_cfg.model, mtp_depth=2)
    model = build_model(cfg, seed=4)
    model.eval()
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.linspace(0.2, 3.0, cfg.hidden_size))
    seen = {}
    for k, mod in enumerate(model.mtp):
        mod.register_forward_hook(lambda m, args, out, k=k: seen.update({k: (args[0], out[0])}))
    ids = _ids(cfg, t=20)
    with torch.no_grad():
        out = model(ids[:, :-1], labels=ids[:, 1:])
        n = ids.shape[1] - 1
        normed = model.model.norm(out.hidden)
        torch.testing.assert_close(seen[0][0], normed[:, : n - 1])
        assert not torch.allclose(seen[0][0], out.hidden[:, : n - 1])
        torch.testing.assert_close(seen[1][0], model.mtp[0].norm(seen[0][1])[:, : n - 2])
        ce = [model.lm_head(model.mtp[k].norm(seen[k][1]), ids[:, 1 + k + 1 :]) for k in (0, 1)]
        torch.testing.assert_close(out.mtp_loss, torch.stack(ce).mean())


def test_mtp_keeps_packed_documents_apart(debug_cfg):
    """Changing only document A must not move the MTP loss scored on document B: the MTP block
    reads the main model's document mask, cut to its positions, and a depth whose input token
    lies in the next document scores nothing there (its target is that document's)."""
    from llmtrain.model.attention import DocumentMask

    cfg = dataclasses.replace(debug_cfg.model, mtp_depth=2)
    model = build_model(cfg, seed=1).eval()
    eos, t = 0, 24
    x1 = torch.randint(1, cfg.vocab_size, (2, t), generator=torch.Generator().manual_seed(0))
    x1[:, 9] = eos  # document A = 0..9, document B = 10..23
    x2 = x1.clone()
    x2[:, :9] = torch.randint(1, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    lab = torch.roll(x1, -1, 1)
    lab[:, -1] = -100
    lab[:, :10] = -100  # the targets are doc B's: x[10] on (the main model's from doc A's EOS)
    with torch.no_grad():
        o1, o2 = (
            model(x, labels=lab, attention_mask=DocumentMask.from_eos(x, eos)) for x in (x1, x2)
        )
        assert o1.lm_loss == o2.lm_loss
        assert o1.mtp_loss == o2.mtp_loss
        # and the mask matters: without it document A's change reaches B's MTP loss
        assert model(x1, labels=lab).mtp_loss != model(x2, labels=lab).mtp_loss


def test_bad_masks_and_labels_are_refused(debug_cfg):
    """An HF-style [B, T] mask would broadcast over queries (non-causal at B=1); a label of -1
    would be trained as token 0 by the fused loss. Both raise, naming the fix."""
    cfg = debug_cfg.model
    model = build_model(cfg).eval()
    ids = _ids(cfg, b=1, t=8)
    with pytest.raises(ValueError, match=r"\[B, 1, T, S\]"):
        model(ids, attention_mask=torch.ones(1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not fit"):
        model(ids, attention_mask=torch.ones(1, 1, 7, 8, dtype=torch.bool))
    lab = ids.clone()
    lab[0, 3] = -1
    with pytest.raises(ValueError, match="label -1 is neither -100"):
        model(ids, labels=lab)
    lab[0, 3] = cfg.vocab_size
    with pytest.raises(ValueError, match=f"label {cfg.vocab_size} is neither"):
        model(ids, labels=lab)
    lab[0, 3] = -100
    assert model(ids, labels=lab).loss.isfinite()


def test_bf16_model_keeps_rope_frequencies_fp32(debug_cfg):
    """`model.to(bf16)` must not round inv_freq: bf16 frequencies rotate position 32k by radians."""
    from llmtrain.model.layers import rope_inv_freq

    cfg = dataclasses.replace(
        debug_cfg.model,
        rope=dataclasses.replace(debug_cfg.model.rope, type="yarn", factor=8.0,
                                 original_max_position_embeddings=64),
    )  # fmt: skip
    want = rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim)[0]
    for model in (build_model(cfg).to(torch.bfloat16), build_model(cfg, dtype=torch.bfloat16)):
        inv = model.model.rotary_emb.inv_freq
        assert inv.dtype == torch.float32
        assert torch.equal(inv, want)
        assert next(model.parameters()).dtype == torch.bfloat16
    assert not torch.equal(want.to(torch.bfloat16).float(), want)  # the test can fail


@pytest.mark.parametrize("q_lora", [None, 32])
def test_cached_decoding_equals_recompute(debug_cfg, q_lora):
    cfg = dataclasses.replace(debug_cfg.model, q_lora_rank=q_lora)
    model = build_model(cfg, dtype=torch.float64, seed=7)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # sharper logits: greedy paths diverge quickly if anything is off
    prompt = _ids(cfg, b=2, t=9, seed=4)
    a = generate(model, prompt, 24, use_cache=True)
    b = generate(model, prompt, 24, use_cache=False)
    assert torch.equal(a, b)
    # the logits themselves, step by step
    cache = MLACache(cfg.num_layers)
    with torch.no_grad():
        full = model(a).logits
        pre = model(a[:, :9], cache=cache).logits
        steps = [model(a[:, i : i + 1], cache=cache).logits for i in range(9, a.shape[1])]
    inc = torch.cat([pre] + steps, dim=1)
    torch.testing.assert_close(inc, full, atol=1e-9, rtol=1e-9)


def test_logits_at_and_chunked_prefill(debug_cfg):
    """`logits_at` returns exactly the chosen rows of the full logits; a prompt fed through the
    latent cache in chunks gives the logits of one full forward (what evaluation relies on)."""
    model = build_model(debug_cfg.model, dtype=torch.float64, seed=3)
    x = _ids(debug_cfg.model, b=2, t=11, seed=5)
    rows = torch.tensor([0, 10, 11, 21, 15])
    with torch.no_grad():
        full = model(x).logits
        got = model(x, logits_at=rows).logits
        torch.testing.assert_close(got, full.reshape(-1, full.shape[-1])[rows], rtol=0, atol=1e-12)
        cache = MLACache(debug_cfg.model.num_layers)
        parts = [model(x[:, a : a + 4], cache=cache).logits for a in range(0, 11, 4)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-9, rtol=1e-9)


def test_cache_holds_only_latent_and_rope_key(debug_cfg):
    cfg = debug_cfg.model
    model = build_model(cfg)
    cache = MLACache(cfg.num_layers)
    with torch.no_grad():
        model(_ids(cfg, b=1, t=5), cache=cache)
    assert cache.seq_len == 5
    assert cache.c_kv[0].shape == (1, 5, cfg.kv_lora_rank)
    assert cache.k_rope[0].shape == (1, 5, cfg.qk_rope_head_dim)
    per_tok = cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert (
        cache.bytes_per_token() == per_tok == count(cfg, kv_dtype="fp32").kv_cache_bytes_per_token
    )


def test_top_p_sampling(debug_cfg):
    model = build_model(debug_cfg.model, seed=1)
    prompt = _ids(debug_cfg.model, b=1, t=4)
    g = torch.Generator().manual_seed(0)
    tiny_p = generate(model, prompt, 8, temperature=1.0, top_p=1e-6, generator=g)
    assert torch.equal(tiny_p, generate(model, prompt, 8))  # only the top token survives
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    s1 = generate(model, prompt, 8, temperature=1.0, top_p=0.9, generator=g1)
    s2 = generate(model, prompt, 8, temperature=1.0, top_p=0.9, generator=g2)
    assert torch.equal(s1, s2)


def test_bf16_cast_model_routes_like_fp32(debug_cfg):
    """What DeepSpeed's bf16 engine does (every parameter to bf16, buffers kept) and what our
    engine then does (routers get their fp32 master weight): routing equals the fp32 model's.
    The engine path itself is tested in test_bf16.py."""
    model = build_model(debug_cfg.model)
    x_TD = torch.randn(64, debug_cfg.model.hidden_size, generator=torch.Generator().manual_seed(0))
    gate = model.moe_layers()[0].gate
    with torch.no_grad():
        w32, idx32, _, _ = gate(x_TD)
    master = gate.weight.detach().clone()
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    gate.set_fp32_weight(master)
    w, idx, _, logits = gate(x_TD)
    assert logits.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(idx, idx32) and torch.equal(w, w32)  # the bf16 weight would differ
    w.sum().backward()
    assert gate.weight.grad is not None and gate.weight.grad.dtype == torch.bfloat16
    out = model(_ids(debug_cfg.model))
    assert out.logits.dtype == torch.bfloat16 and out.logits.isfinite().all()


def test_model_update_router_biases(debug_cfg):
    cfg = dataclasses.replace(debug_cfg.model, bias_update_speed=0.01)
    model = build_model(cfg)
    model.train()
    model(_ids(cfg))
    loads = model.expert_loads()
    assert loads.shape == (cfg.num_moe_layers, cfg.n_routed_experts)
    model.update_router_biases()
    b = model.moe_layers()[0].gate.e_score_correction_bias
    assert b.abs().max() == pytest.approx(0.01)
    assert model.expert_loads().sum() == 0


def test_yaml_model_builds_and_trains_a_step():
    cfg = load_config(ROOT / "configs" / "debug.yaml").model
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _ids(cfg, t=33)
    losses = []
    for _ in range(5):
        out = model(ids[:, :-1], labels=ids[:, 1:])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.lm_loss.item())
    assert losses[-1] < losses[0]


def test_model_config_is_plain_data():
    assert isinstance(ModelConfig().qk_head_dim, int)


class _Rank:
    """What the model asks of a dispatcher at build time: which experts this rank holds."""

    def __init__(self, ep_size: int, ep_rank: int):
        self.ep_size, self.ep_rank = ep_size, ep_rank


def test_same_seed_same_full_model_at_any_expert_layout(debug_cfg):
    """Each expert draws from its own stream: the 1-rank model's experts are the concatenation
    of the EP-2 ranks' local experts, and every other weight is equal."""
    full = build_model(debug_cfg.model, seed=5)
    parts = [build_model(debug_cfg.model, seed=5, dispatcher=_Rank(2, r)) for r in range(2)]
    n_expert = 0
    for name, p in full.named_parameters():
        got = [dict(m.named_parameters())[name] for m in parts]
        if name.endswith(("experts.w_gate_up", "experts.w_down")):
            assert got[0].shape[0] == p.shape[0] // 2
            torch.testing.assert_close(torch.cat(got), p, rtol=0, atol=0)
            n_expert += 1
        else:
            torch.testing.assert_close(got[0], p, rtol=0, atol=0)
            torch.testing.assert_close(got[1], p, rtol=0, atol=0)
    assert n_expert == 2 * len(full.moe_layers())
    other = build_model(debug_cfg.model, seed=6)
    assert not torch.equal(
        other.model.layers[1].mlp.experts.w_down, full.model.layers[1].mlp.experts.w_down
    )


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_init_from_hf_reads_only_this_ranks_experts(tmp_path, monkeypatch, layout):
    """load_hf_into at EP rank 1 of 2 equals the full state dict's slice and never reads
    rank 0's experts (per-expert tensors skipped, stacked ones sliced lazily)."""
    import safetensors
    from safetensors.torch import save_file

    from llmtrain.hf import read_safetensors_dir, state_dict_from_hf

    from .hf_utils import make_hf_model

    hf = make_hf_model(seed=3)
    hf.save_pretrained(tmp_path / "hf")
    cfg = model_config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    full = state_dict_from_hf(read_safetensors_dir(tmp_path / "hf"), cfg)
    src = tmp_path / "hf"
    if layout == "fused":  # transformers 5.x names: [E, 2F, D] and [E, D, F]
        src = tmp_path / "fused"
        src.mkdir()
        fused = {}
        for k, v in full.items():
            if k.endswith("w_gate_up"):
                fused[k[: -len("w_gate_up")] + "gate_up_proj"] = v.transpose(1, 2).contiguous()
            elif k.endswith("w_down"):
                fused[k[: -len("w_down")] + "down_proj"] = v.transpose(1, 2).contiguous()
            else:
                fused[k] = v.contiguous()
        save_file(fused, str(src / "model.safetensors"))

    _check_ep_rank_reads(src, cfg, full, layout, monkeypatch, safetensors)
    _check_partition_reads(src, cfg, full, monkeypatch, safetensors)


def _recording_safe_open(real, reads: list, pulled: list):
    """safetensors.safe_open that logs (kind, name) of each tensor asked for and adds the
    elements each read materialises to pulled[0]."""

    class Recording:
        def __init__(self, *a, **kw):
            self.f = real(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            reads.append(("tensor", name))
            t = self.f.get_tensor(name)
            pulled[0] += t.numel()
            return t

        def get_slice(self, name):
            reads.append(("slice", name))
            sl = self.f.get_slice(name)

            class Slice:
                def get_shape(self):
                    return sl.get_shape()

                def __getitem__(self, idx):
                    t = sl[idx]
                    pulled[0] += t.numel()
                    return t

            return Slice()

    return Recording


def _check_ep_rank_reads(src, cfg, full, layout, monkeypatch, safetensors):
    from llmtrain.hf import load_hf_into

    reads = []
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", _recording_safe_open(real, reads, [0]))
    model = build_model(cfg, seed=0, dispatcher=_Rank(2, 1))
    load_hf_into(model, src, cfg)
    el = cfg.n_routed_experts // 2
    for name, p in model.named_parameters():
        want = full[name][el:] if name.endswith(("w_gate_up", "w_down")) else full[name]
        torch.testing.assert_close(p, want, rtol=0, atol=0)
    expert_reads = [n for kind, n in reads if ".experts." in n]
    assert expert_reads
    if layout == "per_expert":
        assert all(int(n.split(".experts.")[1].split(".")[0]) >= el for n in expert_reads)
    else:
        assert all(kind == "slice" for kind, n in reads if ".experts." in n)
    monkeypatch.setattr(safetensors, "safe_open", real)


def _check_partition_reads(src, cfg, full, monkeypatch, safetensors, world=3):
    """ZeRO-3: each of `world` ranks of EP rank 1 fills its flat partition of every weight with
    the right elements, materialising about its share (a row at each end), not whole tensors."""
    from llmtrain.hf import load_hf_into

    real = safetensors.safe_open
    pulled = [0]
    monkeypatch.setattr(safetensors, "safe_open", _recording_safe_open(real, [], pulled))
    model = build_model(cfg, seed=0, dispatcher=_Rank(2, 1))
    el = cfg.n_routed_experts // 2
    for rank in range(world):
        bufs, share, slack = {}, 0, 0

        def partition(p, rank=rank, bufs=bufs):
            part = -(-p.numel() // world)
            start = rank * part
            n = max(0, min(part, p.numel() - start))
            bufs[id(p)] = (start, n, torch.full((part,), float("nan")))
            return bufs[id(p)]

        pulled[0] = 0
        load_hf_into(model, src, cfg, partition=partition)
        for name, p in model.named_parameters():
            want = full[name][el:] if name.endswith(("w_gate_up", "w_down")) else full[name]
            start, n, local = bufs[id(p)]
            torch.testing.assert_close(local[:n], want.reshape(-1)[start : start + n].float(),
                                       rtol=0, atol=0)  # fmt: skip
            share += n
            slack += 2 * p.shape[-1] if p.dim() > 1 else 0
        assert share <= pulled[0] <= share + slack, (rank, pulled[0], share)
    monkeypatch.setattr(safetensors, "safe_open", real)


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_one_rank_training_step_needs_no_host_sync(debug_cfg, impl):
    """Forward and backward of a bf16 training step (MoE, aux losses, MTP) use no op whose result
    depends on tensor values on the host: under FakeTensorMode (shapes only, no data) every such
    op (.item(), nonzero, bincount, masks as indices, ...) raises. On CUDA each would stall the
    stream once per layer. The per-expert loop is the fallback and must read the counts."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    over = dict(mtp_depth=1, aux_loss_alpha=1e-3, router_z_loss_coef=1e-3, moe_impl=impl)
    cfg = dataclasses.replace(debug_cfg.model, **over)
    model = build_model(cfg, dtype=torch.bfloat16).train()  # grouped GEMM's kernel is bf16
    params = dict(model.named_parameters())
    real = {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}
    real.update((k, v.detach()) for k, v in model.named_buffers())
    ids = _ids(cfg)
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v, static_shapes=True) for k, v in real.items()}
        for k in params:
            fake[k].requires_grad_(True)
        x = mode.from_tensor(ids)
        step = (
            lambda: functional_call(  # noqa: E731
                model, fake, (x[:, :-1],), dict(labels=x[:, 1:], check_inputs=False)
            )
        )
        if impl == "loop":
            with pytest.raises(Exception, match="data-dependent|_local_scalar_dense|Dynamic"):
                step()
            return
        loss = step().loss
        grads = torch.autograd.grad(loss, [fake[k] for k in params])
    assert loss.shape == () and len(grads) == len(params)


def test_fused_input_projections_match_separate(debug_cfg):
    """MLA's fused down-projections and the MLPs' fused gate|up (what train.compile turns on)
    give the separate GEMMs' loss and gradients, parameters unchanged."""
    from llmtrain.model.attention import MLA
    from llmtrain.model.layers import MLP

    cfg = dataclasses.replace(debug_cfg.model, mtp_depth=1)
    model = build_model(cfg, dtype=torch.float64).train()
    ids = _ids(cfg)
    names = [n for n, _ in model.named_parameters()]
    out = []
    for fused in (False, True):
        mods = [m for m in model.modules() if isinstance(m, (MLA, MLP))]
        assert any(isinstance(m, MLA) for m in mods) and any(isinstance(m, MLP) for m in mods)
        for m in mods:
            setattr(m, "fuse_input_proj" if isinstance(m, MLA) else "fuse_gate_up", fused)
        loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
        out.append((loss, torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)))
    assert [n for n, _ in model.named_parameters()] == names
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-12, atol=1e-12)
    for n, a, b in zip(names, out[0][1], out[1][1], strict=True):
        assert (a is None) == (b is None), n
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=n)


def test_generate_left_padded_batch_and_chunked_prefill(debug_cfg, monkeypatch):
    """A left-padded batch (attention_mask as transformers' generate takes it) gives each row
    the tokens it gets alone, cached or not; the prompt is prefilled PREFILL tokens a forward
    and only the last position's logits are computed (no [B, T, V], no [B, H, T, T] scores)."""
    import sys

    G = sys.modules["llmtrain.model.generate"]  # the package re-exports the function by that name

    model = build_model(debug_cfg.model, dtype=torch.float64, seed=7)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)
    a, b = _ids(debug_cfg.model, b=1, t=11, seed=1), _ids(debug_cfg.model, b=1, t=4, seed=2)
    batch = torch.zeros(2, 11, dtype=torch.long)
    am = torch.zeros_like(batch)
    batch[0], am[0] = a[0], 1
    batch[1, 7:], am[1, 7:] = b[0], 1
    want = [generate(model, a, 12)[0, 11:], generate(model, b, 12)[0, 4:]]
    monkeypatch.setattr(G, "PREFILL", 4)
    assert torch.equal(generate(model, a, 12)[0, 11:], want[0])  # chunked, no padding
    rows = []
    orig = model.lm_head.forward
    monkeypatch.setattr(
        model.lm_head, "forward", lambda h, *x: rows.append(h.shape[:-1]) or orig(h, *x)
    )
    queries = []  # the latent-cache path's scores are [B, H, T, S]: T at most PREFILL
    absorbed = MLA._absorbed
    monkeypatch.setattr(
        MLA, "_absorbed", lambda self, qn, *x: queries.append(qn.shape[2]) or absorbed(self, qn, *x)
    )
    for use_cache in (True, False):
        got = generate(model, batch, 12, attention_mask=am, use_cache=use_cache)[:, 11:]
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), use_cache
        if use_cache:
            assert queries and max(queries) == 4 and queries.count(4) >= 2, queries  # 11 = 4+4+3
    assert all(r == (2,) or r == (0,) for r in rows), rows  # logits of the last positions only
    for bad in (am.flip(1), am[:, :5]):  # right padding; a mask of another shape
        with pytest.raises(ValueError, match="pad on the left"):
            generate(model, batch, 2, attention_mask=bad)
    with pytest.raises(ValueError, match="at least one prompt token"):
        generate(model, batch[:, :0], 2)
