"""The training run: data → model → DeepSpeed engine → steps, metrics, evals, checkpoints, resume.

Shape legend: B micro-batch, T sequence length, L MoE layers, E routed experts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import yaml

from llmtrain.accounting import count
from llmtrain.config import Config
from llmtrain.data.corpus import DataError
from llmtrain.data.loader import PackedDataset, batches_for_step, permute
from llmtrain.data.prepare import NOT_IN_KEY, prepare_data
from llmtrain.errors import LlmtrainError, once_a_node
from llmtrain.model import build_model, generate
from llmtrain.model.attention import DocumentMask
from llmtrain.parallel import comm
from llmtrain.parallel.layout import make_layout
from llmtrain.train import faults, health, profiling
from llmtrain.train.checkpointing import Checkpointer
from llmtrain.train.compile import uses_cuda_graphs
from llmtrain.train.evals import check_eval_tasks, periodic_evals
from llmtrain.train.metrics import MetricsLogger, peak_flops_per_device
from llmtrain.train.schedule import lr_at
from llmtrain.train.signals import STOP_FILE, STOP_FILE_NAME, StopOnSignal

logger = logging.getLogger(__name__)
VAL_SEED = 0x5EED  # the validation sample: one for every run


class TrainingError(LlmtrainError, RuntimeError):
    """The run stopped for a reason the user can act on (the message says which)."""


class AgreedStop(TrainingError):
    """A stop every rank agreed on collectively; only rank 0 prints its line."""

    same_on_every_rank = True


def _prepare_run_dir(run_dir: Path, resume: str, overwrite: bool, rank: int):
    """Check and make the run directory; returns rank 0's lock on it (held for the run).

    One trainer per run directory: a requeued job started while the previous one still writes
    its SIGTERM checkpoint would otherwise delete that save's files (stale `.tmp` cleanup) and
    the two would prune each other's checkpoints. The lock is an flock on RUN/.lock (NFSv4 and
    local filesystems; where the filesystem has no locks, e.g. Lustre without -o flock, the run
    goes on unlocked). Rank 0 decides; every rank raises the same error."""
    has_run = (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()
    if has_run and resume == "never" and not overwrite:
        raise TrainingError(
            f"run directory {run_dir} already holds a run; pass resume=auto to continue it, "
            "--overwrite to start over, or another --run-dir"
        )
    lock, err = None, None
    if rank == 0:
        try:
            lock = _lock_run_dir(run_dir)
            if has_run and resume == "never":  # --overwrite: all but the lock we now hold
                for p in run_dir.iterdir():
                    if p.name != _LOCK:
                        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        except TrainingError as e:
            err = str(e)
        except OSError as e:  # said on every rank (the others wait in the broadcast)
            err = f"cannot write the run directory {run_dir}: {e.strerror or e}"
    err = comm.broadcast_object(err)
    if err is not None:
        if lock is not None:  # taken, then --overwrite failed: not held past this run's end
            lock.close()
        raise TrainingError(err)
    return lock


_LOCK = ".lock"


def _lock_run_dir(run_dir: Path):
    import errno
    import fcntl
    import socket

    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / _LOCK, "a+")  # noqa: SIM115 (held for the run)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        who = f.read().strip() or "another process"
        f.close()
        raise TrainingError(
            f"{run_dir} is in use by another `llmtrain train` ({who}); wait until it stops (a "
            "requeued job: the previous one may still be saving its checkpoint), or give "
            "another --run-dir"
        ) from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        logger.info(
            "%s: this filesystem has no file locks; the run directory is not locked", run_dir
        )
        return f
    f.seek(0)
    f.truncate()
    f.write(
        f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    )
    f.flush()
    return f


# what a run may change when it continues from published weights: training terms, not shapes or routing
_TRAINING_ONLY = {"bias_update_speed", "aux_loss_alpha", "router_z_loss_coef", "mtp_depth", "mtp_loss_weight",
                  "init_std", "attn_backend", "moe_impl", "max_position_embeddings"}  # fmt: skip
# ... and what a resumed run may change (its parameters and optimizer state must keep their shapes):
# DeepSeek-V3 sets the bias update speed to 0 and the MTP weight from 0.3 to 0.1 late in training
_RESUMABLE = _TRAINING_ONLY - {"mtp_depth"}


def _comparable_model(d: dict) -> dict:
    """A model section with the defaults of fields it lacks (a checkpoint of an earlier release)
    and without rope fields its rope type does not read (default RoPE reads theta and layout)."""
    from llmtrain.config import ModelConfig, from_dict

    try:
        out = dataclasses.asdict(from_dict(ModelConfig, dict(d), "model")) if d else {}
    except (ValueError, TypeError, AttributeError):
        out = dict(d)
    rope = out.get("rope")
    if isinstance(rope, dict) and rope.get("type", "default") == "default":
        out["rope"] = {k: rope.get(k) for k in ("theta", "type", "interleave")}
    return out


def _check_resumed_config(saved_yaml: str, cfg: Config, state: dict | None = None) -> list[str]:
    """Refuse a model the checkpoint cannot fill; return warnings for the changes a resumed run
    may make but should know the cost of (data order, schedule, counters)."""
    saved = yaml.safe_load(saved_yaml) or {}
    now = cfg.to_dict()
    old_model = _comparable_model(saved.get("model", {}))
    now["model"] = _comparable_model(now["model"])
    diff = [k for k, v in now["model"].items() if old_model.get(k) != v]
    if "rope" in diff:  # name the rope field, not the whole section
        ro, rn = old_model.get("rope") or {}, now["model"]["rope"]
        diff = [k for k in diff if k != "rope"] + [f"rope.{k}" for k in rn if ro.get(k) != rn[k]]
    fixed = [k for k in diff if k not in _RESUMABLE]
    if fixed:
        raise TrainingError(
            f"the checkpoint was written for another model config (differs in model.{', model.'.join(fixed)}); "
            "resume with the same model config or start a new run directory"
        )
    warn = [f"model.{k} changes from {old_model.get(k)!r} to {now['model'][k]!r}" for k in diff]
    old_t, t = saved.get("train", {}), now["train"]
    for k in ("seed", "seq_len"):
        if k in old_t and old_t[k] != t[k]:
            warn.append(f"train.{k} changes from {old_t[k]} to {t[k]}: the data order is another "
                        "one from here on, so sequences may repeat or be skipped")  # fmt: skip
    keys = sorted(k for k in now["data"] if k not in NOT_IN_KEY and "data" in saved
                  and saved["data"].get(k) != now["data"][k])  # fmt: skip
    if keys:  # (cache_dir, num_proc, ... do not change the prepared tokens)
        warn.append(f"data.{', data.'.join(keys)} changed: training continues at the same sample "
                    "position of the new data")  # fmt: skip
    step = int((state or {}).get("step", 0))
    if step and any(old_t.get(k) != t[k] for k in
                    ("lr", "schedule", "max_steps", "warmup_steps", "min_lr_ratio", "decay_fraction")):  # fmt: skip
        try:
            # the LR this step had under the saved schedule: consecutive steps differ anyway
            # (10% apart at step 10 of a warmup) and are no jump
            before = lr_at(SimpleNamespace(**{**t, **old_t}), step)
        except (TypeError, ValueError, AttributeError, ZeroDivisionError):
            before = None
        after = lr_at(cfg.train, step)
        if before is not None and not math.isclose(before, after, rel_tol=0.05):
            hint = (" (the schedule depends on train.max_steps: set the final value from the "
                    "start, or with train.schedule=wsd extend from a checkpoint saved before the "
                    "decay began)" if old_t.get("max_steps") != t["max_steps"] else "")  # fmt: skip
            warn.append(f"the learning rate jumps from {before:.3g} to {after:.3g} at step "
                        f"{step + 1} under the changed schedule{hint}")  # fmt: skip
    return warn


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
        shutdown_distributed,
    )

    run_dir = Path(run_dir)
    # the layout is checked before any process group exists
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    with once_a_node():  # the same config and world size on a node's ranks: said once there
        layout = make_layout(cfg, world_env)
        health.check_overflow_guard(deepspeed_config(cfg, layout))
        check_eval_tasks(cfg.train)  # a missing harness or task fails now, not at the first eval
    try:  # a lock left by a killed JIT build would make init_distributed wait forever
        ops.check_jit_locks()
    except ops.StaleLockError as e:
        raise TrainingError(str(e)) from None
    if resume not in ("never", "auto") and not Path(resume).is_dir():
        raise TrainingError(f"resume={resume!r}: use auto, never, or a checkpoint directory")
    rank, world, local_rank = init_distributed(cfg.parallel.backend)
    lock = None
    try:
        device = device_for(local_rank)
        lock = _prepare_run_dir(run_dir, "auto" if resume != "never" else "never", overwrite,
                                rank)  # fmt: skip
        comm.barrier()
        with StopOnSignal() as stop:
            return _train(cfg, run_dir, resume, layout, rank, world, local_rank, device, Engine,
                          make_dispatcher, stop)  # fmt: skip
    finally:
        try:
            shutdown_distributed()
        finally:
            if lock is not None:  # after the last save (an async one included) is complete
                lock.close()


@dataclasses.dataclass
class _Run:
    """What the steps of one run share."""

    cfg: Config
    run_dir: Path
    layout: Any
    rank: int
    world: int
    device: torch.device
    train_ds: PackedDataset
    val_ds: PackedDataset
    tokenizer_file: Path
    data_id: str = ""  # the prepared data's directory name (its fingerprint)
    model: Any = None
    engine: Any = None
    checkpointer: Checkpointer | None = None
    start_step: int = 0
    # samples / tokens / FLOPs before start_step beyond start_step × this run's per-step amounts
    # (another global batch or sequence length before a resume): the stream continues from there
    sample_base: int = 0
    tokens_base: int = 0
    flops_base: float = 0.0
    nonfinite_in_row: int = 0
    skipped_total: int = 0
    grad_fault: Any = None


def _train(
    cfg, run_dir, resume, layout, rank, world, local_rank, device, Engine, make_dispatcher, stop
):
    t = cfg.train
    if rank == 0:
        logger.info("layout: %s", layout.describe())
        from llmtrain.hf import hf_config_from_model

        try:  # said now, not when `llmtrain export` refuses the run at its end
            hf_config_from_model(cfg.model, mtp=True)
        except ValueError as e:
            logger.warning("this model trains, but stock transformers cannot load it, so "
                           "`llmtrain export` will refuse it: %s", e)  # fmt: skip
        m = cfg.model
        if m.n_routed_experts > 1 and m.bias_update_speed == 0 and m.aux_loss_alpha == 0:
            logger.warning("no load balancing: model.bias_update_speed and model.aux_loss_alpha "
                           "are both 0, so nothing keeps the routed experts evenly loaded; set "
                           "model.bias_update_speed (sigmoid gating) or model.aux_loss_alpha")  # fmt: skip
    run = _load_data(cfg, run_dir, layout, rank, world, local_rank, device)
    run.checkpointer = Checkpointer(run_dir, None, rank, t.keep_last)
    ck_dir = run.checkpointer.resolve(resume)
    if ck_dir is None and resume == "auto" and rank == 0:
        logger.warning("resume=auto: no checkpoint in %s yet; starting at step 0", run_dir)
    if ck_dir is not None:
        state = run.checkpointer.read_state(ck_dir)
        warnings = _check_resumed_config((ck_dir / "config.yaml").read_text(), cfg, state)
        for w in warnings + _check_resumed_data(ck_dir, state, run):
            if rank == 0:
                logger.warning("resuming %s: %s", ck_dir.name, w)
    _build(run, Engine, make_dispatcher, init_from=t.init_from if ck_dir is None else None)
    counts = count(cfg.model, seq_len=t.seq_len)
    _restore(run, ck_dir, counts.flops_per_token)
    if ck_dir is not None and rank == 0:  # a rollback: the abandoned trajectory's saves aside
        run.checkpointer.set_aside_newer(ck_dir, run.start_step)

    peak = t.peak_flops or peak_flops_per_device(device, t.dtype, warn=rank == 0)
    metrics = MetricsLogger(run_dir, rank, t, run.start_step, counts.flops_per_token, peak, world,
                            layout.ep_size)  # fmt: skip
    config_yaml = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    if rank == 0:
        (run_dir / "config.yaml").write_text(config_yaml)

    run.engine.train()
    last_saved = run.start_step if ck_dir is not None else -1
    if rank == 0 and (run_dir / STOP_FILE_NAME).exists():
        logger.warning("%s exists: this launch stops after its first step, with a checkpoint "
                       "(remove it to train on)", run_dir / STOP_FILE_NAME)  # fmt: skip
    stop.arm()  # from here a signal stops the run at the next step boundary, with a checkpoint
    try:
        final, last_saved = _loop(run, stop, metrics, counts, config_yaml, last_saved)
    except BaseException:
        _settle_saves(run)  # a background save finishes (or fails) before the error leaves
        raise
    metrics.close()
    _finish(run, final, last_saved)
    if run.nonfinite_in_row:  # the run's last steps were skipped: its result is not its weights
        ck = run.run_dir / "checkpoints"
        raise AgreedStop(
            f"the last {run.nonfinite_in_row} step(s) were non-finite and skipped, so the final "
            f"weights were not saved; {ck / 'latest'} names the last good checkpoint. Lower "
            "train.lr or check the data, then resume=auto"
        )
    return final


def _loop(run: _Run, stop, metrics, counts, config_yaml: str, last_saved: int):
    """The steps, each with its evaluations, metrics and saves; returns (last record, last
    saved step)."""
    cfg, t, layout, run_dir = run.cfg, run.cfg.train, run.layout, run.run_dir
    rank, world, device = run.rank, run.world, run.device
    nan_steps = faults.nan_loss_steps()
    if t.profile_step and not run.start_step < t.profile_step <= t.max_steps and rank == 0:
        logger.warning(
            "train.profile_step=%d is outside this run's steps %d..%d: nothing is profiled",
            t.profile_step, run.start_step + 1, t.max_steps,
        )  # fmt: skip
    final: dict[str, Any] = {}
    save_s = 0.0  # seconds spent saving since the last record, reported in the next one
    for step in range(run.start_step, t.max_steps):
        t0 = time.perf_counter()
        profiled = t.profile_step == step + 1
        # rank 0 only: one trace says where a step's time goes; every rank tracing would hold
        # the others in their next collective while each writes its own
        with profiling.step_profiler(profiled and rank == 0, device) as prof:
            record, step_loads = _step(run, step, nan_steps)
            if prof is not None and device.type == "cuda":
                torch.cuda.synchronize(device)  # the step's kernels into the profile
        step_s = time.perf_counter() - t0  # tokens/s and MFU: the step alone
        done = step + 1
        if profiled:
            record["profiled"] = True  # its time includes the profiler's
        if prof is not None:
            path = profiling.write_step_profile(prof, run_dir, done, step_s, trace=t.profile_trace)
            logger.info("step %d profiled: %s", done, path)
        t1 = time.perf_counter()
        if done % t.eval_every == 0 or done == t.max_steps:
            record["val_loss"] = evaluate(
                run.engine, run.val_ds, layout, rank, world, device, val_sequences(t, layout),
                run.train_ds.eos_id, cfg.data.doc_mask,
            )  # fmt: skip
        evals = periodic_evals(run, done)  # {} unless harness tasks are due
        record.update(evals)
        if "val_loss" in record or evals:
            record["eval_s"] = round(time.perf_counter() - t1, 3)
        if (done % t.log_every == 0 or done == t.max_steps or "val_loss" in record or evals
                or profiled):  # fmt: skip
            if save_s:
                record["save_s"], save_s = round(save_s, 3), 0.0
            metrics.log(record, run.model, step_s, layout.tokens_per_step, step_loads)
        else:
            metrics.tick(step_s, layout.tokens_per_step)
        final = record
        due = done % t.save_every == 0 or (done == t.max_steps and t.save_final)
        if due and run.nonfinite_in_row == 0:
            t2 = time.perf_counter()
            _save(run, done, record, counts.flops_per_token, config_yaml, metrics)
            save_s += time.perf_counter() - t2
            last_saved = done
        if rank == 0:  # rank 0's clock and view of RUN/STOP decide for all
            stop.check_requests(run_dir, t.time_limit_minutes)
        signum = stop.agreed()  # collective: every rank stops at the same step
        stopping = signum is not None and done < t.max_steps
        if stopping:
            if last_saved != done and run.nonfinite_in_row == 0:
                _save(run, done, record, counts.flops_per_token, config_yaml, metrics)
                last_saved = done
            _wait_saves(run, metrics)
        if signum == STOP_FILE and rank == 0:  # taken (at the last step too): the next launch
            (run_dir / STOP_FILE_NAME).unlink(missing_ok=True)  # trains on
        if stopping:
            metrics.close()
            raise AgreedStop(_stopped_message(stop.name(signum), done, last_saved, run_dir))
    _wait_saves(run, metrics)
    return final, last_saved


def _vocab(tokenizer_file: Path) -> dict[str, int] | None:
    if not tokenizer_file.is_file():
        return None
    from llmtrain.data.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_file).get_vocab(with_added_tokens=True)


def _check_resumed_data(ck_dir: Path, state: dict, run: _Run) -> list[str]:
    """Refuse a resume whose data has another tokenizer than the checkpoint's (every id would
    mean another token); warn when the prepared data itself changed (files added or edited
    under the same config: a new tokenizer may be trained, the sample order changes)."""
    saved, now = _vocab(ck_dir / "tokenizer.json"), _vocab(run.tokenizer_file)
    if saved is not None and now is not None and saved != now:
        moved = sum(1 for k, v in now.items() if saved.get(k) != v)
        raise TrainingError(
            f"the data's tokenizer ({run.tokenizer_file}) is not the one {ck_dir.name} was "
            f"trained with ({moved} of {len(now)} tokens have other ids; the data was prepared "
            "again, e.g. after its files changed, and a new tokenizer trained): set "
            f"data.tokenizer={ck_dir / 'tokenizer.json'} to keep the run's tokenizer, or start "
            "a new run directory"
        )
    data = state.get("data") or {}
    warn = []
    if data.get("id") not in (None, run.data_id):
        warn.append(f"the prepared data is another one ({data['id']} -> {run.data_id}: its files "
                    "changed): training continues at the same sample position of the new data")  # fmt: skip
    if data.get("train_sequences") not in (None, run.train_ds.n_seq):
        warn.append(f"the training split holds {run.train_ds.n_seq} sequences, "
                    f"{data['train_sequences']} when saved: the sample order is another one")  # fmt: skip
    return warn


def _load_data(cfg, run_dir, layout, rank, world, local_rank, device) -> _Run:
    t = cfg.train
    data_dir = prepare_data(cfg.data, cfg.model.vocab_size, local_rank=local_rank)
    comm.barrier()
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
    epochs = t.max_steps * layout.global_batch / train_ds.n_seq
    if epochs > 1 and rank == 0:
        logger.warning(
            "train.max_steps=%d x %d sequences reads the training split (%d sequences of %d) "
            "%.2f times: from step %d on sequences repeat, each pass in another seeded order",
            t.max_steps,
            layout.global_batch,
            train_ds.n_seq,
            t.seq_len,
            epochs,
            train_ds.n_seq // layout.global_batch + 1,
        )
    return _Run(cfg, run_dir, layout, rank, world, device, train_ds, val_ds,
                data_dir / "tokenizer.json", data_id=data_dir.name)  # fmt: skip


def _build(run: _Run, Engine, make_dispatcher, init_from: str | None) -> None:
    """Model (from the seed, or `train.init_from`'s weights) and the DeepSpeed engine; a resume
    then writes the checkpoint's pieces into the engine (`_restore`)."""
    run.model, run.engine = build_model_and_engine(run.cfg, run.layout, run.device, Engine,
                                                   make_dispatcher, init_from)  # fmt: skip
    run.grad_fault = faults.GradFault(run.model, run.rank)  # LLMTRAIN_FAULT_GRAD_STEPS (tests)
    run.checkpointer.model, run.checkpointer.engine = run.model, run.engine


def build_model_and_engine(cfg: Config, layout, device, Engine=None, make_dispatcher=None,
                           init_from: str | None = None):  # fmt: skip
    """(model, engine) at `layout`. Each rank allocates only what it keeps: its experts, and
    under ZeRO-3 its partition (zero.Init). Training and `llmtrain eval --sharded` build so."""
    from llmtrain.parallel import engine as eng

    Engine, make_dispatcher = Engine or eng.Engine, make_dispatcher or eng.make_dispatcher
    t = cfg.train
    dispatcher = make_dispatcher(layout)
    hooks = eng.sharded_build(cfg, layout, dispatcher)
    partition = eng.zero3_partition if "init_context" in hooks else None  # ZeRO-3's partitions
    # bf16 weights from the start (routers fp32): DeepSpeed makes its fp32 masters from the bf16
    # weights anyway, and an fp32 model would need twice the device memory before the engine
    dtype = torch.bfloat16 if t.dtype == "bf16" else torch.float32
    model = build_model(cfg.model, device=device, dtype=dtype, seed=t.seed,
                        dispatcher=dispatcher, **hooks)  # fmt: skip
    if init_from:
        from llmtrain.hf import load_hf_into, model_config_from_hf

        hf_cfg = model_config_from_hf(json.loads((Path(init_from) / "config.json").read_text()))
        _check_init_from(hf_cfg, cfg.model, init_from)
        # only this rank's experts are read; under ZeRO-3 only the rows of its partitions
        load_hf_into(model, Path(init_from), cfg.model, partition=partition)
    model.gradient_checkpointing = t.activation_checkpointing
    if t.compile:
        from llmtrain.train.compile import compile_blocks

        compile_blocks(model, expert_parallel=layout.ep_size > 1, mode=t.compile_mode)
    return model, Engine(model, cfg, layout)


def _restore(run: _Run, ck_dir: Path | None, flops_per_token: float) -> dict:
    """Weights, Adam moments, router biases, RNG and counters from the checkpoint, if any."""
    if ck_dir is None:
        return {}
    state = run.checkpointer.restore(ck_dir)
    run.start_step = s0 = int(state["step"])
    lay = run.layout
    run.sample_base = (
        int(state.get("consumed_samples", s0 * lay.global_batch)) - s0 * lay.global_batch
    )
    run.tokens_base = (
        int(state.get("tokens_seen", s0 * lay.tokens_per_step)) - s0 * lay.tokens_per_step
    )
    done_flops = s0 * lay.tokens_per_step * flops_per_token
    run.flops_base = float(state.get("flops", done_flops)) - done_flops
    run.nonfinite_in_row = int(state.get("nonfinite_in_row", 0))
    run.skipped_total = int(state.get("skipped_steps", 0))
    if run.rank == 0:
        logger.info("resumed from %s at step %d", ck_dir, run.start_step)
    return state


def _step(run: _Run, step: int, nan_steps: set[int]) -> tuple[dict, torch.Tensor | None]:
    """One optimizer step over the global batch; returns the metrics record and expert loads."""
    cfg, t, layout, engine, model = run.cfg, run.cfg.train, run.layout, run.engine, run.model
    device, rank, world = run.device, run.rank, run.world
    lr = lr_at(t, step)
    faults.maybe_kill(rank, step + 1)  # the hooks number steps from 1, as metrics do
    run.grad_fault.arm(step + 1)
    micro = batches_for_step(
        run.train_ds, step, layout.global_batch, rank, world, layout.micro_batch, t.seed,
        first_sample=step * layout.global_batch + run.sample_base,
    )  # fmt: skip
    # Sums stay on the device and inputs are copied without waiting: nothing in the micro-batch
    # loop makes the host wait for the GPU, so it prepares the next micro-batch meanwhile.
    stats = torch.zeros(3, dtype=torch.float64, device=device)  # lm loss, aux loss, MTP loss
    engine.set_lr(lr)
    graphs = cfg.train.compile and uses_cuda_graphs(cfg.train.compile_mode)
    for mb in micro:
        x, y = run.train_ds.batch(mb)
        x, y = _to_device(x, device), _to_device(y, device)
        if graphs:  # the last micro-batch's graph outputs are consumed: their memory may be reused
            torch.compiler.cudagraph_mark_step_begin()
        mask = DocumentMask.from_eos(x, run.train_ds.eos_id) if cfg.data.doc_mask else None
        out = engine(
            x, labels=y, attention_mask=mask, check_inputs=False
        )  # ids checked once: tokenizer fits
        loss = out.loss * float("nan") if step + 1 in nan_steps else out.loss
        # DeepSpeed accumulates until the last micro-batch, then steps; a non-finite gradient
        # norm makes its ZeRO optimizer skip the update (weights and moments untouched).
        engine.backward(loss)
        engine.step()
        lm = out.lm_loss.detach().double() * (float("nan") if step + 1 in nan_steps else 1.0)
        mtp = out.mtp_loss.detach().double() if out.mtp_loss is not None else lm.new_zeros(())
        stats += torch.stack([lm, out.aux_loss.detach().double(), mtp])
    comm.all_reduce(stats)
    gnorm = engine.grad_norm()
    bad = not health.step_ok(float(stats[0]), gnorm)  # also DeepSpeed's -1 / None norms
    # aux-loss-free balancing on the global expert load: every rank applies the same update
    # float64: exact counts to 2**53 (a DeepSeek-V3 batch's per-layer sums pass fp32's 2**24)
    loads = model.expert_loads().to(device).double()
    if loads.numel():
        comm.all_reduce(loads)
        step_loads = loads.clone()
        if bad:
            loads.zero_()  # a skipped step moves no bias
        model.update_router_biases(loads)
    else:
        step_loads = None
    if bad:
        run.nonfinite_in_row += 1
        run.skipped_total += 1
        if rank == 0:
            logger.warning(
                "step %d: non-finite loss or gradients; step skipped (%d in a row)",
                step + 1,
                run.nonfinite_in_row,
            )
        if run.nonfinite_in_row >= t.max_nonfinite:  # `bad` is all-reduced: every rank agrees
            raise AgreedStop(
                f"{run.nonfinite_in_row} non-finite steps in a row (train.max_nonfinite={t.max_nonfinite}) at "
                f"step {step + 1}; the last good checkpoint is kept in {run.run_dir / 'checkpoints'}. Lower "
                "train.lr, check the data, or raise train.max_nonfinite"
            )
    else:
        run.nonfinite_in_row = 0
    n_micro = len(micro) * world
    record = {
        "step": step + 1,
        "loss": float(stats[0]) / n_micro if not bad else float("nan"),
        "aux_loss": float(stats[1]) / n_micro if not bad else float("nan"),
        # mean over the MTP depths, before mtp_loss_weight (DeepSeek-V3's L_MTP / λ)
        **(
            {"mtp_loss": float(stats[2]) / n_micro if not bad else float("nan")}
            if cfg.model.mtp_depth
            else {}
        ),
        "lr": lr,
        "grad_norm": gnorm,
        "skipped": bad,
        "skipped_total": run.skipped_total,
    }
    return record, step_loads


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host → GPU from pinned memory without blocking the host (a plain copy from pageable
    memory waits for the GPU to finish everything queued before it)."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def _save(run: _Run, done: int, record: dict, flops_per_token: float, config_yaml: str,
          metrics) -> None:  # fmt: skip
    layout = run.layout
    state = {
        "step": done,
        "consumed_samples": done * layout.global_batch + run.sample_base,
        "skipped_steps": run.skipped_total,
        "nonfinite_in_row": 0,
        "world_size": run.world,
        "ep_size": layout.ep_size,
        "zero_stage": layout.zero_stage,
        "tokens_seen": done * layout.tokens_per_step + run.tokens_base,
        "flops": done * layout.tokens_per_step * flops_per_token + run.flops_base,
        "loss": record["loss"],
        "val_loss": record.get("val_loss"),
        "data": {"id": run.data_id, "train_sequences": run.train_ds.n_seq},
    }
    asynchronous = run.cfg.train.async_save
    try:
        health.guarded_save(
            lambda: run.checkpointer.save(
                done, state, config_yaml, run.tokenizer_file, asynchronous=asynchronous
            ),
            run.run_dir,
            done,
        )
    except health.SaveError as e:
        metrics.close()  # the progress bar ends before the one-line error
        raise TrainingError(str(e)) from e


