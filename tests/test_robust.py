"""Robustness: non-finite gradients, signals, a full disk, stale JIT locks, validation at any world
size, warm starts without MTP layers, configs that could not be exported, user tokenizers."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from llmtrain.config import ConfigError, load_config
from llmtrain.parallel import ops
from llmtrain.train import health

from .conftest import ROOT
from .train_utils import (
    VENV_BIN,
    env,
    free_port,
    in_stop_on_signal,
    metrics,
    run_then_exit,
    run_train,
    train_cmd,
)

STEPS = 16


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def base(cache, *extra):
    return [f"train.max_steps={STEPS}", "train.warmup_steps=2", f"data.cache_dir={cache}",
            "train.sample_tokens=0", "train.eval_every=8", "train.save_every=100",
            "train.tensorboard=false", "data.tokenizer_train_bytes=1000000", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    d = tmp_path_factory.mktemp("ref") / "run"
    run_train(d, 1, base(cache))
    return d


def _last_line(stderr: str) -> str:
    return [line for line in stderr.splitlines() if line.strip()][-1]


# ---------------------------------------------------------------- (a) non-finite gradients


def test_step_ok_rejects_deepspeed_norm_sentinels():
    assert health.step_ok(2.0, 0.5)
    for norm in (-1.0, None, float("nan"), float("inf")):  # ZeRO-1/2 report invalid norms as -1
        assert not health.step_ok(2.0, norm), norm
    assert not health.step_ok(float("nan"), 0.5)


def test_disabling_deepspeeds_overflow_check_is_refused(cache, tmp_path):
    """With bf16.check_grad_overflow=false ZeRO applies a NaN gradient and every weight turns NaN."""
    p = run_train(tmp_path / "run", 1, base(cache, "train.dtype=bf16", "train.max_steps=4",
                  "train.deepspeed.bf16.check_grad_overflow=false"), check=False,
                  LLMTRAIN_FAULT_GRAD_STEPS="3")  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    assert "train.deepspeed.bf16.check_grad_overflow" in _last_line(p.stderr)
    assert "Traceback" not in p.stderr


def _grad_worker(tmp_path, nproc: int, dtypes: str) -> dict:
    out = tmp_path / "out.json"
    worker = str(ROOT / "tests" / "robust_grad_worker.py")
    if nproc == 1:
        cmd = [sys.executable, worker, str(out)]
    else:
        cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port",
               str(free_port()), worker, str(out)]  # fmt: skip
    p = subprocess.run(cmd, cwd=tmp_path, env=env(LLMTRAIN_TEST_DTYPES=dtypes), capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return json.loads(out.read_text())


def _check_grad_results(res: dict) -> None:
    for layout, r in res.items():
        assert r["ok"] == [True, True, False, True], (layout, r["norms"])
        assert all(r[f"loss_finite_{s}"] for s in range(4)), layout  # only the gradient was bad
        assert r["changed_by_bad_step"] == [], (layout, r["changed_by_bad_step"][:5])
        assert r["changed_after"] > 0, layout  # the next good step does update
        if "nonfinite_save" in r:
            assert "non-finite values" in r["nonfinite_save"], r["nonfinite_save"]
            assert r["ckpt_files"] == [], r["ckpt_files"]  # no step dir, no `latest`, no .tmp


def test_nonfinite_gradient_is_skipped_bf16_zero123(tmp_path):
    """One process, bf16 (ZeRO 1/2/3 partition even alone): a NaN gradient with a finite loss is
    a skipped step, weights and both Adam moments bit-identical; NaN state is never saved."""
    _check_grad_results(_grad_worker(tmp_path, 1, "bf16"))


@pytest.mark.slow
def test_nonfinite_gradient_is_skipped_two_ranks_fp32_bf16(tmp_path):
    _check_grad_results(_grad_worker(tmp_path, 2, "fp32,bf16"))


def test_nonfinite_gradient_step_is_counted_and_never_saved(cache, tmp_path):
    run = tmp_path / "run"
    run_train(run, 1, base(cache, "train.max_steps=4", "train.save_every=1", "train.keep_last=10",
                           "train.eval_every=100"), LLMTRAIN_FAULT_GRAD_STEPS="3")  # fmt: skip
    m = metrics(run)
    assert [r["skipped"] for r in m] == [False, False, True, False]
    assert m[2]["skipped_total"] == 1 and m[3]["skipped_total"] == 1
    ck = run / "checkpoints"
    assert sorted(p.name for p in ck.glob("step_*")) == [f"step_{s:08d}" for s in (1, 2, 4)]
    assert json.loads((ck / "step_00000004" / "state.json").read_text())["skipped_steps"] == 1


# ---------------------------------------------------------------- (f) SIGTERM / SIGINT


def _start(run, nproc, overrides, out):
    return subprocess.Popen(train_cmd(run, nproc, overrides), cwd=ROOT, env=env(),
                            start_new_session=True, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip


def _wait_for_steps(run, p, n, timeout=300):
    f = run / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if f.exists() and len(f.read_text().splitlines()) >= n:
            return
        assert p.poll() is None, "the run ended before it could be signalled"
        time.sleep(0.05)
    raise AssertionError("the run did not reach the step in time")


def _group_gone(pgid, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)
    raise AssertionError("ranks still running after the signal")


def _interrupt(tmp_path, cache, nproc, sig, while_running=None, extra=()):
    run = tmp_path / "run"
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        p = _start(run, nproc, base(cache, *extra), out)
        try:
            _wait_for_steps(run, p, 3)
            if while_running is not None:
                while_running(run, p)
            if nproc == 1:
                p.send_signal(sig)
            else:  # what a scheduler or Ctrl-C does: every process of the job gets it
                os.killpg(p.pid, sig)
            rc = p.wait(timeout=120)
            _group_gone(p.pid)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return run, rc, log.read_text()


@pytest.mark.slow  # a 2-rank run
def test_sigterm_to_the_deepspeed_command_alone_still_saves_and_stops(cache, tmp_path):
    """`kill PID` of the `deepspeed` command (or a container's PID 1): its runner dies without
    forwarding the signal; the ranks notice the launcher chain broke and stop as on SIGTERM."""
    run, log = tmp_path / "run", tmp_path / "log.txt"
    with open(log, "w") as out:
        # long enough that the ranks' 1 s watch sees the runner gone before the run ends
        p = _start(run, 2, base(cache, "train.max_steps=400"), out)
        try:
            _wait_for_steps(run, p, 3)
            p.send_signal(signal.SIGTERM)  # the runner only, not its process group
            p.wait(timeout=30)
            _group_gone(p.pid)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    text = log.read_text()
    assert "the deepspeed command exited" in text, text[-3000:]
    _check_stopped(run, 1, text, "SIGTERM", 2, max_steps=400)


def test_launcher_chain_is_watched_only_under_deepspeeds_launcher(tmp_path):
    """A fake runner -> launcher -> rank chain: killing the runner sets the rank's stop flag."""
    code = (
        "import sys, time; from llmtrain.train.signals import StopOnSignal, launcher_chain\n"
        "assert launcher_chain() is not None\n"
        "with StopOnSignal() as s:\n"
        "    print('ready', flush=True)\n"
        "    for _ in range(100):\n"
        "        time.sleep(0.1)\n"
        "        if s.received: print('stop', s.name(s.received), flush=True); break\n"
    )
    launcher = (f"import subprocess, sys; subprocess.run([sys.executable, '-c', {code!r}]); "
                "sys.argv  # deepspeed.launcher.launch")  # fmt: skip
    runner = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {launcher!r}, 'deepspeed.launcher.launch'])"
    p = subprocess.Popen([sys.executable, "-c", runner], stdout=subprocess.PIPE, text=True,
                         cwd=ROOT, start_new_session=True)  # fmt: skip
    try:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert p.stdout.readline().strip() == "stop SIGTERM"
    finally:
        os.killpg(p.pid, signal.SIGKILL) if p.poll() is None else None
        _group_gone(p.pid, timeout=20)
    assert launcher_chain_here() is None


