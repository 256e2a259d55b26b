"""Sharded checkpoint format: pieces written by several ranks reshard to any split on load,
the earlier consolidated format is still read and converts, fault points are parsed."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmtrain.checkpoint import CheckpointError, ShardedReader, convert, load_model, open_checkpoint
from llmtrain.checkpoint.format import (
    Piece,
    load_pieces,
    model_key,
    moment_key,
    save_pieces,
    write_full_tensors,
    write_index,
)
from llmtrain.tensor_io import ShardWriter

from .conftest import ROOT
from .train_utils import run_then_exit

# full tensors: a dense matrix split at arbitrary offsets (ZeRO-1/2), stacked experts [E, 3, 2]
# split by expert parallelism (rows) and then by ZeRO within each expert-parallel rank
W = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
X = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(1))
BIAS = torch.arange(4.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pieces(splits_w, splits_x, tensors=True) -> list[Piece]:
    out = []
    for a, b in splits_w:
        out.append(Piece(model_key("w"), W.numel(), a, b - a,
                         tensor=W.view(-1)[a:b].clone() if tensors else torch.zeros(b - a)))  # fmt: skip
    for a, b in splits_x:
        out.append(Piece(moment_key("exp_avg", "x"), X.numel(), a, b - a,
                         tensor=X.view(-1)[a:b].clone() if tensors else torch.zeros(b - a)))  # fmt: skip
    # replicated on every rank: written once
    out.append(
        Piece(model_key("bias"), 4, 0, 4, tensor=BIAS.clone() if tensors else torch.zeros(4))
    )
    return out


# save layout: 2 ranks. w split [0,13) / [13,35); x: EP2 (rank r rows [2r, 2r+2) = 12 elements)
SAVE = {0: ([(0, 13)], [(0, 12)]), 1: ([(13, 35)], [(12, 24)])}
# load layout: 3 ranks, another ZeRO split and EP over 4 experts with rank 2 holding two
LOAD = {0: ([(0, 3)], [(0, 6)]), 1: ([(3, 20)], [(6, 12)]), 2: ([(20, 35)], [(12, 24)])}


def _worker(rank, world, port, d, phase):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if phase == "save":
            save_pieces(Path(d), _pieces(*SAVE[rank]), {f"rng/{rank}": bytes([rank])})
        else:
            for src in ("two", "one"):  # 2 ranks -> 3, 1 process -> 3
                got = _pieces(*LOAD[rank], tensors=False)
                blobs = load_pieces(Path(d) / src, got, [f"rng/{rank}"])
                want = _pieces(*LOAD[rank])
                for g, w in zip(got, want):
                    assert torch.equal(g.tensor, w.tensor), (src, rank, g.key, g.start)
                if src == "two":
                    assert blobs == ({f"rng/{rank}": bytes([rank])} if rank < 2 else {})
    finally:
        dist.destroy_process_group()


def test_pieces_reshard_between_rank_counts(tmp_path):
    mp.spawn(
        run_then_exit, args=(_worker, 2, _free_port(), str(tmp_path / "two"), "save"), nprocs=2
    )
    write_index(tmp_path / "two", {"w": {"shape": [5, 7]}, "x": {"shape": [4, 3, 2]},
                                   "bias": {"shape": [4]}})  # fmt: skip
    # the replicated bias went to one file only; each rank wrote its own file
    files = sorted(p.name for p in (tmp_path / "two").glob("*.distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp"]
    # one process wrote full tensors: loaded below in 3 ranks' pieces
    write_full_tensors(
        tmp_path / "one",
        {"w": ((5, 7), lambda: W), "bias": ((4,), lambda: BIAS), "x": ((4, 3, 2), lambda: X)},
        moments={"x": lambda m: X},
    )
    mp.spawn(run_then_exit, args=(_worker, 3, _free_port(), str(tmp_path), "load"), nprocs=3)
    # offline (no process group): full tensors in their saved shape, experts by row blocks
    r = ShardedReader(tmp_path / "two")
    assert torch.equal(r.read("w"), W) and torch.equal(r.read("bias"), BIAS)
    assert torch.equal(r.read("x", "exp_avg"), X)
    with pytest.raises(CheckpointError, match="lacks"):
        r.read("x")


def _bytes_read() -> int:
    """Bytes this process has read through read(2) and friends so far (Linux /proc)."""
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("rchar")).split()[1])


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_a_piece_reads_its_bytes_not_the_whole_stored_chunk(tmp_path):
    """A rank resuming at another layout, or the export reading a row block, needs a slice of a
    stored chunk; torch's reader would load the whole chunk (16 MB here) to narrow it."""
    big = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(3))
    write_full_tensors(tmp_path / "ck", {"big": ((2048, 2048), lambda: big)})
    out = torch.empty(10_000)
    before = _bytes_read()
    load_pieces(tmp_path / "ck", [Piece(model_key("big"), big.numel(), 1_234_567, 10_000,
                                        tensor=out)], no_dist=True)  # fmt: skip
    read = _bytes_read() - before
    assert torch.equal(out, big.view(-1)[1_234_567:1_244_567])
    assert read < 40_000 + 64 * 1024, f"read {read} bytes for a 40 kB piece of a 16 MB chunk"
    r = ShardedReader(tmp_path / "ck")
    before = _bytes_read()
    first, block = next(r.rows("big", max_bytes=64 * 2048 * 4))
    read = _bytes_read() - before
    assert first == 0 and torch.equal(block, big[:64])
    assert read < 64 * 2048 * 4 + 64 * 1024, f"read {read} bytes for a 512 kB row block"
    assert torch.equal(r.read("big"), big)


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_legacy_elements_read_their_byte_range(tmp_path):
    """Resuming from the consolidated format, a rank reads its pieces' byte ranges only."""
    from safetensors.torch import save_file

    from llmtrain.checkpoint.legacy import LegacyReader

    big = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(4))
    save_file({"big": big}, str(tmp_path / "model.safetensors"))
    src = LegacyReader(tmp_path)
    before = _bytes_read()
    got = src.elements("big", None, 500_001, 1000)
    read = _bytes_read() - before
    assert torch.equal(got, big.view(-1)[500_001:501_001])
    assert read < 4000 + 64 * 1024, read
    with pytest.raises(CheckpointError, match="beyond"):
        src.elements("big", None, 1024 * 1024 - 10, 20)