def _wait_saves(run: _Run, metrics) -> None:
    """The background save (train.async_save) is complete and `latest`, or its error raised."""
    try:
        run.checkpointer.wait()
    except health.SaveError as e:
        metrics.close()
        raise TrainingError(str(e)) from e


def _settle_saves(run: _Run) -> None:
    """On the way out with an error: let a background save finish; its own failure is logged,
    not raised over the error that is leaving."""
    if run.checkpointer is None:
        return
    try:
        run.checkpointer.wait()
    except Exception as e:
        logger.error("the background checkpoint save failed too: %s", e)


def _stopped_message(sig: str, done: int, last_saved: int, run_dir: Path) -> str:
    if last_saved == done:
        where = f"checkpoint {run_dir / 'checkpoints' / f'step_{done:08d}'} saved"
    else:
        where = "no checkpoint saved (the last step was non-finite)"
    return f"stopped by {sig} after step {done}: {where}; continue with resume=auto"


def _finish(run: _Run, final: dict, last_saved: int) -> None:
    """Sample some text and print the closing line."""
    t, rank = run.cfg.train, run.rank
    if t.sample_tokens and t.max_steps > run.start_step:
        final["sample"] = _sample(
            run.model, run.tokenizer_file, run.device, t.sample_tokens, run.layout.zero_stage, rank
        )
        if rank == 0:
            print(f"\n--- sample after {t.max_steps} steps ---\n{final['sample']}\n---")
            (run.run_dir / "sample.txt").write_text(final["sample"])
    final["last_checkpoint"] = last_saved
    if t.compile:
        from llmtrain.train.compile import compile_stats

        final["compile"] = compile_stats()
        if rank == 0:
            logger.info("torch.compile on rank 0: %s", final["compile"])
    if rank == 0 and "val_loss" in final:
        h = run.train_ds.unigram_entropy()
        final["unigram_entropy"] = h
        ck = run.run_dir / "checkpoints" / f"step_{last_saved:08d}"
        if last_saved == t.max_steps:
            where = f"checkpoint {ck}"
        elif not t.save_final:
            where = "final weights not saved (train.save_final=false)" + (
                f"; last checkpoint {ck}" if last_saved >= 0 else ""
            )
        else:  # the last step was non-finite: nothing newer than the last good checkpoint
            where = f"last good checkpoint {ck}" if last_saved >= 0 else "no checkpoint saved"
        print(
            f"validation loss {final['val_loss']:.3f} nats vs unigram entropy {h:.3f} nats of the "
            f"data; {where}"
        )