def launcher_chain_here():
    from llmtrain.train.signals import launcher_chain

    return launcher_chain()  # pytest's parent is no deepspeed launcher


def _check_stopped(run, rc, text, name, nproc, max_steps=STEPS):
    assert rc != 0
    lines = [ln for ln in text.splitlines() if "error: stopped by" in ln]
    assert len(lines) == 1, text[-3000:]  # the ranks agreed on the stop: rank 0 says it once
    assert "Traceback" not in text
    step = int(lines[0].split("after step ")[1].split(":")[0])
    assert name in lines[0] and "resume=auto" in lines[0]
    assert 3 <= step < max_steps
    assert (run / "checkpoints" / "latest").read_text() == f"step_{step:08d}"
    # every rank stopped at that step: each wrote its shard of the step's checkpoint, and no
    # rank logged a step past it
    state = json.loads((run / "checkpoints" / f"step_{step:08d}" / "state.json").read_text())
    assert state["step"] == step and state["world_size"] == nproc
    assert max(r["step"] for r in metrics(run)) <= step
    return step


def _resume_matches(run, reference, cache, tol):
    run_train(run, 1, base(cache, "resume=auto"))
    got, ref = metrics(run), metrics(reference)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) <= tol * abs(a["loss"]), (a["step"], a["loss"], b["loss"])