def test_load_refuses_a_size_mismatch(tmp_path):
    write_full_tensors(tmp_path / "ck", {"w": ((5, 7), lambda: W)})
    with pytest.raises(CheckpointError, match="another model config"):
        load_pieces(tmp_path / "ck", [Piece(model_key("w"), 36, 0, 36, tensor=torch.zeros(36))],
                    no_dist=True)  # fmt: skip


def write_legacy(ck: Path, weights: dict, moments: dict, state: dict, config_yaml: str) -> None:
    """The consolidated writer of the earlier trainer: model and optimizer safetensors."""
    ck.mkdir(parents=True)
    for stem, tensors in (("model", weights), ("optimizer", moments)):
        w = ShardWriter(ck, 200_000, stem)  # small shards: exercises the index
        for k, v in tensors.items():
            w.add(k, v.contiguous())
        w.finish()
    (ck / "state.json").write_text(json.dumps(state))
    (ck / "config.yaml").write_text(config_yaml)


def test_legacy_checkpoint_is_read_and_converted(tmp_path, debug_cfg):
    import yaml

    from llmtrain.model import build_model

    model = build_model(debug_cfg.model, seed=3)
    with torch.no_grad():
        for m in model.moe_layers():
            m.gate.e_score_correction_bias.uniform_()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()
          if not k.endswith(("last_counts", "load_since_update", "inv_freq"))}  # fmt: skip
    params = dict(model.named_parameters())
    moments = {f"{n}::{m}": torch.rand_like(p) for n, p in params.items() for m in
               ("exp_avg", "exp_avg_sq")}  # fmt: skip
    moments["__rng__::torch_cpu"] = torch.get_rng_state()
    old = tmp_path / "old"
    write_legacy(old, sd, moments, {"step": 7}, yaml.safe_dump(debug_cfg.to_dict()))
    assert (old / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, debug_cfg.model.vocab_size, (1, 16))
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(load_model(old)(ids).logits, want)
    new = convert(old, tmp_path / "new")
    r = open_checkpoint(new)
    assert isinstance(r, ShardedReader)
    for n, p in params.items():
        assert torch.equal(r.read(n), p.detach()), n
        assert torch.equal(r.read(n, "exp_avg_sq"), moments[f"{n}::exp_avg_sq"]), n
    with torch.no_grad():
        assert torch.equal(load_model(new)(ids).logits, want)
    with pytest.raises(CheckpointError, match="not empty"):
        convert(old, new)
    legacy = open_checkpoint(old)  # stacked experts in blocks of rows (export reads them so)
    name = next(n for n in params if n.endswith("w_gate_up"))
    blocks = list(legacy.rows(name, max_bytes=2 * params[name][0].numel() * 4 + 1))
    assert [r0 for r0, _ in blocks] == list(range(0, params[name].shape[0], 2))
    assert torch.equal(torch.cat([b for _, b in blocks]), params[name].detach())


def test_checkpoint_convert_command(tmp_path, debug_cfg):
    import yaml

    from llmtrain.cli import main
    from llmtrain.model import build_model

    sd = {k: v for k, v in build_model(debug_cfg.model).state_dict().items()
          if not k.endswith(("last_counts", "load_since_update", "inv_freq"))}  # fmt: skip
    write_legacy(tmp_path / "old", sd, {}, {"step": 1}, yaml.safe_dump(debug_cfg.to_dict()))
    assert main(["checkpoint", "convert", str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    assert (tmp_path / "new" / ".metadata").is_file()
    assert main(["checkpoint", "convert", str(tmp_path / "missing"), str(tmp_path / "x")]) == 2


def test_fault_points_parse(monkeypatch):
    from llmtrain.train import checkpointing

    killed = []
    monkeypatch.setattr(checkpointing.os, "kill", lambda pid, sig: killed.append(sig))
    monkeypatch.setenv("LLMTRAIN_FAULT_KILL_IN_SAVE", "write@10, latest")
    checkpointing._fault("write", 5)
    checkpointing._fault("rename", 10)
    assert killed == []
    checkpointing._fault("write", 10)
    checkpointing._fault("latest", 3)
    assert len(killed) == 2
    assert set(checkpointing.FAULT_POINTS) >= {"write", "latest"}
    assert ROOT.is_dir()
