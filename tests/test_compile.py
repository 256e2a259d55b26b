"""train.compile: regional torch.compile of the decoder blocks (llmtrain.train.compile).

On CPU, bf16 (the grouped GEMM torch.compile traces is bf16): compiled blocks give the eager
losses and gradients to bf16 rounding with no graph break, evaluation and generation keep the
eager forward, and the trainer's compiled runs (one rank; two ranks with expert parallelism,
where only the pieces around the all-to-all are compiled) track its eager runs.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics

import pytest
import torch

from llmtrain.model import build_model, generate
from llmtrain.model.attention import DocumentMask
from llmtrain.train.compile import compile_blocks, compile_stats

from .test_bf16 import EARLY_ATOL
from .train_utils import metrics, run_train


def _step(model, ids, mask):
    out = model(ids[:, :-1], labels=ids[:, 1:], attention_mask=mask, check_inputs=False)
    out.loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out.loss.detach().float(), grads


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm().clamp(min=1e-12))


@pytest.mark.parametrize("doc_mask", [False, True], ids=["causal", "doc_mask"])
def test_compiled_blocks_match_eager_without_graph_breaks(debug_cfg, doc_mask):
    """Compiled bf16 is as close to fp32 as eager bf16 is (loss and gradients)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = dataclasses.replace(debug_cfg.model, mtp_depth=1, router_z_loss_coef=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))
    ids[:, 20] = 7
    mask = DocumentMask.from_eos(ids[:, :-1], 7) if doc_mask else None
    f32_loss, f32_grads = _step(build_model(cfg).train(), ids, mask)
    model = build_model(cfg, dtype=torch.bfloat16).train()  # the same seed: the same weights
    ref_loss, ref_grads = _step(model, ids, mask)

    regions = compile_blocks(model, expert_parallel=False)
    assert regions == ["model.layers.0", "model.layers.1", "model.layers.2", "mtp.0.block"]
    loss, grads = _step(model, ids, mask)
    stats = compile_stats()
    # dense block, MoE block, and the MoE block again at the MTP depth's length (T - 1)
    assert stats["graph_breaks"] == 0 and stats["graphs"] == 3, stats
    assert abs(float(loss - f32_loss)) < 2 * abs(float(ref_loss - f32_loss)) + 2e-3
    assert grads.keys() == ref_grads.keys() == f32_grads.keys()
    # bf16 flips a few routing decisions (eager or compiled, at random), which moves those
    # experts' gradients by up to ~15%: compare the typical error, and bound the worst
    eager_err = {n: _rel(ref_grads[n], f32_grads[n]) for n in grads}
    compiled_err = {n: _rel(g, f32_grads[n]) for n, g in grads.items()}
    typical = [statistics.median(e.values()) for e in (eager_err, compiled_err)]
    assert typical[1] < 1.5 * typical[0] + 2e-3, typical
    assert max(compiled_err.values()) < 0.3, compiled_err
    again, _ = _step(model, ids, mask)  # the compiled graphs are reused
    assert compile_stats()["frames_compiled"] == stats["frames_compiled"]
    assert abs(float(again) - float(loss)) < 1e-6

    # evaluation and cached generation take the eager forward: nothing more is compiled
    model.eval()
    with torch.no_grad():
        model(ids[:1, :9], check_inputs=False)
    out = generate(model, ids[:1, :5], max_new_tokens=4, temperature=0.0)
    assert out.shape == (1, 9)
    assert compile_stats()["frames_compiled"] == stats["frames_compiled"]


def _losses(run_dir):
    return [r["loss"] for r in metrics(run_dir)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,extra",
    [(1, ["data.doc_mask=true", "model.mtp_depth=1",
          "train.compile_mode=reduce-overhead"]),  # CUDA graphs' step marks (none on CPU)
     (2, ["parallel.ep_size=2", "parallel.zero_stage=2", "train.activation_checkpointing=true"])],
    ids=["1rank-docmask-mtp-graphs", "2ranks-ep2-zero2-ckpt"],
)  # fmt: skip
def test_trainer_compiled_run_tracks_eager(tmp_path, nproc, extra):
    """`llmtrain train` with train.compile=true through DeepSpeed's bf16 engine: the loss curve
    follows the eager run's (bf16 tolerance of tests/test_bf16.py), and on one rank nothing
    breaks the compiled blocks."""
    over = ["train.max_steps=8", "train.warmup_steps=2", "train.dtype=bf16", "train.seq_len=64",
            "train.sample_tokens=0", "train.eval_every=4", "train.tensorboard=false",
            f"data.cache_dir={tmp_path / 'cache'}", *extra]  # fmt: skip
    compiled_extra = [o for o in over if o.startswith("train.compile_mode")]
    over = [o for o in over if not o.startswith("train.compile_mode")]
    run_train(tmp_path / "eager", nproc, [*over, "train.save_final=false"])
    assert not list((tmp_path / "eager" / "checkpoints").glob("step_*"))  # as benchmarks run
    p = run_train(tmp_path / "compiled", nproc, [*over, "train.compile=true", *compiled_extra])
    eager, compiled = _losses(tmp_path / "eager"), _losses(tmp_path / "compiled")
    diff = [abs(a - b) for a, b in zip(eager, compiled)]
    assert len(compiled) == 8 and max(diff) < EARLY_ATOL, (eager, compiled)
    found = re.search(r"torch.compile on rank 0: (\{.*?\})", p.stdout + p.stderr)
    assert found, (p.stdout[-2000:], p.stderr[-2000:])
    mode = compiled_extra[0].split("=")[1] if compiled_extra else "default"
    assert f"torch.compile (mode {mode}):" in p.stdout + p.stderr
    stats = json.loads(found.group(1).replace("'", '"'))
    assert stats["graph_breaks"] == 0, stats
    # graphs a CUDA-graph mode ran without graphs: on CPU all of them (there are none), which is
    # what makes the count worth reading on a GPU, where torch skips them with a log line only
    assert (stats["cudagraph_skips"] > 0) == (mode == "reduce-overhead"), stats
    # 1 rank: the dense block, the MoE block (checkpointed: its recompute reuses the graph) and
    # the MoE block at the MTP length. EP: the dense block, then per MoE layer attention, norm,
    # router, shared experts and the expert GEMMs, shared by the layers
    assert stats["graphs"] == (3 if nproc == 1 else 6), stats


def test_compile_refuses_zero3_partitioned_parameters(debug_cfg):
    """Compiled blocks and their fused GEMMs read weights outside ZeRO-3's gathering hooks."""
    model = build_model(debug_cfg.model)
    next(model.parameters()).ds_id = 0  # as deepspeed.zero.Init marks a partitioned parameter
    with pytest.raises(ValueError, match="zero_stage=1 or 2"):
        compile_blocks(model, expert_parallel=False)