def test_sigterm_saves_stops_and_resumes_exactly(reference, cache, tmp_path):
    run, rc, text = _interrupt(tmp_path, cache, 1, signal.SIGTERM)
    _check_stopped(run, rc, text, "SIGTERM", 1)
    _resume_matches(run, reference, cache, 1e-6)


def test_ctrl_c_saves_and_stops(cache, tmp_path):
    def second_trainer(run, p):  # a requeued job while this one runs: refused, nothing touched
        q = run_train(run, 1, base(cache, "resume=auto"), check=False)
        assert q.returncode == 2 and "is in use by another `llmtrain train`" in q.stderr, q.stderr
        assert f"pid {p.pid}" in q.stderr and p.poll() is None

    # long enough to outlast the second trainer's start
    run, rc, text = _interrupt(tmp_path, cache, 1, signal.SIGINT, second_trainer,
                               ["train.max_steps=400"])  # fmt: skip
    assert "KeyboardInterrupt" not in text
    step = _check_stopped(run, rc, text, "SIGINT", 1, max_steps=400)
    state = json.loads((run / "checkpoints" / f"step_{step:08d}" / "state.json").read_text())
    assert state["step"] == step and len(metrics(run)) == step  # resuming: as after SIGTERM


@pytest.mark.slow  # the node launcher (deepspeed.launcher.launch)
def test_sigusr1_to_the_step_saves_and_stops_under_the_node_launcher(cache, tmp_path):
    """SLURM's --signal=USR1@SECONDS signals every process of the step: the launcher
    train_multinode.sh became (whose default action on USR1 is to die, and the step with it)
    ignores it, the rank saves at the next step boundary and the launcher passes on its exit 2."""
    hf = tmp_path / "hostfile"
    hf.write_text("node0 slots=1\n")
    run, log = tmp_path / "run", tmp_path / "log.txt"
    cmd = ["bash", str(ROOT / "launch" / "train_multinode.sh"), str(hf), "configs/debug.yaml",
           "--run-dir", str(run), *base(cache, "train.max_steps=400")]  # fmt: skip
    e = env(NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
            LLMTRAIN_VENV=str(VENV_BIN.parent))  # fmt: skip
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, env=e, start_new_session=True, stdout=out,
                             stderr=subprocess.STDOUT)  # fmt: skip
        try:
            _wait_for_steps(run, p, 3)
            os.killpg(p.pid, signal.SIGUSR1)
            rc = p.wait(timeout=120)
            _group_gone(p.pid)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 2, (rc, text[-3000:])
    _check_stopped(run, rc, text, "SIGUSR1", 1, max_steps=400)


