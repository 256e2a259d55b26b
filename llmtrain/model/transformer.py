"""The decoder: embeddings, MLA + (dense | MoE) blocks, final norm, LM head, optional MTP.

Shape legend: B batch, T sequence, D hidden, V vocabulary, L layers.

Parameter names follow the Hugging Face DeepseekV3 checkpoint (model.layers.{i}.self_attn...,
lm_head) so conversion is a rename of the experts only. Build with `build_model`, which
creates the modules on the meta device and materialises them where asked, so a model larger
than memory can be described (and counted) without allocating it.
"""

from __future__ import annotations

import contextlib
import zlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from llmtrain.config import ModelConfig
from llmtrain.model.attention import (
    MLA,
    DocumentMask,
    MLACache,
    check_mask,
    document_backend,
    mask_prefix,
)
from llmtrain.model.layers import MLP, RMSNorm, RotaryEmbedding
from llmtrain.model.loss import LMHead
from llmtrain.model.moe import Experts, MoE, Router


class ModelOutput(dict):
    """The forward's results, readable as attributes (`out.loss`) and as a dict.

    Why a dict: DeepSpeed registers its backward prologue (ZeRO's accumulation-boundary flag,
    BF16_Optimizer's accumulation) as hooks on the output tensors it finds by walking tensors,
    tuples, lists and dicts (deepspeed/runtime/utils.py `_traverse_and_register_hooks`); a
    dataclass hides them and the prologue never runs.
    Fields: logits [B, T, V] (None when labels are given, unless asked), loss (lm_loss + aux_loss
    + mtp weight · mtp_loss), lm_loss, aux_loss, mtp_loss, hidden (last residual stream before
    the final norm).
    """

    FIELDS = ("logits", "loss", "lm_loss", "aux_loss", "mtp_loss", "hidden")

    def __init__(self, logits: torch.Tensor | None = None, **kw: torch.Tensor | None):
        unknown = set(kw) - set(self.FIELDS)
        if unknown:
            raise TypeError(f"ModelOutput has no fields {sorted(unknown)}")
        super().__init__({f: None for f in self.FIELDS})
        self.update(logits=logits, **kw)

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value) -> None:
        if name not in self.FIELDS:
            raise AttributeError(f"ModelOutput has no field {name!r}")
        self[name] = value


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dispatcher=None):
        super().__init__()
        self.self_attn = MLA(cfg, layer_idx)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.mlp = (
            MoE(cfg, dispatcher) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x_BTD, cos, sin, cache=None, mask=None):
        x_BTD = x_BTD + self.self_attn(self.input_layernorm(x_BTD), cos, sin, cache, mask)
        h = self.post_attention_layernorm(x_BTD)
        if self.is_moe:
            y, aux = self.mlp(h)
        else:
            y, aux = self.mlp(h), x_BTD.new_zeros((), dtype=torch.float32)
        return x_BTD + y, aux


