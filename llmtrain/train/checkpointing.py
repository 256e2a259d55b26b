"""Save and restore a training run with its engine, in the sharded format (llmtrain.checkpoint).

Each rank contributes what it holds, as 1-D pieces of each flattened full tensor: its ZeRO
fragment of the fp32 weights and both Adam moments (expert pieces shifted by the rank's first
expert), the router biases (identical on every rank, written once), and its RNG state. Nothing
is gathered; resume at any world size, ZeRO stage or ep_size reads only overlapping pieces.

Crash safety: rank 0 picks the checkpoint to resume from and broadcasts it; a checkpoint is
written under `step_N.tmp` (stale ones from a killed save are removed at the next save), its
files, the directory and its parent are fsynced, then it is renamed and `latest` replaced and
fsynced. A save killed at any point never becomes `latest`. A state holding NaN/inf is never
saved, and a failed write (a full disk) stops every rank with the previous checkpoint and `latest`
untouched (train/health.py: the ranks agree on the verdict before anything is renamed).
Asynchronous saves (`train.async_save`): the pieces are copied to host memory at the step, and
the write, the agreement, the rename and `latest` run in a background thread whose collectives
go over a gloo group of their own (DCP's coordination included), so they never interleave with
training's; one save is in flight at most, and its error is raised by the next `wait()`.
`LLMTRAIN_FAULT_KILL_IN_SAVE=POINT[@STEP]` SIGKILLs the process at POINT (start, write, files,
rename, latest, prune) of a save, for tests.

Layout:  RUN/checkpoints/step_00000100/{.metadata, __R_0.distcp, pack_keys.json, pack_index.npy,
         tensors.json, state.json, config.yaml, tokenizer.json}  and  RUN/checkpoints/latest
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from llmtrain.checkpoint import format as fmt
from llmtrain.checkpoint.format import MOMENTS, CheckpointError, Piece
from llmtrain.checkpoint.legacy import LegacyReader
from llmtrain.parallel import comm
from llmtrain.train import faults, health

logger = logging.getLogger(__name__)

FAULT_POINTS = ("start", "write", "files", "rename", "latest", "prune")


def _fault(point: str, step: int) -> None:
    raw = os.environ.get("LLMTRAIN_FAULT_KILL_IN_SAVE", "")
    for spec in filter(None, (s.strip() for s in raw.split(","))):
        name, _, at = spec.partition("@")
        if name == point and (not at or int(at) == step):
            os.kill(os.getpid(), signal.SIGKILL)


def _is_bias(name: str) -> bool:
    return name.endswith("e_score_correction_bias")


def _names(ptr: Path, name: str) -> bool:
    try:
        return ptr.read_text().strip() == name
    except (OSError, UnicodeDecodeError):
        return False


class Checkpointer:
    """Owns save and restore of one run: the model's pieces, the engine's optimizer fragments,
    RNG and run state. All ranks call every method."""

    def __init__(self, run_dir: Path, model, rank: int, keep_last: int):
        self.run_dir = Path(run_dir)
        self.ckdir = self.run_dir / "checkpoints"
        self.model, self.rank, self.keep_last = model, rank, keep_last
        self.engine = None
        self._pending: _Background | None = None  # an asynchronous save in flight
        self._group = None  # its process group (gloo), made at the first asynchronous save

    # ------------------------------------------------------------ which checkpoint

    def resolve(self, resume: str) -> Path | None:
        """Rank 0 resolves `resume` (auto: `latest`) and broadcasts it, so every rank loads the
        same checkpoint even where ranks could see different file states."""
        found: Any = None
        if self.rank == 0:
            try:
                if resume == "auto":
                    self._recover_replaced()
                    found = fmt.latest_checkpoint(self.run_dir)
                elif resume != "never":
                    found = fmt.resolve_checkpoint(resume)
                found = str(found) if found is not None else None
            except CheckpointError as e:
                found = e
        found = comm.broadcast_object(found)
        if isinstance(found, Exception):
            raise CheckpointError(str(found))
        return Path(found) if found is not None else None

    def _recover_replaced(self) -> None:
        """A save of an existing step_N killed between moving step_N aside and renaming its
        .tmp into place left `latest` naming a missing step_N: put the complete copy back."""
        try:
            name = (self.ckdir / "latest").read_text().strip()
        except (OSError, UnicodeDecodeError):
            return
        final = self.ckdir / name
        aside = final.with_name(final.name + ".replaced")
        if fmt.checkpoint_step(final) is not None and not final.exists() and fmt.is_complete(aside):
            logger.warning("%s was moved aside by a save killed midway: restored", final)
            aside.rename(final)
            fmt.fsync_dir(self.ckdir)

    @staticmethod
    def read_state(ck: Path) -> dict:
        return fmt.read_json(ck / "state.json")

    def set_aside_newer(self, ck: Path, step: int) -> list[Path]:
        """Rank 0, once a resume from `ck` (at `step`) has restored: this run's checkpoints past
        `step` belong to the trajectory being abandoned (a rollback after a loss spike). They
        are moved to checkpoints/abandoned-UTC/ (not deleted: the user decides), and `latest`
        names `ck`, so keep_last never prunes the new saves for them and resume=auto never
        returns to the abandoned run. `latest` names `ck` also when nothing was newer (a save
        killed before `latest` moved, resumed at max_steps: no save follows to fix it), and by
        its absolute path when `ck` lies elsewhere (another run, an abandoned-UTC folder): a run
        stopped before its first save then continues from `ck`, not from this run's older
        checkpoints or step 0."""
        newer = [d for n, d in fmt.complete_checkpoints(self.run_dir) if n > step]
        newer += [d for d in self.ckdir.glob("step_*") if d.is_dir() and d not in newer
                  and (fmt.checkpoint_step(d) or -1) > step]  # fmt: skip
        here = ck.parent.resolve() == self.ckdir.resolve()
        name = ck.name if here else str(ck.resolve())
        if newer:
            dest = self.ckdir / f"abandoned-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
            dest.mkdir(exist_ok=True)
            for d in newer:
                d.rename(dest / d.name)
            fmt.fsync_dir(self.ckdir)
        if not _names(self.ckdir / "latest", name):
            self.ckdir.mkdir(parents=True, exist_ok=True)
            self._point_latest(name)
        if not newer:
            return []
        logger.warning(
            "resumed from step %d: this run's later checkpoints (%s) are moved to %s; delete "
            "that folder when you no longer need them", step,
            ", ".join(sorted(d.name for d in newer)), dest,
        )  # fmt: skip
        return newer

    def _point_latest(self, name: str) -> None:
        """`latest` names checkpoint `name`: replaced whole (never half-written), then synced."""
        fmt.write_file(self.ckdir / "latest.tmp", name)
        os.replace(self.ckdir / "latest.tmp", self.ckdir / "latest")
        fmt.fsync_dir(self.ckdir)

    # ------------------------------------------------------------ placement

    def _params(self):
        """(name, parameter, full shape, element offset of the local part in the full tensor)."""
        from llmtrain.model.moe import Experts

        for name, p in self.model.named_parameters():
            shape = tuple(getattr(p, "ds_shape", p.shape))
            mod = self.model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self.model
            if isinstance(mod, Experts):  # stacked routed experts: this rank's rows of [E, ...]
                row = math.prod(shape[1:])
                yield name, p, (mod.total, *shape[1:]), mod.offset * row
            else:
                yield name, p, shape, 0

    def _buffers(self):
        return [(n, b) for n, b in self.model.named_buffers() if _is_bias(n)]

    def _pieces(self, moments: bool = True) -> tuple[list[Piece], dict[str, dict]]:
        pieces, index = [], {}
        for name, p, full, off in self._params():
            n_full = math.prod(full)
            index[name] = {"shape": list(full), "kind": "param", "moments": True}
            frag = self.engine.local_fragment(p, moments)
            if frag is None:
                continue
            start, views = frag
            k = views["fp32"].numel()
            pieces.append(Piece(fmt.model_key(name), n_full, off + start, k, tensor=views["fp32"]))
            for m in MOMENTS if moments else ():
                pieces.append(
                    Piece(fmt.moment_key(m, name), n_full, off + start, k, tensor=views[m])
                )
        for name, b in self._buffers():
            index[name] = {"shape": list(b.shape), "kind": "buffer", "moments": False}
            pieces.append(Piece(fmt.model_key(name), b.numel(), 0, b.numel(), tensor=b.view(-1)))
        return pieces, index

    # ------------------------------------------------------------ save

    def save(
        self,
        step: int,
        state: dict,
        config_yaml: str,
        tokenizer_file: Path | None,
        asynchronous: bool = False,
    ) -> Path:
        """Save the run at `step`. `asynchronous`: copy this rank's pieces to host memory, then
        write and rename them in a background thread while training goes on; the previous
        checkpoint stays `latest` until this one is complete. Errors of a background save are
        raised by the next `wait()` (the next save, the end of the run, a stop)."""
        self.wait()  # one save in flight at most; its error surfaces here
        final = self.ckdir / f"step_{step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        guard = health.SaveGuard(step, self.ckdir)
        if self.rank == 0:
            self.ckdir.mkdir(parents=True, exist_ok=True)
            for stale in self.ckdir.glob("step_*.tmp"):  # left by a save that was killed
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
            fmt.fsync_dir(self.ckdir)
        comm.barrier()
        _fault("start", step)
        self.engine.prepare_optimizer_state()
        pieces, index = self._pieces()
        for pc in pieces:  # a non-finite state never becomes a checkpoint
            t = pc.tensor
            if t is not None and t.is_floating_point() and not torch.isfinite(t).all():
                guard.first_bad = pc.key
                break
        guard.agree()  # collective: every rank raises the same error
        state = {
            **state,
            "optimizer_step": self.engine.optimizer_step_count(),
            "format": fmt.FORMAT,
        }
        blobs = {f"rng/{self.rank}": _rng_bytes()}
        if not asynchronous:
            self._write(step, tmp, final, pieces, index, blobs, state, config_yaml,
                        tokenizer_file, guard)  # fmt: skip
            return final
        # the optimizer updates these fragments in place at the next step: write a copy
        staged = [dataclasses.replace(pc, tensor=pc.data().to("cpu", copy=True), produce=None)
                  for pc in pieces]  # fmt: skip
        if self._group is None:
            self._group = comm.new_cpu_group()
        guard.group = self._group
        args = (step, tmp, final, staged, index, blobs, state, config_yaml, tokenizer_file, guard)
        self._pending = _Background(self._write_reported, args)
        return final

    def wait(self) -> None:
        """Block until the background save (if any) is complete; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()

    def _write_reported(self, step: int, *args) -> None:
        """A background save: an OS error is cleaned up and reported like a synchronous one."""
        health.guarded_save(lambda: self._write(step, *args), self.run_dir, step)

    def _write(self, step, tmp, final, pieces, index, blobs, state, config_yaml, tokenizer_file,
               guard) -> None:  # fmt: skip
        """Write the pieces and files under `tmp`, agree, rename to `final`, replace `latest`."""

        def on_write(i: int, n: int) -> None:
            if i == n // 2 + 1:
                _fault("write", step)
                faults.maybe_disk_full(step, tmp)

        fmt.save_pieces(tmp, pieces, blobs, on_write, group=guard.group)
        if self.rank == 0:
            with guard.attempt():
                fmt.write_index(tmp, index)
                fmt.write_file(tmp / "config.yaml", config_yaml)
                if tokenizer_file is not None and Path(tokenizer_file).is_file():
                    fmt.write_file(tmp / "tokenizer.json", Path(tokenizer_file).read_bytes())
                _fault("files", step)
                fmt.write_file(tmp / "state.json", json.dumps(state, indent=1))
                fmt.fsync_dir(tmp)
        guard.agree()  # in place of a barrier: every rank's files are on disk, or all raise
        # not `.tmp`: the stale-save cleanup and a failed save's cleanup remove those
        replaced = final.with_name(final.name + ".replaced")
        if self.rank == 0:
            with guard.attempt():
                _fault("rename", step)
                if final.exists():  # moved aside, not removed, until the new one is in place
                    shutil.rmtree(replaced, ignore_errors=True)
                    final.rename(replaced)
                tmp.rename(final)
                fmt.fsync_dir(self.ckdir)
                _fault("latest", step)
                self._point_latest(final.name)
        guard.agree()  # a late write error stops every rank, not only the writer
        if self.rank == 0:  # the save is complete: what follows only tidies up
            try:
                fmt.fsync_dir(self.run_dir)
                _fault("prune", step)
                shutil.rmtree(replaced, ignore_errors=True)
                self._prune(step)
            except OSError as e:
                logger.warning("checkpoint %s is saved, but tidying up after it failed: %s",
                               final, e)  # fmt: skip

    def _prune(self, step: int) -> None:
        """keep_last: remove the oldest step_N up to `step` (by number; other names untouched;
        a checkpoint past `step`, which set_aside_newer leaves none of, is not pruned for)."""
        done = sorted((n, d) for d in self.ckdir.glob("step_*")
                      if (n := fmt.checkpoint_step(d)) is not None and n <= step)  # fmt: skip
        for _, old in done[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------ restore

    def restore(self, ck: Path, weights_only: bool = False) -> dict:
        """Write the checkpoint's weights, Adam moments, router biases and RNG into the engine and
        model (after `Engine(...)`); returns the run state. `weights_only`: the weights and router
        biases alone (evaluation): each rank reads the byte ranges of its own weight pieces."""
        state = self.read_state(ck)
        if not weights_only:  # Adam's state is lazy: evaluation never creates it
            self.engine.prepare_optimizer_state(int(state.get("optimizer_step", state["step"])))
        if fmt.is_sharded(ck):
            self._restore_sharded(ck, not weights_only)
        elif fmt.is_legacy(ck):
            self._restore_legacy(ck, not weights_only)
        else:
            raise CheckpointError(f"checkpoint {ck} holds no weights")
        self.engine.refresh_low_precision()
        return state

    def _restore_sharded(self, ck: Path, moments: bool = True) -> None:
        index = fmt.read_json(ck / fmt.INDEX_FILE)
        fmt.check_format(ck, index)
        index = index["tensors"]
        pieces, want = self._pieces(moments)
        missing = [n for n in want if n not in index]
        if missing:
            raise CheckpointError(f"checkpoint {ck} lacks {missing[:5]}; written for another "
                                  "model config?")  # fmt: skip
        if moments and not any(
            index[n].get("moments") for n, info in want.items() if info["moments"]
        ):
            raise CheckpointError(f"checkpoint {ck} holds weights only, no optimizer state (an "
                                  "export's checkpoint?); resume from a training checkpoint, "
                                  "RUN/checkpoints/step_*")  # fmt: skip
        for name, info in want.items():
            if list(index[name]["shape"]) != info["shape"]:
                raise CheckpointError(f"{name}: checkpoint shape {index[name]['shape']} != model "
                                      f"{info['shape']}; it comes from another model config")  # fmt: skip
        key = f"rng/{self.rank}"
        blobs = fmt.load_pieces(ck, pieces, [key] if moments else [])
        _check_finite(ck, pieces)
        if key in blobs:
            _set_rng(blobs[key])

    def _restore_legacy(self, ck: Path, moments: bool = True) -> None:
        """Every rank reads the byte ranges of its pieces (weights and both moments)."""
        src = LegacyReader(ck)
        have = set(src.names())
        with torch.no_grad():
            for name, p, full, off in self._params():
                if name not in have:
                    raise CheckpointError(f"checkpoint {ck} lacks {name}")
                if tuple(src.shape(name)) != tuple(full):  # on every rank, holding a part or not
                    raise CheckpointError(f"{name}: checkpoint shape {tuple(src.shape(name))} != "
                                          f"model {tuple(full)}")  # fmt: skip
                frag = self.engine.local_fragment(p, moments)
                if frag is None:
                    continue
                start, views = frag
                n = views["fp32"].numel()
                for key in ("fp32", *(MOMENTS if moments else ())):
                    t = src.elements(name, None if key == "fp32" else key, off + start, n)
                    views[key].copy_(t)
            for name, b in self._buffers():
                if name in have:
                    b.copy_(src.read(name))
        rng = src.rng() if moments else None
        if rng is not None:
            torch.set_rng_state(rng)


def _check_finite(ck: Path, pieces: list[Piece]) -> None:
    """Collective: a save never writes NaN/inf (SaveGuard), so a restored one is a damaged file;
    training from it would turn every weight NaN within a step or two. Every rank raises."""
    import torch.distributed as dist

    bad = next((p.key for p in pieces if p.tensor is not None and p.tensor.is_floating_point()
                and not torch.isfinite(p.tensor).all()), None)  # fmt: skip
    flag = torch.tensor([0.0 if bad is None else 1.0])
    if dist.is_initialized() and dist.get_world_size() > 1:
        comm.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        where = f" ({bad})" if bad else " (on another rank)"
        raise CheckpointError(f"checkpoint {ck} reads back non-finite values{where}: its files "
                              "are damaged; resume from an earlier checkpoint "
                              "(resume=RUN/checkpoints/step_N)")  # fmt: skip


class _Background:
    """Runs `fn(*args)` in a daemon thread (a dead run must not wait on it at exit); `join`
    re-raises its exception in the caller's thread."""

    def __init__(self, fn, args):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, args), daemon=True,
                                       name="llmtrain-save")  # fmt: skip
        self.thread.start()

    def _run(self, fn, args) -> None:
        try:
            fn(*args)
        except BaseException as e:  # handed to the training thread
            self.error = e

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def _rng_bytes() -> bytes:
    buf = io.BytesIO()
    st = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    torch.save(st, buf)
    return buf.getvalue()


def _set_rng(blob: bytes) -> None:
    st = torch.load(io.BytesIO(blob), weights_only=True)
    torch.set_rng_state(st["cpu"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def copy_weights_into(model, weights: dict[str, torch.Tensor]) -> None:
    """Before the engine exists: copy full weights (e.g. `train.init_from`'s) into the module,
    each rank keeping its own experts."""
    from llmtrain.model.moe import Experts

    params = dict(model.named_parameters())
    missing = [n for n in params if n not in weights]
    if missing:
        raise CheckpointError(f"the weights lack {missing[:5]}; written for another model config?")
    with torch.no_grad():
        for name, p in params.items():
            v = weights[name]
            mod = model.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(mod, Experts):
                v = v[mod.offset : mod.offset + p.shape[0]]
            if v.shape != p.shape:
                raise CheckpointError(f"{name}: shape {tuple(v.shape)} != model {tuple(p.shape)}; "
                                      "the weights come from another model config")  # fmt: skip
            p.copy_(v)
        for name, b in model.named_buffers():
            if name in weights:
                b.copy_(weights[name])
