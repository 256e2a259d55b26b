"""launch/gpu_check.sh runs where a GPU is lent for minutes, rarely: its plumbing is checked here.

GPU_CHECK_CPU_SMOKE=1 runs every step on CPU with the debug config (set-up, data preparation,
the three benchmark runs, tests/gpu collected and skipped, the profile) and must leave the same
files and summary a GPU run leaves. Found this way: the data step hung, because a script read
from stdin cannot spawn worker processes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from .train_utils import ROOT


@pytest.mark.slow
def test_gpu_train_reruns_eager_when_the_compiled_run_fails(tmp_path):
    """benchmarks/gpu_train.py --compile: a compiled run that fails before its first step (here
    refused: compile with ZeRO-3) is rerun eager, and the JSON says so."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, "benchmarks/gpu_train.py", "--cpu", "--compile", "--config",
           "configs/debug.yaml", "--steps", "2", "--warmup", "0", "--out", str(out),
           "train.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=4",
           f"data.cache_dir={tmp_path / 'cache'}", "parallel.zero_stage=3",
           "train.compile_mode=reduce-overhead"]  # fmt: skip
    env = dict(os.environ, DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    env.pop("STEP_LIMIT", None)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    r = json.loads(out.read_text())
    assert r["compile"] is False and r["steps_logged"] == 2 and r["returncode"] == 0, r
    assert r["compile_mode"] is None  # the eager rerun dropped the mode (else a config error)
    assert "train.compile=true with parallel.zero_stage=3" in r["compile_error"], r


@pytest.mark.slow
def test_gpu_check_script_runs_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, GPU_CHECK_CPU_SMOKE="1", OUT=str(out), PYTHON=sys.executable,
               LLMTRAIN_CACHE=str(tmp_path / "cache"), GPU_CHECK_BUDGET="600",
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               GPU_CHECK_SITE=str(tmp_path / "site"))  # fmt: skip
    p = subprocess.run(["bash", "launch/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=700)  # fmt: skip
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    names = sorted(f.name for f in out.iterdir())
    # at most 8 files come back from the device machine
    assert names == ["gpu_check.log", "gpu_kernels_moe_1b.txt", "gpu_train_moe_100m.json",
                     "gpu_train_moe_1b.json", "gpu_train_moe_1b_graphs.json",
                     "gpu_train_moe_1b_wide.json", "tests_gpu.xml",
                     "tests_gpu_train.xml"], names  # fmt: skip
    rows = [json.loads(f.read_text()) for f in sorted(out.glob("gpu_train_*.json"))]
    assert [r["name"] for r in rows] == ["moe_100m", "moe_1b", "moe_1b_graphs", "moe_1b_wide"]
    for r in rows:
        assert r["returncode"] == 0 and r["steps_logged"] >= 3 and r["steady_steps"] >= 2, r
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1, r
        # llmtrain count's prediction for the same layout (CUDA's, so not compared here)
        assert r["predicted_memory_gib"] > 0 and r["predicted_parts_gib"]["activations"] > 0, r
    summary = log[log.index("gpu_check summary") :]
    steps = ("setup", "prepare_data", "bench_moe_1b", "kernels", "tests_gpu", "tests_gpu_train",
             "bench_moe_100m", "bench_moe_1b_wide", "bench_moe_1b_graphs")  # fmt: skip
    for step in steps:
        assert f"\n{step} " in summary and "timeout" not in summary, summary
    # tests/gpu collected by both pytest steps
    assert "test_one_gpu_training_step_never_syncs_the_host" in summary
    assert "test_nccl_world_of_one_save_resume_bf16" in summary
    # the kernels: every weight matmul timed, SDPA's own pick ran, the padded flash kernel
    # agreed with it, and the bound was drawn from them
    attn = (out / "gpu_kernels_moe_1b.txt").read_text()
    assert attn in summary and "sdpa (torch's pick: math)" in attn, attn
    row = next(line for line in attn.splitlines() if line.startswith("sdpa flash, v padded"))
    assert float(row.split()[-1]) < 1e-5, attn
    assert "mlp.experts.w_gate_up (grouped_mm)" in attn and "lm_head (" in attn, attn
    assert re.search(r"bound: matmuls [\d.]+ ms \+ attention 3 x [\d.]+ ms", attn), attn
    # the step against the bound
    assert re.search(
        r"moe_1b MFU [\d.e-]+% against the kernels' bound [\d.e-]+%: \d+% of it", summary
    )
    assert "peak memory predicted" in summary
    assert "moe_1b trainer step profile: step 3: " in summary  # the last step, in the trainer
    # the compiled-vs-CUDA-graphs comparison; in smoke mode both runs are eager, hence equal
    assert "moe_1b compiled vs CUDA graphs: max |loss difference| 0.0000 over 3 steps" in summary


def test_profile_sorts_cuda_kernels_by_kind():
    """The profile splits GPU time by kernel kind from kernel names as torch 2.11 on an H200
    names them: what is matmul and attention (the --kernels bound) and what is everything else."""
    from llmtrain.train.profiling import kernel_kind

    cases = {
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<": "matmul",
        "triton_tem_fused_mm_0": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3": "attention",
        "fmha_cutlassB_bf16_aligned_64x64_k128_sm80": "attention",
        "triton_tem_fused_flex_attention_0": "attention",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "fused (triton)",
        # Inductor names fused kernels after the ops they feed: elementwise work, not GEMM or SDPA
        "triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_cat_cos_sin_2": (
            "fused (triton)"
        ),
        "triton_poi_fused__grouped_mm_mul_silu_3": "fused (triton)",
        "void at::native::index_elementwise_kernel<128, 4>": "index/sort/scatter",
        "void at::native::embedding_backward_feature_kernel<float, float, long>": (
            "index/sort/scatter"
        ),
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<": (
            "eager elementwise/reduce"
        ),
        "void at::native::(anonymous namespace)::indexFuncLargeIndex<c10::BFloat16>": (
            "index/sort/scatter"
        ),
        "Memcpy DtoD (Device -> Device)": "copy/fill",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "communication",
        "some_new_kernel": "other",
    }
    assert {n: kernel_kind(n) for n in cases} == cases


def test_kernels_bound_adds_every_matmul_and_attention_per_block(monkeypatch):
    """The bound line's arithmetic, with known kernel times: each matmul's time x its runs (the
    LM head x its chunks, MTP's head included), plus SDPA's time x (layers + MTP blocks), and the
    MFU of that floor against count()'s FLOPs, as the training MFU counts them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_profile
    import torch

    from llmtrain.accounting import count, matmuls
    from llmtrain.config import load_config
    from llmtrain.model.loss import _chunk_rows

    cfg = load_config(ROOT / "configs" / "debug.yaml", ["model.mtp_depth=1"])
    c, micro, seq = cfg.model, 3, 2000  # 6,000 tokens: the LM head runs in 1.46 chunks on CPU
    per_row = {m.name: 1e-3 * (i + 1) for i, m in enumerate(matmuls(c, micro * seq))}

    def fake_attention(cfg, micro, seq, dev, sync, deadline, totals):
        totals["attention_s"] = 0.5e-3
        yield "sdpa (stub)"

    monkeypatch.setattr(gpu_profile, "ceiling_rows", lambda dev, sync: iter(()))
    monkeypatch.setattr(gpu_profile, "_matmul_seconds",
                        lambda m, rows, dev, dt, sync: (per_row[m.name], "stub"))  # fmt: skip
    monkeypatch.setattr(gpu_profile, "attention_table", fake_attention)
    lines = list(gpu_profile.kernel_tables(cfg, micro, seq, "cpu", lambda: None, 1e18))
    bound = next(line for line in lines if line.startswith("bound:"))

    tokens = micro * seq
    chunk = min(tokens, _chunk_rows(c.vocab_size, torch.device("cpu")))
    want = sum(per_row[m.name] * (m.count * tokens / chunk if m.name == "lm_head" else m.count)
               for m in matmuls(c, tokens))  # fmt: skip
    blocks = c.num_layers + c.mtp_depth
    floor = want + blocks * 0.5e-3
    mfu = count(c, seq_len=seq).flops_per_token * tokens / floor / gpu_profile.PEAK_BF16
    m = re.search(r"matmuls ([\d.]+) ms \+ attention (\d+) x ([\d.]+) ms = ([\d.]+) ms.*"
                  r"MFU <= ([\d.e+-]+)%", bound)  # fmt: skip
    assert m, bound
    assert float(m.group(1)) == pytest.approx(want * 1e3, abs=0.06), bound
    assert int(m.group(2)) == blocks == 4 and float(m.group(3)) == pytest.approx(0.5)
    assert chunk < tokens
    assert float(m.group(4)) == pytest.approx(floor * 1e3, abs=0.06), bound
    assert float(m.group(5)) == pytest.approx(100 * mfu, rel=1e-2), bound


def _smoke_check(tmp_path, budget: int, skip: str):
    """launch/gpu_check.sh in CPU smoke mode with a budget and steps to skip: (process, log)."""
    env = dict(os.environ, GPU_CHECK_CPU_SMOKE="1", OUT=str(tmp_path / "out"),
               PYTHON=sys.executable, LLMTRAIN_CACHE=str(tmp_path / "cache"),
               GPU_CHECK_BUDGET=str(budget), GPU_CHECK_SKIP=skip,
               GPU_CHECK_SITE=str(tmp_path / "site"))  # fmt: skip
    p = subprocess.run(["bash", "launch/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    return p, p.stdout + p.stderr


@pytest.mark.slow
def test_gpu_check_fails_a_step_the_budget_leaves_out_and_says_how_to_rerun(tmp_path):
    """A step the budget cannot fit fails the check (no figure is not a pass), and the summary
    ends with the rerun that leaves out what passed (set-up and data always run again)."""
    done = "bench_moe_1b tests_gpu tests_gpu_train bench_moe_100m bench_moe_1b_wide kernels"
    p, log = _smoke_check(tmp_path, budget=45, skip=done)
    assert p.returncode == 1, log[-3000:]
    assert re.search(r"\nbench_moe_1b_graphs +no-time", log), log[-3000:]
    assert f'rerun the rest: GPU_CHECK_BUDGET=180 GPU_CHECK_SKIP="{done}"' in log, log[-1500:]


@pytest.mark.slow
def test_gpu_profile_bare_model_runs_on_cpu(tmp_path):
    """benchmarks/gpu_profile.py without --kernels (the bare model's step, profiled), which the
    GPU check no longer runs: its smoke mode on CPU writes the headline lines and the table."""
    out = tmp_path / "p.txt"
    cmd = [sys.executable, "benchmarks/gpu_profile.py", "--cpu", "--config", "configs/debug.yaml",
           "--micro", "2", "--seq", "64", "--steps", "1", "--out", str(out)]  # fmt: skip
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    text = out.read_text()
    assert "fwd+bwd" in text and "outside torch's allocator" in text, text[:2000]
    assert "GPU kernel time per fwd+bwd by kind: n/a" in text, text[:2000]


def test_gpu_check_passes_when_the_budget_misses_only_an_optional_step(tmp_path):
    """The kernel timings (a diagnostic measured before) are optional: the budget leaving them
    out is said in the summary and does not fail the check."""
    skip = ("setup prepare_data bench_moe_1b tests_gpu tests_gpu_train bench_moe_100m "
            "bench_moe_1b_wide bench_moe_1b_graphs")  # fmt: skip
    p, log = _smoke_check(tmp_path, budget=10, skip=skip)
    assert p.returncode == 0, log[-3000:]
    assert re.search(r"\nkernels +no-time-optional", log), log[-3000:]
    assert "rerun the rest" not in log


def test_gpu_check_summary_survives_files_a_killed_step_cut_short(tmp_path):
    """A step killed while writing (its time ran out) leaves a cut junit XML or JSON under $OUT:
    the summary says so and prints the rest, instead of losing the table to a traceback."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "tests_gpu.xml").write_text('<?xml version="1.0"?><testsuites><testsuite name="py')
    (out / "gpu_train_moe_1b.json").write_text('{"name": "moe_1b", "tokens_per')
    (out / "gpu_train_moe_100m.json").write_text(json.dumps({"name": "moe_100m", "mfu": 0.1}))
    skip = ("setup prepare_data bench_moe_1b tests_gpu tests_gpu_train bench_moe_100m "
            "bench_moe_1b_wide bench_moe_1b_graphs kernels")  # fmt: skip
    p, log = _smoke_check(tmp_path, budget=10, skip=skip)
    assert p.returncode == 0, log[-3000:]
    assert "tests_gpu.xml is unreadable" in log and "gpu_train_moe_1b.json is unreadable" in log
    assert "\nmoe_100m " in log and "Traceback" not in log, log[-3000:]