class MTPModule(nn.Module):
    """One DeepSeek-V3 multi-token-prediction depth: h' = Block(W[enorm(emb(t_{i+k})); hnorm(h_i)]),
    h_i the previous depth's normed output (depth 1: the main model's, after `model.norm`).

    Embedding and output head are shared with the main model; names follow DeepSeek-V3's release
    (enorm, hnorm, eh_proj, shared_head.norm) so the export can write them at layer index L + k.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, dispatcher=None):
        super().__init__()
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = DecoderLayer(cfg, layer_idx, dispatcher)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, h_BTD, emb_BTD, cos, sin, mask=None):
        x = self.eh_proj(torch.cat([self.enorm(emb_BTD), self.hnorm(h_BTD)], dim=-1))
        return self.block(x, cos, sin, None, mask)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, dispatcher=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i, dispatcher) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)


class Transformer(nn.Module):
    """MLA + DeepSeekMoE causal LM. `dispatcher` (default local) moves tokens to experts."""

    def __init__(self, cfg: ModelConfig, dispatcher=None):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.model = Backbone(cfg, dispatcher)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size)
        self.tie_weights()
        self.mtp = nn.ModuleList(
            [MTPModule(cfg, cfg.num_layers + k, dispatcher) for k in range(cfg.mtp_depth)]
        )
        self.gradient_checkpointing = False
        for m in self.moe_layers():  # counted here, once per forward (see `count_loads`)
            m.counts_in_forward = False

    @torch.no_grad()
    def count_loads(self, block: nn.Module) -> None:
        """Add a block's routed-token counts of the forward just run to `load_since_update`.
        Done outside the (possibly checkpointed, possibly compiled) block, so the recompute in
        backward does not count the tokens again and no flag enters a compiled graph."""
        mlp = getattr(block, "mlp", None)
        if self.training and isinstance(mlp, MoE):
            mlp.load_since_update.add_(mlp.last_counts)

    # ------------------------------------------------------------ init

    def tie_weights(self) -> None:
        """Share embedding and head when configured (again after `to_empty`, which unties)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0, gather=None) -> None:
        """Normal(0, init_std) matrices, unit norms, zero router bias; rope buffers recomputed.

        Each matrix draws from its own generator seeded by (seed, name), and each routed expert
        from its own, seeded by (seed, name, global expert index): a rank draws only the experts
        it holds, and the same seed gives the same full model at any expert-parallel layout.
        `gather(p)`, for partitioned weights, is a context in which `p` is whole and what is
        written to it is kept (e.g. ZeRO-3's GatheredParameters); one weight at a time.
        """
        std = self.cfg.init_std
        whole = gather or (lambda p: contextlib.nullcontext())
        for mod in self.modules():
            if isinstance(mod, RMSNorm):
                with whole(mod.weight):
                    mod.weight.fill_(1.0)
            elif isinstance(mod, RotaryEmbedding):
                mod.reset_parameters()
            elif isinstance(mod, MoE):
                mod.gate.e_score_correction_bias.zero_()
                mod.last_counts.zero_()
                mod.load_since_update.zero_()
        offsets = {}
        for name, mod in self.named_modules():
            if isinstance(mod, Experts):
                for pn in ("w_gate_up", "w_down"):
                    offsets[f"{name}.{pn}"] = mod.offset
        routers = {f"{n}.weight": m for n, m in self.named_modules() if isinstance(m, Router)}
        for name, p in self.named_parameters():
            with whole(p):
                if p.dim() < 2:
                    continue
                gate = routers.get(name)
                if gate is not None and p.dtype != torch.float32:
                    # a router built in the training dtype (ZeRO-3's zero.Init casts every
                    # weight): keep the exact fp32 draw for the engine's master copy, as the
                    # fp32 router of the other layouts gives it
                    w = torch.empty(p.shape, device=p.device, dtype=torch.float32)
                    _normal(w, std, _generator(p, seed, name))
                    p.copy_(w)
                    gate.exact_fp32_weight = w
                elif name in offsets:
                    for i in range(p.shape[0]):
                        _normal(p[i], std, _generator(p, seed, f"{name}.{offsets[name] + i}"))
                else:
                    _normal(p, std, _generator(p, seed, name))

    def weights_read_outside_their_module(self) -> list[tuple[nn.Module, nn.Parameter]]:
        """(module, weight) pairs where `module`'s forward reads `weight` without calling the
        weight's own module: MLA's latent-cache path multiplies by kv_b_proj.weight directly.
        Partitioned-weight runtimes (ZeRO-3) must gather those weights for that module."""
        return [(m, m.kv_b_proj.weight) for m in self.modules() if isinstance(m, MLA)]

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def moe_layer_names(self) -> list[str]:
        """Names for `moe_layers()`, in its order: `layer{i}` by decoder index (dense layers
        count), `mtp{k}` for MTP depth k (from 1, as in DeepSeek-V3), so a metric names the layer a user would look up."""
        names = []
        for name, m in self.named_modules():
            if isinstance(m, MoE):
                parts = name.split(".")
                if "mtp" in parts:
                    names.append(f"mtp{int(parts[parts.index('mtp') + 1]) + 1}")
                else:
                    names.append(f"layer{parts[parts.index('layers') + 1]}")
        return names

    def _check_ids(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        """Host-synchronising checks for callers (evaluation, scripts); training's loader makes
        valid batches and skips them. The fused loss reads a label < 0 as a row to gather, so
        any label other than -100 must be a token id, as F.cross_entropy demands."""
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        if input_ids.numel() == 0:
            raise ValueError("input_ids is empty")
        v = self.cfg.vocab_size
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= v:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"token id {bad} is outside the vocabulary [0, {v}); "
                "check the tokenizer matches model.vocab_size"
            )
        if labels is None:
            return
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels {tuple(labels.shape)} must have input_ids' shape {tuple(input_ids.shape)}"
            )
        bad_N = (labels != -100) & ((labels < 0) | (labels >= v))
        if bool(bad_N.any()):
            raise ValueError(
                f"label {int(labels[bad_N][0])} is neither -100 (ignored) nor a token id in "
                f"[0, {v}); mark positions to skip with -100"
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        cache: MLACache | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        check_inputs: bool = True,
        return_logits: bool | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> ModelOutput:
        """input_ids [B, T]; labels [B, T] (next tokens, -100 ignored) adds the losses.

        With labels the head and cross-entropy run fused and chunked, and logits are not
        materialised unless `return_logits=True`. `logits_at` (long [N], indices into the
        flattened B·T positions) returns logits [N, V] of those positions only: scoring a
        continuation or taking a next token needs a few rows, not [B, T, V]. `attention_mask`,
        if given, is a DocumentMask (packed documents; sparse kernels on CUDA) or a boolean
        [B, 1, T, S] "may attend" mask.
        """
        if check_inputs:
            self._check_ids(input_ids, labels)
        check_mask(attention_mask, input_ids.shape)
        b, t = input_ids.shape
        past = cache.seq_len if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=input_ids.device)
        position_ids = position_ids.expand(b, t)
        x_BTD = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(position_ids, x_BTD.dtype)
        if isinstance(attention_mask, DocumentMask) and cache is None:  # once, for every layer
            attention_mask.prepare(document_backend(self.cfg.attn_backend, x_BTD))
        aux = x_BTD.new_zeros((), dtype=torch.float32)
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training and cache is None:
                x_BTD, a = checkpoint(
                    layer, x_BTD, cos, sin, None, attention_mask, use_reentrant=False
                )
            else:
                x_BTD, a = layer(x_BTD, cos, sin, cache, attention_mask)
            self.count_loads(layer)
            aux = aux + a
        h_BTD = self.model.norm(x_BTD)
        if return_logits is None:
            return_logits = labels is None
        if logits_at is not None:
            logits = self.lm_head(h_BTD.reshape(-1, h_BTD.shape[-1]).index_select(0, logits_at))
        else:
            logits = self.lm_head(h_BTD) if return_logits else None
        out = ModelOutput(logits=logits, hidden=x_BTD)
        if labels is None:
            return out
        out.lm_loss = self.lm_head(h_BTD, labels)
        out.aux_loss = aux
        loss = out.lm_loss + aux
        if len(self.mtp) and t > len(self.mtp):
            mtp_loss, mtp_aux = self._mtp_loss(h_BTD, input_ids, labels, cos, sin, attention_mask)
            out.mtp_loss = mtp_loss
            out.aux_loss = aux + mtp_aux
            loss = loss + self.cfg.mtp_loss_weight * mtp_loss + mtp_aux
        out.loss = loss
        return out

    def _mtp_loss(self, h_BTD, input_ids, labels, cos, sin, mask=None):
        """Mean over depths k of CE(t_{i+k+1}); depth k sees positions 0..T-1-k, under the main
        model's attention mask cut to them (packed documents stay apart, as in Megatron's MTP).

        `h_BTD` is the main model's state after its final norm, and each depth hands on its own
        normed output: what vLLM, SGLang and TensorRT-LLM feed DeepSeek-V3's released MTP layer
        when drafting, and what Megatron-Core's MTP trains on, so an exported MTP layer drafts
        on the input it was trained on."""
        losses, aux = [], h_BTD.new_zeros((), dtype=torch.float32)
        t = input_ids.shape[1]
        for k, mod in enumerate(self.mtp, start=1):
            n = t - k
            emb = self.model.embed_tokens(input_ids[:, k:])
            m = mask_prefix(mask, n)
            if isinstance(m, DocumentMask):
                m.prepare(document_backend(self.cfg.attn_backend, h_BTD))
            x_BTD, a = mod(h_BTD[:, :n], emb, cos[:, :n], sin[:, :n], m)
            self.count_loads(mod.block)
            aux = aux + a
            h_BTD = mod.norm(x_BTD)
            lab = labels[:, k:]
            if isinstance(mask, DocumentMask):  # input token t_{i+k} in another document than
                # position i: its target belongs to the next document (Megatron-Core's packed
                # MTP rolls each document on its own and masks these positions)
                doc = mask.doc_BT
                lab = lab.masked_fill(doc[:, k:] != doc[:, :n], -100)
            losses.append(self.lm_head(h_BTD, lab))
        return torch.stack(losses).mean(), aux

    @torch.no_grad()
    def update_router_biases(self, loads_LE: torch.Tensor | None = None) -> None:
        """Apply the aux-loss-free bias step to every MoE layer (MTP blocks included).

        `loads_LE` [num MoE layers, E]: loads summed over data-parallel ranks; None uses local counts.
        """
        for i, m in enumerate(self.moe_layers()):
            m.update_bias(None if loads_LE is None else loads_LE[i])

    def expert_loads(self) -> torch.Tensor:
        """[num MoE layers, E] tokens routed since the last bias update (for reduction + metrics)."""
        layers = self.moe_layers()
        if not layers:
            return torch.zeros(0, self.cfg.n_routed_experts)
        return torch.stack([m.load_since_update for m in layers])