def test_sigusr1_during_set_up_stops_after_the_first_step():
    """A warning that comes before training starts is kept (not the default action, which
    kills the process), and a second one forces nothing."""
    p = in_stop_on_signal("signal.raise_signal(signal.SIGUSR1)", "stop.arm()",
                          "signal.raise_signal(signal.SIGUSR1)", "time.sleep(0.2)")  # fmt: skip
    assert p.returncode == 0 and p.stdout.strip() == f"received {signal.SIGUSR1:d}", (
        p.returncode, p.stderr)  # fmt: skip


@pytest.mark.slow
def test_sigterm_two_ranks_agree_on_the_step(reference, cache, tmp_path):
    run, rc, text = _interrupt(tmp_path, cache, 2, signal.SIGTERM)
    _check_stopped(run, rc, text, "SIGTERM", 2)
    _resume_matches(run, reference, cache, 1e-4)  # 2 ranks then 1: the cross-layout tolerance


# ---------------------------------------------------------------- (g) full disk during a save


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_during_save_keeps_the_previous_checkpoint(cache, tmp_path, mode):
    """A background save's failure surfaces at the next save with the same one line."""
    from llmtrain.checkpoint import open_checkpoint

    run = tmp_path / "run"
    over = base(
        cache, "train.max_steps=6", "train.save_every=2", f"train.async_save={mode == 'async'}"
    )
    p = run_train(run, 1, over, check=False, LLMTRAIN_FAULT_ENOSPC_SAVE="4")
    assert p.returncode == 2, p.stderr[-2000:]
    last = _last_line(p.stderr)
    assert "No space left on device" in last and "step_00000002" in last, last
    assert "Traceback" not in p.stderr
    ck = run / "checkpoints"
    assert (ck / "latest").read_text() == "step_00000002"
    assert sorted(x.name for x in ck.iterdir()) == ["latest", "step_00000002"]  # no .tmp left
    src = open_checkpoint(ck / "step_00000002")  # intact: every tensor reads back
    assert all(torch.isfinite(src.read(n)).all() for n in src.names())
    assert json.loads((ck / "step_00000002" / "state.json").read_text())["step"] == 2


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs (room for the run files and about two debug checkpoints); root only."""
    where = tmp_path / "small"
    where.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6M", "tmpfs", str(where)],
                       capture_output=True, text=True)  # fmt: skip
    if p.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {p.stderr.strip()[:100]}")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_really_full_disk_is_reported_and_cleaned_up(cache, small_disk, mode):
    """A real ENOSPC reaches DCP inside torch.save's zip writer as a RuntimeError ("unexpected
    pos"): it must still give the one-line full-disk error, remove the partial step and keep
    `latest` on the last complete checkpoint."""
    run = small_disk / "run"
    over = base(cache, "train.max_steps=12", "train.save_every=2", "train.keep_last=100",
                f"train.async_save={mode == 'async'}")  # fmt: skip
    p = run_train(run, 1, over, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    last = _last_line(p.stderr)
    assert "No space left on device" in last and "partial files were removed" in last, last
    assert "Traceback" not in p.stderr
    ck = run / "checkpoints"
    kept = (ck / "latest").read_text()
    assert not list(ck.glob("*.tmp")), sorted(x.name for x in ck.iterdir())
    assert kept in last and (ck / kept / "state.json").is_file()


@pytest.mark.slow  # a 2-rank run
def test_a_killed_rank_is_reported_as_a_lost_rank_not_a_bug(cache, tmp_path):
    run = tmp_path / "run"
    over = base(cache, "train.max_steps=12", "train.save_every=3", "parallel.ep_size=2")
    # dies as step 6 starts: 5 steps done, so the last save is step 3 (numbered from 0, the
    # hook would have let step 6 finish and save)
    p = run_train(run, 2, over, check=False, LLMTRAIN_FAULT_KILL_RANK="1@6")
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "lost contact with another rank" in out, out[-3000:]
    assert "this is a bug" not in out
    assert (run / "checkpoints" / "latest").read_text() == "step_00000003"
    assert max(r["step"] for r in metrics(run)) == 5


# ---------------------------------------------------------------- stale JIT build lock


def _killed_holder(lock):
    """A process takes the lock the way torch's FileBaton does, then is SIGKILLed holding it."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    code = f"import os, time; os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL); print(1, flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "1"
    return p


