"""Sharded checkpoint format: pieces written by several ranks reshard to any split on load,
the earlier consolidated format is still read and converts, fault points are parsed."""

from __future__ import annotations

import json
import os
import socket
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader

from llmtrain.checkpoint import CheckpointError, ShardedReader, convert, load_model, open_checkpoint
from llmtrain.checkpoint import format as fmt
from llmtrain.checkpoint.format import (
    PACK_INDEX,
    PackIndex,
    Piece,
    _pack_layout,
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
            # format 1 (one DCP tensor per key), as checkpoints before the packed format were
            save_pieces(Path(d + "_v1"), _pieces(*SAVE[rank]), {f"rng/{rank}": bytes([rank])},
                        pack=False)  # fmt: skip
        else:
            for src in ("two", "two_v1", "one"):  # 2 ranks -> 3 (both formats), 1 process -> 3
                got = _pieces(*LOAD[rank], tensors=False)
                blobs = load_pieces(Path(d) / src, got, [f"rng/{rank}"])
                want = _pieces(*LOAD[rank])
                for g, w in zip(got, want):
                    assert torch.equal(g.tensor, w.tensor), (src, rank, g.key, g.start)
                if src != "one":
                    assert blobs == ({f"rng/{rank}": bytes([rank])} if rank < 2 else {})
    finally:
        dist.destroy_process_group()


def test_pieces_reshard_between_rank_counts(tmp_path):
    mp.spawn(
        run_then_exit, args=(_worker, 2, _free_port(), str(tmp_path / "two"), "save"), nprocs=2
    )
    for d in ("two", "two_v1"):
        write_index(tmp_path / d, {"w": {"shape": [5, 7]}, "x": {"shape": [4, 3, 2]},
                                   "bias": {"shape": [4]}})  # fmt: skip
        # each rank wrote its own file
        files = sorted(p.name for p in (tmp_path / d).glob("*.distcp"))
        assert files == ["__0_0.distcp", "__1_0.distcp"]
    # packed: .metadata lists one part per rank, the index one row per piece, the replicated
    # bias once (rank 0's)
    md = FileSystemReader(str(tmp_path / "two")).read_metadata().state_dict_metadata
    assert sorted(md) == ["pack/float32", "rng/0", "rng/1"]
    assert len(md["pack/float32"].chunks) == 2
    idx = PackIndex(tmp_path / "two")
    bias_id = idx.keys[model_key("bias")][0]
    assert list(idx.table[0]).count(bias_id) == 1 and idx.table.shape == (6, 5)
    assert not (tmp_path / "two_v1" / PACK_INDEX).exists()
    # one process wrote full tensors: loaded below in 3 ranks' pieces
    write_full_tensors(
        tmp_path / "one",
        {"w": ((5, 7), lambda: W), "bias": ((4,), lambda: BIAS), "x": ((4, 3, 2), lambda: X)},
        moments={"x": lambda m: X},
    )
    mp.spawn(run_then_exit, args=(_worker, 3, _free_port(), str(tmp_path), "load"), nprocs=3)
    # offline (no process group): full tensors in their saved shape, experts by row blocks
    for d in ("two", "two_v1"):
        r = ShardedReader(tmp_path / d)
        assert torch.equal(r.read("w"), W) and torch.equal(r.read("bias"), BIAS)
        assert torch.equal(r.read("x", "exp_avg"), X)
        with pytest.raises(CheckpointError, match="lacks"):
            r.read("x")


def _summary(pieces: list[tuple[str, int, int, int]], full: dict[str, int]) -> dict:
    """A rank's local-plan summary for (key, start, numel, produced) pieces."""
    names = list(dict.fromkeys(k for k, *_ in pieces))
    rows = np.array([(names.index(k), a, n, lazy, -1) for k, a, n, lazy in pieces], dtype=np.int64)
    keys = zlib.compress(json.dumps([(k, full[k], "float32") for k in names]).encode())
    return {"keys": keys, "rows": rows.reshape(-1, 5)}


def test_pack_layout_parts_dedup_and_overlap():
    """The coordinator's layout: small pieces share parts of at most part_elems, a large or
    lazily produced piece is a part of its own, a piece replicated on several ranks is written
    by the lowest one, the parts tile each dtype's pack, and the index finds every piece."""
    full = {"a": 100, "big": 50, "lazy": 5, "bias": 4}
    r0 = [("a", 0, 4, 0), ("big", 0, 50, 0), ("a", 4, 4, 0), ("lazy", 0, 5, 1), ("a", 8, 6, 0),
          ("a", 14, 6, 0), ("bias", 0, 4, 0)]  # fmt: skip
    r1 = [("a", 20, 80, 0), ("bias", 0, 4, 0)]
    parts, table, keys, totals = _pack_layout([_summary(r0, full), _summary(r1, full)], 10)
    # a part starts where a piece's offset enters a new bucket of 10, or at a large or lazy
    # piece (a part of its own): rank 0 a0 | big | a4 | lazy | a8 a14 | bias; rank 1 a20
    assert [idx for *_, idx in parts[0]] == [[0], [1], [2], [3], [4, 5], [6]]
    assert all(n < 2 * 10 or len(idx) == 1 for _, _, n, idx in parts[0])  # a bounded copy
    assert [idx for *_, idx in parts[1]] == [[0]]  # rank 1's bias: rank 0 writes it
    spans = sorted((off, n) for pr in parts for _, off, n, _ in pr)
    assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert spans[-1][0] + spans[-1][1] == totals["float32"] == 100 + 50 + 5 + 4
    assert table.shape == (6, 8)  # one row per distinct piece
    order = list(zip(table[0], table[1]))
    assert order == sorted(order)
    for _, _, n, pos, off, _ in table.T:  # each row inside its part
        part = next(p for pr in parts for p in pr if p[1] == off)
        assert off <= pos and pos + n <= off + part[2]
    assert [k for k, *_ in keys] == sorted(full)
    with pytest.raises(CheckpointError, match="overlapping"):
        _pack_layout([_summary([("a", 0, 10, 0)], full), _summary([("a", 5, 10, 0)], full)], 10)


def test_packed_round_trip_across_many_parts(tmp_path, monkeypatch):
    """Pieces packed into many small parts (one process) come back at another split; a read
    spanning rows of several parts fills in order."""
    monkeypatch.setattr(fmt, "PART_ELEMS", 16)
    t = torch.randn(300, generator=torch.Generator().manual_seed(5))
    cuts = [0, 7, 9, 40, 41, 90, 200, 233, 300]
    pieces = [Piece(model_key("t"), 300, a, b - a, tensor=t[a:b].clone())
              for a, b in zip(cuts, cuts[1:])][::-1]  # fmt: skip
    save_pieces(tmp_path / "ck", pieces, no_dist=True)
    md = FileSystemReader(str(tmp_path / "ck")).read_metadata().state_dict_metadata
    assert len(md["pack/float32"].chunks) >= 5
    got = [Piece(model_key("t"), 300, a, b - a, tensor=torch.zeros(b - a))
           for a, b in ((0, 3), (3, 150), (150, 300))]  # fmt: skip
    load_pieces(tmp_path / "ck", got, no_dist=True)
    assert torch.equal(torch.cat([g.tensor for g in got]), t)
    with pytest.raises(CheckpointError, match="lacks"):
        load_pieces(tmp_path / "ck", [Piece(model_key("u"), 3, 0, 3, tensor=torch.zeros(3))],
                    no_dist=True)  # fmt: skip


def test_a_finite_bit_flip_fails_the_crc32_check(tmp_path):
    """Damage that leaves the values finite (one low mantissa byte) is caught on load by the
    piece's crc32, recorded in the pack index when it was written."""
    from llmtrain.checkpoint.format import _storage_record

    t = torch.randn(4096, generator=torch.Generator().manual_seed(6))
    pieces = [Piece(model_key("t"), 4096, a, 1024, tensor=t[a : a + 1024].clone())
              for a in range(0, 4096, 1024)]  # fmt: skip
    save_pieces(tmp_path / "ck", pieces, no_dist=True)
    got = torch.zeros(4096)
    load_pieces(tmp_path / "ck", [Piece(model_key("t"), 4096, 0, 4096, tensor=got)], no_dist=True)
    assert torch.equal(got, t)
    info = next(iter(FileSystemReader(str(tmp_path / "ck")).read_metadata().storage_data.values()))
    path = tmp_path / "ck" / info.relative_path
    with open(path, "r+b") as fh:
        at = info.offset + _storage_record(fh, info.offset, info.length, 4096 * 4)
        fh.seek(at + 4 * 3000)  # element 3000: the low byte of its mantissa
        b = fh.read(1)
        fh.seek(at + 4 * 3000)
        fh.write(bytes([b[0] ^ 1]))
    with pytest.raises(
        CheckpointError, match=r"model/t: elements \[2048, \+1024\) fail their crc32"
    ):
        load_pieces(tmp_path / "ck", [Piece(model_key("t"), 4096, 0, 4096, tensor=got)],
                    no_dist=True)  # fmt: skip
    # a read of part of a stored piece cannot check it, and still reads
    part = torch.zeros(10)
    load_pieces(tmp_path / "ck", [Piece(model_key("t"), 4096, 100, 10, tensor=part)], no_dist=True)
    assert torch.equal(part, t[100:110])


def test_a_device_target_is_read_through_a_host_buffer(tmp_path):
    """A CUDA run resumes into fp32 master weights and moments on the GPU: the ranged reader
    must not read into them in place (`.numpy()` refuses any non-host tensor). A meta tensor
    stands in for the device here; the checksum is checked on the host bytes."""
    t = torch.randn(64, generator=torch.Generator().manual_seed(7))
    save_pieces(tmp_path / "ck", [Piece(model_key("t"), 64, 0, 64, tensor=t)], no_dist=True)
    on_device = torch.empty(64, device="meta")
    load_pieces(tmp_path / "ck", [Piece(model_key("t"), 64, 0, 64, tensor=on_device)],
                no_dist=True)  # fmt: skip


def test_torch_reader_fallback_checks_crc_only_on_unconverted_bytes(tmp_path, monkeypatch):
    """Where the ranged reader falls back to torch's (a chunk layout it does not know), the
    crc32 is checked after torch's copy, unless that copy converted the dtype."""
    t = torch.randn(256, generator=torch.Generator().manual_seed(8))
    save_pieces(tmp_path / "ck", [Piece(model_key("t"), 256, 0, 256, tensor=t)], no_dist=True)
    monkeypatch.setattr(fmt, "_storage_record", lambda *a: None)
    half = torch.zeros(256, dtype=torch.bfloat16)
    load_pieces(tmp_path / "ck", [Piece(model_key("t"), 256, 0, 256, tensor=half,
                                        dtype=torch.bfloat16)], no_dist=True)  # fmt: skip
    assert torch.equal(half, t.bfloat16())
    idx = np.load(tmp_path / "ck" / PACK_INDEX)
    idx[5, 0] ^= 1  # the stored crc no longer matches: torch's path checks it too
    np.save(tmp_path / "ck" / PACK_INDEX, idx)
    with pytest.raises(CheckpointError, match="crc32"):
        load_pieces(tmp_path / "ck", [Piece(model_key("t"), 256, 0, 256,
                                            tensor=torch.zeros(256))], no_dist=True)  # fmt: skip


def test_load_plans_hold_no_tensor_reads_and_pack_files_are_required(tmp_path):
    """DCP gathers every rank's load plan on the coordinator: ours carry the blobs only (one
    ReadItem per piece at 1,000 ranks would be gigabytes there); the reads join at
    finish_plan. A packed checkpoint missing its index files says which."""
    from llmtrain.checkpoint.format import PieceLoadPlanner

    t = torch.randn(64, generator=torch.Generator().manual_seed(9))
    pieces = [
        Piece(model_key("t"), 64, a, 16, tensor=t[a : a + 16].clone()) for a in (0, 16, 32, 48)
    ]
    save_pieces(tmp_path / "ck", pieces, {"rng/0": b"x"}, no_dist=True)
    md = FileSystemReader(str(tmp_path / "ck")).read_metadata()
    pl = PieceLoadPlanner([Piece(model_key("t"), 64, 8, 40, tensor=torch.zeros(40))], ["rng/0"],
                          PackIndex.open(tmp_path / "ck", md))  # fmt: skip
    pl.set_up_planner({}, md, True)
    local = pl.create_local_plan()
    assert [r.dest_index.fqn for r in local.items] == ["rng/0"]
    assert len(pl.finish_plan(local).items) == 1 + 3  # the blob and rows [0,16) [16,32) [32,48)
    (tmp_path / "ck" / "pack_keys.json").write_text('{"format": "llmtrain-dcp-2"}')
    with pytest.raises(CheckpointError, match="pack_keys.json"):
        load_pieces(tmp_path / "ck", pieces, no_dist=True)
    (tmp_path / "ck" / "pack_keys.json").unlink()
    write_index(tmp_path / "ck", {"t": {"shape": [64]}})
    with pytest.raises(CheckpointError, match="pack_keys.json"):
        ShardedReader(tmp_path / "ck")


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


def test_a_killed_save_is_not_a_checkpoint(tmp_path):
    """`step_N.tmp` is a save the trainer never completed, even where its state.json was
    written: export and eval refuse it as the trainer and the watcher do."""
    from llmtrain.checkpoint.format import resolve_checkpoint

    ck = tmp_path / "checkpoints" / "step_00000010.tmp"
    ck.mkdir(parents=True)
    (ck / "state.json").write_text("{}")
    with pytest.raises(CheckpointError, match="incomplete save"):
        resolve_checkpoint(ck)


def _fake_checkpoint(ckdir: Path, step: int) -> Path:
    """A directory that passes the completeness checks (state.json, tensors.json, .metadata)."""
    d = ckdir / f"step_{step:08d}"
    d.mkdir(parents=True)
    for name in ("state.json", fmt.INDEX_FILE, ".metadata"):
        (d / name).write_text(json.dumps({"step": step}))
    return d


def test_latest_falls_forward_to_a_complete_save_and_damage_is_named(tmp_path, caplog):
    """A save killed between its rename and `latest` left a complete step_N: resume takes it (a
    save interval is not lost, the run does not restart at 0); a damaged pointer or small file
    is one line naming it and the way out."""
    run = tmp_path / "run"
    ck = run / "checkpoints"
    _fake_checkpoint(ck, 5)
    (ck / "step_00000009.tmp").mkdir()  # a save in progress is never taken
    with caplog.at_level("WARNING"):
        assert fmt.latest_checkpoint(run) == ck / "step_00000005"  # no `latest` written yet
    assert "is missing, but step_00000005 is complete" in caplog.text
    (ck / "latest").write_text("step_00000005")
    _fake_checkpoint(ck, 10)
    assert fmt.latest_checkpoint(run) == ck / "step_00000010"  # newer than `latest`
    assert fmt.resolve_checkpoint(run) == ck / "step_00000010"
    (ck / "latest").write_text("step_00000010")
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert fmt.latest_checkpoint(run) == ck / "step_00000010"
    assert not caplog.text
    # pointed back by hand after step 10 was saved (a rollback): followed, not fallen past
    (ck / "latest").write_text("step_00000005")
    later = (ck / "latest").stat().st_mtime_ns
    os.utime(ck / "step_00000010" / "state.json", ns=(later - 10**9, later - 10**9))
    assert fmt.latest_checkpoint(run) == ck / "step_00000005"
    (ck / "latest").write_text("")
    with pytest.raises(CheckpointError, match=r"latest is empty; .*resume=.*step_00000010"):
        fmt.latest_checkpoint(run)
    (ck / "latest").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CheckpointError, match=r"latest is unreadable .*resume=.*step_00000010"):
        fmt.latest_checkpoint(run)
    (ck / "latest").write_text("step_00000007")
    with pytest.raises(CheckpointError, match="names step_00000007, which is incomplete"):
        fmt.latest_checkpoint(run)
    (ck / "step_00000010" / "state.json").write_text('{"step": 1')
    with pytest.raises(CheckpointError, match=r"state.json is missing or damaged .*earlier"):
        fmt.read_json(ck / "step_00000010" / "state.json")