def val_sequences(t, layout) -> int:
    """How many validation sequences an evaluation scores: train.eval_sequences, or eval_batches
    global batches."""
    return t.eval_sequences or t.eval_batches * layout.global_batch


@torch.no_grad()
def evaluate(engine, ds, layout, rank, world, device, n_seqs, eos, doc_mask) -> float:
    """Mean validation loss over the first `n_seqs` validation sequences of a fixed permutation
    of the whole split (its first sequences would be its first files only): the same sequences
    at every step, for every seed and at any world size (a smaller sample is a prefix of a
    larger one). Ranks take consecutive shares of ceil(n / world) sequences; the last shares are
    short (or empty), and a rank with nothing left in a round runs a weight-0 forward so every
    rank joins the same collectives."""
    engine.train(False)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    n = min(ds.n_seq, n_seqs)
    per = -(-n // world)
    order = permute(np.arange(n), ds.n_seq, seed=VAL_SEED, epoch=0)
    mine = order[rank * per : min((rank + 1) * per, n)].tolist()
    for i in range(0, per, layout.micro_batch):
        idx = mine[i : i + layout.micro_batch]
        x, y = ds.batch(idx or [0])
        x, y = x.to(device), y.to(device)
        out = engine(
            x, labels=y, attention_mask=DocumentMask.from_eos(x, eos) if doc_mask else None
        )
        if idx:  # every label is a real token: the batch mean times its rows is the batch sum
            total[0] += out.lm_loss.detach().double() * len(idx)  # on the device: no host sync
            total[1] += len(idx)
    comm.all_reduce(total)
    engine.train(True)
    return float(total[0] / total[1])


def _sample(model, tokenizer_file: Path, device, n: int, zero_stage: int, rank: int) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    prompt = torch.tensor([tok.encode("def ").ids], device=device)
    # under ZeRO-3 the engine registered the weights the latent-cache path reads directly
    out = generate(model, prompt, n, use_cache=True)
    return tok.decode(out[0].tolist())
