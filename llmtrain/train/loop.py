"""The training run: data → model → DeepSpeed engine → steps, metrics, evals, checkpoints, resume.

Shape legend: B micro-batch, T sequence length, L MoE layers, E routed experts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from llmtrain.accounting import count
from llmtrain.config import Config
from llmtrain.data.corpus import DataError
from llmtrain.data.loader import PackedDataset, batches_for_step, document_mask
from llmtrain.data.prepare import prepare_data
from llmtrain.model import build_model, generate
from llmtrain.parallel.layout import make_layout
from llmtrain.train import checkpoint as ckpt
from llmtrain.train import faults, health
from llmtrain.train.metrics import MetricsLogger, peak_flops_per_device
from llmtrain.train.schedule import lr_at
from llmtrain.train.signals import StopOnSignal

logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """The run stopped for a reason the user can act on (the message says which)."""


def _prepare_run_dir(run_dir: Path, resume: str, overwrite: bool, rank: int) -> None:
    has_run = (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()
    if has_run and resume == "never":
        if not overwrite:
            raise TrainingError(
                f"run directory {run_dir} already holds a run; pass resume=auto to continue it, "
                "--overwrite to start over, or another --run-dir"
            )
        if rank == 0:
            shutil.rmtree(run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)


def _check_resumed_config(saved_yaml: str, cfg: Config) -> None:
    saved = yaml.safe_load(saved_yaml)
    if saved.get("model") != cfg.to_dict()["model"]:
        diff = [k for k, v in cfg.to_dict()["model"].items() if saved.get("model", {}).get(k) != v]
        raise TrainingError(
            f"the checkpoint was written for another model config (differs in model.{', model.'.join(diff)}); "
            "resume with the same model config or start a new run directory"
        )


# what a run may change when it continues from published weights: training terms, not shapes or routing
_TRAINING_ONLY = {"bias_update_speed", "aux_loss_alpha", "router_z_loss_coef", "mtp_depth", "mtp_loss_weight",
                  "init_std", "attn_backend", "moe_impl", "max_position_embeddings"}  # fmt: skip


def _check_init_from(hf_model, ours, path) -> None:
    a, b = dataclasses.asdict(hf_model), dataclasses.asdict(ours)
    diff = [k for k in a if k not in _TRAINING_ONLY and a[k] != b[k]]
    if diff:
        detail = ", ".join(f"model.{k}={b[k]!r} (checkpoint: {a[k]!r})" for k in diff[:6])
        raise TrainingError(f"train.init_from={path} does not match the model config: {detail}; "
                            "make model.* match the checkpoint's config.json")  # fmt: skip


def train(cfg: Config, run_dir: str | Path, resume: str = "never", overwrite: bool = False) -> dict:
    """Run (or continue) training; returns the final metrics. All ranks call it."""
    from llmtrain.parallel import ops
    from llmtrain.parallel.engine import (
        Engine,
        deepspeed_config,
        device_for,
        init_distributed,
        make_dispatcher,
    )

    run_dir = Path(run_dir)
    # the layout is checked before any process group exists
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    layout = make_layout(cfg, world_env)
    health.check_overflow_guard(deepspeed_config(cfg, layout))
    try:  # a lock left by a killed JIT build would make init_distributed wait forever
        ops.check_jit_locks()
    except ops.StaleLockError as e:
        raise TrainingError(str(e)) from None
    if resume not in ("never", "auto") and not Path(resume).is_dir():
        raise TrainingError(f"resume={resume!r}: use auto, never, or a checkpoint directory")
    rank, world, local_rank = init_distributed(cfg.parallel.backend)
    device = device_for(local_rank)
    try:
        _prepare_run_dir(run_dir, "auto" if resume != "never" else "never", overwrite, rank)
        dist.barrier()
        with StopOnSignal() as stop:
            return _train(cfg, run_dir, resume, layout, rank, world, local_rank, device, Engine,
                          make_dispatcher, stop)  # fmt: skip
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(
    cfg, run_dir, resume, layout, rank, world, local_rank, device, Engine, make_dispatcher, stop
):
    t = cfg.train
    if rank == 0:
        logger.info("layout: %s", layout.describe())
    # ---------------------------------------------------------------- data
    data_dir = prepare_data(cfg.data, cfg.model.vocab_size, local_rank=local_rank)
    dist.barrier()
    train_ds = PackedDataset(data_dir, "train", t.seq_len)
    val_ds = PackedDataset(data_dir, "val", t.seq_len)
    if train_ds.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"the tokenizer has {train_ds.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size}"
        )
    if train_ds.n_seq < layout.global_batch:
        raise DataError(
            f"the training split holds {train_ds.n_seq} sequences of {t.seq_len}, fewer than one "
            f"global batch ({layout.global_batch}); add data or lower train.global_batch_size"
        )
    tokenizer_file = data_dir / "tokenizer.json"

    # ---------------------------------------------------------------- resume point
    start_step, ck_state, ck_weights, ck_moments = 0, {}, None, None
    ck_dir = None
    if resume == "auto":
        ck_dir = ckpt.latest_checkpoint(run_dir)
    elif resume != "never":
        ck_dir = Path(resume)
    if ck_dir is not None:
        ck_weights, ck_moments, ck_state = ckpt.read_checkpoint(ck_dir)
        _check_resumed_config((ck_dir / "config.yaml").read_text(), cfg)
        start_step = int(ck_state["step"])

    # ---------------------------------------------------------------- model + engine
    dispatcher = make_dispatcher(layout)
    if t.init_from and ck_dir is None:
        from llmtrain.hf import model_config_from_hf
        from llmtrain.train.warmstart import hf_weights_for

        hf_cfg = model_config_from_hf(json.loads((Path(t.init_from) / "config.json").read_text()))
        _check_init_from(hf_cfg, cfg.model, t.init_from)
        model = build_model(cfg.model, device=device, seed=t.seed, dispatcher=dispatcher)
        sd = hf_weights_for(
            model, cfg.model, Path(t.init_from), hf_cfg, rank
        )  # MTP: fresh if absent
        ckpt.load_weights_into(model, sd)
    else:
        model = build_model(cfg.model, device=device, seed=t.seed, dispatcher=dispatcher)
    if ck_weights is not None:
        ckpt.load_weights_into(model, ck_weights)
    model.gradient_checkpointing = t.activation_checkpointing
    engine = Engine(model, cfg, layout)
    if ck_weights is not None:
        ckpt.restore_optimizer(engine, model, ck_weights, ck_moments, start_step)
        if "__rng__::torch_cpu" in ck_moments:  # training itself draws none; user code may
            torch.set_rng_state(ck_moments["__rng__::torch_cpu"])
    if rank == 0 and ck_dir is not None:
        logger.info("resumed from %s at step %d", ck_dir, start_step)

    # ---------------------------------------------------------------- metrics
    counts = count(cfg.model, seq_len=t.seq_len)
    peak = t.peak_flops or peak_flops_per_device(device, t.dtype)
    metrics = MetricsLogger(run_dir, rank, t, start_step, counts.flops_per_token, peak, world)
    config_yaml = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    if rank == 0:
        (run_dir / "config.yaml").write_text(config_yaml)

    nan_steps = faults.nan_loss_steps()
    grad_fault = faults.GradFault(model, rank)
    nonfinite_in_row = int(ck_state.get("nonfinite_in_row", 0))
    skipped_total = int(ck_state.get("skipped_steps", 0))
    eos = train_ds.eos_id
    final: dict[str, Any] = {}
    engine.train()
    step = start_step
    last_saved = start_step if ck_dir is not None else -1

    def save(done: int, record: dict) -> None:
        state = {
            "step": done,
            "consumed_samples": done * layout.global_batch,
            "skipped_steps": skipped_total,
            "nonfinite_in_row": 0,
            "world_size": world,
            "ep_size": layout.ep_size,
            "zero_stage": layout.zero_stage,
            "tokens_seen": done * layout.tokens_per_step,
            "flops": done * layout.tokens_per_step * counts.flops_per_token,
            "loss": record["loss"],
            "val_loss": record.get("val_loss"),
        }
        try:
            health.guarded_save(lambda: ckpt.save_checkpoint(
                run_dir, done, engine, model, state, config_yaml, tokenizer_file, t.keep_last, rank
            ), run_dir, done)  # fmt: skip
        except health.SaveError as e:
            metrics.close()  # the progress bar ends before the one-line error
            raise TrainingError(str(e)) from e

    stop.arm()  # from here a signal stops the run at the next step boundary, with a checkpoint
    for step in range(start_step, t.max_steps):
        t0 = time.perf_counter()
        lr = lr_at(t, step)
        grad_fault.arm(step)
        micro = batches_for_step(
            train_ds, step, layout.global_batch, rank, world, layout.micro_batch, t.seed
        )
        lm_sum = torch.zeros((), dtype=torch.float64)
        aux_sum = torch.zeros((), dtype=torch.float64)
        engine.set_lr(lr)
        for mb in micro:
            x, y = train_ds.batch(mb)
            x, y = x.to(device), y.to(device)
            mask = document_mask(x, eos) if cfg.data.doc_mask else None
            out = engine(
                x, labels=y, attention_mask=mask, check_inputs=False
            )  # ids checked once: tokenizer fits
            loss = out.loss * float("nan") if step in nan_steps else out.loss
            # DeepSpeed accumulates until the last micro-batch, then steps; a non-finite gradient
            # norm makes its ZeRO optimizer skip the update (weights and moments untouched).
            engine.backward(loss)
            engine.step()
            lm_sum += out.lm_loss.detach().double().cpu() * (
                float("nan") if step in nan_steps else 1.0
            )
            aux_sum += out.aux_loss.detach().double().cpu()
        stats = torch.stack([lm_sum, aux_sum]).to(device)
        dist.all_reduce(stats)
        gnorm = engine.grad_norm()
        bad = not health.step_ok(float(stats[0]), gnorm)
        # aux-loss-free balancing on the global expert load: every rank applies the same update
        loads = model.expert_loads().to(device).float()
        if loads.numel():
            dist.all_reduce(loads)
            step_loads = loads.clone()
            if bad:
                loads.zero_()  # a skipped step moves no bias
            model.update_router_biases(loads)
        else:
            step_loads = None
        if bad:
            nonfinite_in_row += 1
            skipped_total += 1
            if rank == 0:
                logger.warning(
                    "step %d: non-finite loss or gradients; step skipped (%d in a row)",
                    step,
                    nonfinite_in_row,
                )
            if nonfinite_in_row >= t.max_nonfinite:
                raise TrainingError(
                    f"{nonfinite_in_row} non-finite steps in a row (train.max_nonfinite={t.max_nonfinite}) at "
                    f"step {step}; the last good checkpoint is kept in {run_dir / 'checkpoints'}. Lower "
                    "train.lr, check the data, or raise train.max_nonfinite"
                )
        else:
            nonfinite_in_row = 0
        n_micro = len(micro) * world
        record = {
            "step": step + 1,
            "loss": float(stats[0]) / n_micro if not bad else float("nan"),
            "aux_loss": float(stats[1]) / n_micro if not bad else float("nan"),
            "lr": lr,
            "grad_norm": gnorm,
            "skipped": bad,
            "skipped_total": skipped_total,
        }
        done = step + 1
        if done % t.eval_every == 0 or done == t.max_steps:
            record["val_loss"] = evaluate(
                engine, val_ds, layout, rank, world, device, t.eval_batches, eos, cfg.data.doc_mask
            )
        if done % t.log_every == 0 or done == t.max_steps or "val_loss" in record:
            metrics.log(record, model, time.perf_counter() - t0, layout.tokens_per_step, step_loads)
        else:
            metrics.tick(time.perf_counter() - t0, layout.tokens_per_step)
        final = record
        if (done % t.save_every == 0 or done == t.max_steps) and nonfinite_in_row == 0:
            save(done, record)
            last_saved = done
        signum = stop.agreed()  # collective: every rank stops at the same step
        if signum is not None and done < t.max_steps:
            metrics.close()
            raise TrainingError(_stopped_message(stop.name(signum), done, last_saved, save,
                                                 record, nonfinite_in_row, run_dir))  # fmt: skip
    metrics.close()
    if t.sample_tokens and t.max_steps > start_step:
        final["sample"] = _sample(
            model, tokenizer_file, device, t.sample_tokens, layout.zero_stage, rank
        )
        if rank == 0:
            print(f"\n--- sample after {t.max_steps} steps ---\n{final['sample']}\n---")
            (run_dir / "sample.txt").write_text(final["sample"])
    final["last_checkpoint"] = last_saved
    if rank == 0 and "val_loss" in final:
        h = train_ds.unigram_entropy()
        final["unigram_entropy"] = h
        print(
            f"validation loss {final['val_loss']:.3f} nats vs unigram entropy {h:.3f} nats of the data; "
            f"checkpoint {run_dir / 'checkpoints' / f'step_{last_saved:08d}'}"
        )
    return final


def _stopped_message(sig, done, last_saved, save, record, nonfinite_in_row, run_dir) -> str:
    """Save at the boundary where the ranks agreed to stop (unless just saved), one line."""
    if last_saved != done and nonfinite_in_row == 0:
        save(done, record)
        last_saved = done
    if last_saved == done:
        where = f"checkpoint {run_dir / 'checkpoints' / f'step_{done:08d}'} saved"
    else:
        where = "no checkpoint saved (the last step was non-finite)"
    return f"stopped by {sig} after step {done}: {where}; continue with resume=auto"


@torch.no_grad()
def evaluate(engine, ds, layout, rank, world, device, n_batches, eos, doc_mask) -> float:
    """Mean validation loss over the first `n_batches` global batches of the validation split:
    the same sequences at every step and at any world size. Ranks take consecutive shares of
    ceil(n / world) sequences; the last shares are short (or empty), and a rank with nothing
    left in a round runs a weight-0 forward so every rank joins the same collectives."""
    from llmtrain.parallel import comm

    engine.train(False)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    n = min(ds.n_seq, n_batches * layout.global_batch)
    per = -(-n // world)
    mine = list(range(rank * per, min((rank + 1) * per, n)))
    for i in range(0, per, layout.micro_batch):
        idx = mine[i : i + layout.micro_batch]
        x, y = ds.batch(idx or [0])
        x, y = x.to(device), y.to(device)
        out = engine(x, labels=y, attention_mask=document_mask(x, eos) if doc_mask else None)
        if idx:  # every label is a real token: the batch mean times its rows is the batch sum
            total += torch.tensor(
                [float(out.lm_loss) * len(idx), len(idx)], dtype=torch.float64, device=device
            )
    comm.all_reduce(total)
    engine.train(True)
    return float(total[0] / total[1])


def _sample(model, tokenizer_file: Path, device, n: int, zero_stage: int, rank: int) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    prompt = torch.tensor([tok.encode("def ").ids], device=device)
    # ZeRO-3 gathers weights per module call; the latent-cache path reads kv_b_proj directly
    out = generate(model, prompt, n, use_cache=zero_stage != 3)
    return tok.decode(out[0].tolist())