def _generator(p: torch.Tensor, seed: int, key: str) -> torch.Generator:
    return torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))


def _normal(t: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Draw in fp32 whatever t's dtype (a weight built in bf16 gets the fp32 draw, rounded)."""
    if t.dtype == torch.float32:
        t.normal_(0.0, std, generator=gen)
    else:
        t.copy_(torch.empty(t.shape, device=t.device).normal_(0.0, std, generator=gen))


def build_model(
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = 0,
    dispatcher=None,
    init_context=None,
    gather=None,
) -> Transformer:
    """Create on the meta device, then materialise on `device` and initialise (unless meta).

    A rank materialises only the routed experts its dispatcher gives it. With `init_context`
    (a callable returning a context, e.g. ZeRO-3's `deepspeed.zero.Init`) the modules are
    created inside it instead, so a partitioning runtime keeps only this rank's part of each
    weight, and `gather` (see `init_weights`) initialises them one weight at a time.

    Router weights and the correction bias stay fp32 whatever `dtype` is: routing decisions are
    made in fp32, as in DeepSeek-V3. The weights are allocated in `dtype` directly (the cast
    happens on the meta device), so a bf16 model never holds an fp32 copy: each weight is drawn
    in fp32 one at a time and rounded, the values a cast of an fp32 model would give.
    """
    if init_context is not None:
        with init_context():
            model = Transformer(cfg, dispatcher)
        model.init_weights(seed or 0, gather=gather)
        return model
    with torch.device("meta"):
        model = Transformer(cfg, dispatcher)
    if dtype != torch.float32:
        model.to(dtype)
        for m in model.moe_layers():
            m.gate.float()
    if str(device) == "meta":
        return model
    model = model.to_empty(device=device)
    for m in model.moe_layers():
        m.keep_routing_state_fp32()
    model.tie_weights()
    model.init_weights(seed or 0)
    return model