def test_a_resumed_checkpoint_becomes_latest_and_a_failed_save_puts_back_what_it_replaced(
    tmp_path,
):
    """A fall-forward resume at max_steps saves nothing after it: `latest` is pointed at the
    checkpoint right away (a sweep reads it to skip finished runs). A failed save that had moved
    an earlier step_N aside puts it back, and no cleanup of `.tmp` saves takes it."""
    from llmtrain.train import health
    from llmtrain.train.checkpointing import Checkpointer

    run = tmp_path / "run"
    ck = run / "checkpoints"
    _fake_checkpoint(ck, 5)
    (ck / "latest").write_text("step_00000005")
    _fake_checkpoint(ck, 10)  # killed before `latest` moved
    chk = Checkpointer(run, None, 0, keep_last=0)
    assert fmt.latest_checkpoint(run) == ck / "step_00000010"
    assert chk.set_aside_newer(ck / "step_00000010", 10) == []
    assert (ck / "latest").read_text() == "step_00000010"
    # from another run (a fork): `latest` holds its path, so a run stopped before its first save
    # continues from it (not from this run's step_10, nor step 0 in a new run directory)
    other = _fake_checkpoint(tmp_path / "other" / "checkpoints", 20)
    assert chk.set_aside_newer(other, 20) == [] and (ck / "latest").read_text() == str(other)
    assert fmt.latest_checkpoint(run) == other == fmt.resolve_checkpoint(run)
    fresh = Checkpointer(tmp_path / "fresh", None, 0, keep_last=0)  # before its checkpoints/
    assert (
        fresh.set_aside_newer(other, 20) == []
        and fmt.latest_checkpoint(tmp_path / "fresh") == other
    )
    (ck / "latest").write_text("../other/checkpoints/step_00000020")  # a relative path: refused
    with pytest.raises(CheckpointError, match="which is incomplete or missing"):
        fmt.latest_checkpoint(run)
    (ck / "latest").write_text("step_00000010")

    (ck / "step_00000010").rename(ck / "step_00000010.replaced")  # the save of step 10 again,
    (ck / "step_00000010.tmp").mkdir()  # failing before its new directory took the place
    health.remove_partial(ck, 10)
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000005", "step_00000010"]