def test_stale_jit_lock_is_detected_and_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    holder = _killed_holder(lock)
    try:
        ops.check_jit_locks(recheck_s=0.05)  # a live builder holds it: not stale, nothing raised
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(ops.StaleLockError, match="stale DeepSpeed build lock") as e:
        ops.check_jit_locks(recheck_s=0.05)
    assert str(lock) in str(e.value) and lock.exists()  # named, not deleted
    lock.unlink()
    ops.check_jit_locks(recheck_s=0.05)


def test_op_build_retries_with_one_job_then_says_what_to_check(monkeypatch, tmp_path, capsys):
    import deepspeed.accelerator

    calls = []

    class Builder:
        def __init__(self, fails):
            self.fails = fails

        def is_compatible(self, verbose=False):
            return True

        def load(self, verbose=False):
            calls.append(os.environ.get("MAX_JOBS"))
            if len(calls) <= self.fails:
                raise RuntimeError("Error building extension 'cpu_adam'\nc++: fatal error: Killed")

    class Acc:
        fails = 1

        def create_op_builder(self, cls):
            return Builder(self.fails)

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("MAX_JOBS", "")  # so that teardown restores the caller's environment
    monkeypatch.delenv("MAX_JOBS")
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: Acc())
    assert ops.build(["cpu_adam"]) == ["cpu_adam"]  # killed once, then built with one job
    assert calls == [None, "1"]
    calls.clear()
    Acc.fails = 2
    monkeypatch.delenv("MAX_JOBS")
    assert ops.main(["--build"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compiling DeepSpeed's" in err[0] and "RAM available" in err[0]


def test_stale_shm_workspaces_are_those_no_process_maps():
    import mmap

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    base = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_test{os.getpid()}_1_"
    live, dead, new = base + "0", base + "1", base + "2"
    for path in (live, dead, new):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    for path in (live, dead):  # from a run started two minutes ago
        os.utime(path, (time.time() - 120, time.time() - 120))
    f = open(live, "r+b")
    m = mmap.mmap(f.fileno(), 4096)  # a rank still running maps its workspace
    try:  # `new`: a rank starting now, between creating its workspace and mapping it
        stale = [str(p) for p in ops.stale_shm_workspaces()]
        assert dead in stale and live not in stale and new not in stale
        assert ops.main(["--clean-shm"]) == 0
        assert not os.path.exists(dead) and os.path.exists(live) and os.path.exists(new)
    finally:
        m.close()
        f.close()
        for path in (live, dead, new):
            if os.path.exists(path):
                os.unlink(path)


def test_training_with_a_stale_jit_lock_fails_fast(cache, tmp_path, monkeypatch, capsys):
    """`llmtrain train` (in this process: it stops before any process group) and `ops --check`."""
    from llmtrain.cli import main

    ext = tmp_path / "ext"
    lock = ext / "deepspeed_shm_comm" / "lock"
    holder = _killed_holder(lock)
    holder.kill()
    holder.wait()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    monkeypatch.setattr(ops, "RECHECK_S", 0.05)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    t0 = time.time()
    rc = main(
        [
            "train",
            str(ROOT / "configs" / "debug.yaml"),
            "--run-dir",
            str(tmp_path / "run"),
            *base(cache),
        ]
    )
    assert time.time() - t0 < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and str(lock) in err[0], err
    assert not (tmp_path / "run").exists()  # nothing started
    assert ops.main(["--check"]) == 2
    assert str(lock) in capsys.readouterr().err


# ---------------------------------------------------------------- (e) validation at any world size


class _Seqs:
    """A validation split of 7 fixed random sequences: divisible by neither 2 nor 3."""

    n_seq = 7

    def __init__(self, vocab):
        g = torch.Generator().manual_seed(3)
        self.data = torch.randint(0, vocab, (self.n_seq, 17), generator=g)

    def batch(self, idx):
        t = self.data[list(idx)]
        return t[:, :-1], t[:, 1:]


def _eval_rank(rank, world, port, out):
    import types

    import torch.distributed as dist

    from llmtrain.model import build_model
    from llmtrain.train.loop import evaluate

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs" / "debug.yaml")
    model = build_model(cfg.model, seed=5)
    layout = types.SimpleNamespace(global_batch=4, micro_batch=2)
    loss = evaluate(model, _Seqs(cfg.model.vocab_size), layout, rank, world, "cpu", 8, 0, False)
    if rank == 0:
        out.write_text(repr(loss))
    dist.destroy_process_group()


@pytest.fixture
def one_thread():
    """Tiny matmuls: one thread does not wait on a busy machine's other core."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _eval_reference():
    from llmtrain.model import build_model

    cfg = load_config(ROOT / "configs" / "debug.yaml")
    model = build_model(cfg.model, seed=5).eval()
    ds = _Seqs(cfg.model.vocab_size)
    losses = []
    with torch.no_grad():  # the reference: every sequence alone, one mean
        for i in range(ds.n_seq):
            x, y = ds.batch([i])
            losses.append(float(model(x, labels=y).lm_loss))
    return model, ds, sum(losses) / len(losses)


def test_validation_shares_cover_every_sequence_once(monkeypatch, one_thread):
    """Each rank's share, run in one process with the all-reduce summed by hand: the same mean
    at any world size (7 sequences: 1..8 ranks, some with an empty share), and every rank runs
    the same number of forwards (so collectives inside the model stay matched)."""
    import types

    from llmtrain.parallel import comm
    from llmtrain.train.loop import evaluate

    model, ds, ref = _eval_reference()
    layout = types.SimpleNamespace(global_batch=4, micro_batch=2)
    for world in range(1, 9):
        totals, forwards = [], []
        monkeypatch.setattr(
            comm, "all_reduce", lambda t, _to=totals, **kw: _to.append(t.clone()) or t
        )
        for rank in range(world):
            n = [0]

            def engine(*a, _n=n, **kw):
                _n[0] += 1
                return model(*a, **kw)

            engine.train = model.train
            evaluate(engine, ds, layout, rank, world, "cpu", 8, 0, False)
            forwards.append(n[0])
        total = sum(totals)
        assert len(set(forwards)) == 1, (world, forwards)
        assert float(total[1]) == ds.n_seq, world  # every sequence counted exactly once
        assert abs(float(total[0] / total[1]) - ref) <= 1e-5 * abs(ref), world


def test_validation_sample_is_eval_sequences_or_eval_batches_global_batches():
    import types

    from llmtrain.train.loop import val_sequences

    t = load_config(ROOT / "configs" / "debug.yaml").train
    layout = types.SimpleNamespace(global_batch=t.global_batch_size)
    assert val_sequences(t, layout) == t.eval_batches * t.global_batch_size
    t.eval_sequences = 5
    assert val_sequences(t, layout) == 5


@pytest.mark.slow
def test_validation_covers_the_same_sequences_at_any_world_size(tmp_path):
    import torch.multiprocessing as mp

    _, _, ref = _eval_reference()
    got = {}
    for world in (1, 2, 3):
        out = tmp_path / f"w{world}"
        mp.spawn(run_then_exit, args=(_eval_rank, world, free_port(), out), nprocs=world)
        got[world] = float(out.read_text())
    for world, v in got.items():
        assert abs(v - ref) <= 1e-5 * abs(ref), (world, v, ref)


# ---------------------------------------------------------------- (c) config, (d) tokenizer, (b) MTP


def test_softmax_gating_with_bias_updates_is_refused_at_config_time():
    with pytest.raises(ConfigError, match="model.bias_update_speed") as e:
        load_config(ROOT / "configs" / "debug.yaml", ["model.scoring_func=softmax", "model.n_group=1",
                                                      "model.topk_group=1"])  # fmt: skip
    assert "model.scoring_func=softmax" in str(e.value)
    load_config(ROOT / "configs" / "debug.yaml", ["model.scoring_func=softmax", "model.n_group=1",
                                                  "model.topk_group=1", "model.bias_update_speed=0"])  # fmt: skip


def test_export_keeps_the_users_special_tokens(tmp_path):
    """The user's tokenizer keeps its vocabulary; EOS is its end-of-text token, and BOS is the
    same token: training put no BOS before documents (EOS separates them), so lm-eval's HFLM
    (which prefixes requests with the BOS) and `tokenizer(text)` (a Llama-style post-processor
    adds <s>) would otherwise feed the model what it never saw. transformers 4.x can load it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer

    from llmtrain.export import write_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 50, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    f = tmp_path / "tokenizer.json"
    tok.save(str(f))
    n = tok.get_vocab_size(with_added_tokens=True)
    ids = write_tokenizer(f, tmp_path / "out")
    assert ids["eos_token_id"] == tok.token_to_id("</s>") == ids["bos_token_id"]
    assert ids["pad_token_id"] is None
    back = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert len(back) == n  # no token was added past the vocabulary
    assert back.eos_token == "</s>" and back.bos_token == "</s>"
    text = "def f(x): return x"
    assert back(text)["input_ids"] == tok.encode(text, add_special_tokens=False).ids
    cfg = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["clean_up_tokenization_spaces"] is False
    ids = tok.encode("x .", add_special_tokens=False).ids
    assert back.decode(ids) == tok.decode(ids)  # " ." kept (a 4.x default would make it ".")


def _hf_dir_without_mtp(path):
    from .hf_utils import make_hf_model

    kw = dict(vocab_size=1024, hidden_size=64, intermediate_size=192, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
              n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=1.0,
              max_position_embeddings=512)  # fmt: skip
    make_hf_model(seed=6, **kw).save_pretrained(path)  # config says 1 MTP layer, weights hold none
    return path


def test_init_from_without_mtp_layers_initialises_them_fresh(tmp_path, caplog):
    from llmtrain.hf import load_hf_into
    from llmtrain.model import build_model

    hf = _hf_dir_without_mtp(tmp_path / "hf")
    cfg = load_config(ROOT / "configs" / "debug.yaml", ["model.mtp_depth=1"])
    model = build_model(cfg.model, seed=7)
    fresh = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("mtp.")}
    with caplog.at_level("WARNING"):
        load_hf_into(model, hf, cfg.model)
    assert "fresh initialisation" in caplog.text and "MTP" in caplog.text
    got = model.state_dict()
    assert fresh and all(torch.equal(got[k], v) for k, v in fresh.items())
    plain = llmtrain_from_pretrained(hf)
    for k, v in plain.state_dict().items():
        if k in got and not k.startswith("mtp."):
            assert torch.equal(got[k], v), k


def llmtrain_from_pretrained(path):
    import llmtrain

    return llmtrain.from_pretrained(path)


def test_init_from_without_mtp_layers_trains(cache, tmp_path):
    hf = _hf_dir_without_mtp(tmp_path / "hf")
    p = run_train(tmp_path / "run", 1, base(cache, "train.max_steps=2", "model.mtp_depth=1",
                                            f"train.init_from={hf}"))  # fmt: skip
    assert "fresh initialisation" in p.stderr
    assert len(metrics(tmp_path / "run")) == 2