def test_a_resave_killed_between_its_renames_is_put_back_at_resume(tmp_path, caplog,
                                                                  monkeypatch):  # fmt: skip
    """Saving an existing step_N moves it to step_N.replaced, then renames step_N.tmp into place:
    killed in between, `latest` names a missing step_N. resume=auto puts the complete copy back
    (it was refused: "latest names step_N, which is incomplete or missing")."""
    from llmtrain.train import checkpointing
    from llmtrain.train.checkpointing import Checkpointer

    monkeypatch.setattr(checkpointing.comm, "broadcast_object", lambda x: x)  # one rank
    run = tmp_path / "run"
    ck = run / "checkpoints"
    for s in (5, 10):
        _fake_checkpoint(ck, s)
    (ck / "latest").write_text("step_00000010")
    (ck / "step_00000010").rename(ck / "step_00000010.replaced")
    (ck / "step_00000010.tmp").mkdir()
    with caplog.at_level("WARNING"):
        assert Checkpointer(run, None, 0, keep_last=0).resolve("auto") == ck / "step_00000010"
    assert "moved aside by a save killed midway" in caplog.text
    assert fmt.is_complete(ck / "step_00000010") and not (ck / "step_00000010.replaced").exists()


def test_a_rollback_undone_from_the_abandoned_folder_is_what_resume_auto_takes(tmp_path):
    """resume= a checkpoint in this run's abandoned-UTC/ folder: the checkpoints past it go aside
    in turn and `latest` holds its path, so a run stopped before its next save returns to it."""
    from llmtrain.train.checkpointing import Checkpointer

    run = tmp_path / "run"
    ck = run / "checkpoints"
    for s in (5, 10):
        _fake_checkpoint(ck, s)
    (ck / "latest").write_text("step_00000010")
    back = _fake_checkpoint(ck / "abandoned-20260101T000000Z", 7)
    moved = Checkpointer(run, None, 0, keep_last=0).set_aside_newer(back, 7)
    assert [d.name for d in moved] == ["step_00000010"]
    assert [n for n, _ in fmt.complete_checkpoints(run)] == [5]
    assert fmt.latest_checkpoint(run) == back


def test_keep_last_prunes_by_step_number_up_to_the_save(tmp_path):
    """Pruning counts step_N by number up to the step just saved: a user's step_best and a later
    step_N (which a rollback sets aside first) are never taken for older checkpoints."""
    from llmtrain.train.checkpointing import Checkpointer

    run = tmp_path / "run"
    for s in (1, 2, 3, 40, 500):
        _fake_checkpoint(run / "checkpoints", s)
    (run / "checkpoints" / "step_best").mkdir()
    Checkpointer(run, None, 0, keep_last=2)._prune(40)
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert left == ["step_00000003", "step_00000040", "step_00000500", "step_best"]
