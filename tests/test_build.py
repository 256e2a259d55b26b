"""Sharded build: under ZeRO-3 each rank allocates only its partition of every weight (experts
over the expert-data-parallel group), and the weights are those of the ordinary build."""

from __future__ import annotations

import json

import pytest
import torch

from .test_comm import _spawn


def _build(rank, world, out):
    import deepspeed

    from llmtrain.config import load_config
    from llmtrain.model import build_model
    from llmtrain.parallel.engine import (
        init_distributed,
        is_expert_param,
        make_dispatcher,
        sharded_build,
    )
    from llmtrain.parallel.layout import make_layout

    from .conftest import ROOT
    from .test_model import _Rank

    cfg = load_config(
        ROOT / "configs" / "debug.yaml", ["parallel.zero_stage=3", "parallel.ep_size=2"]
    )
    init_distributed("gloo")
    layout = make_layout(cfg, world)
    dispatcher = make_dispatcher(layout)
    hooks = sharded_build(cfg, layout, dispatcher)
    model = build_model(cfg.model, seed=3, dispatcher=dispatcher, **hooks)
    plain = dict(build_model(cfg.model, seed=3, dispatcher=_Rank(world, rank)).named_parameters())
    held = whole = 0
    groups = {}
    for name, p in model.named_parameters():
        held += p.ds_tensor.numel()
        whole += p.ds_numel
        groups[name] = p.ds_process_group.size()
        with deepspeed.zero.GatheredParameters([p]):
            torch.testing.assert_close(p.data, plain[name].data, rtol=0, atol=0)
    expert = sum(p.numel() for n, p in plain.items() if is_expert_param(n))
    if rank == 0:
        out.write_text(
            json.dumps({"held": held, "whole": whole, "expert": expert, "groups": groups})
        )
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # ~30 s: DeepSpeed start-up on two ranks
def test_zero3_build_allocates_only_this_ranks_partition(tmp_path):
    _spawn(_build, tmp_path / "build.json")
    r = json.loads((tmp_path / "build.json").read_text())
    dense = r["whole"] - r["expert"]
    # world 2, EP 2: the dense half is split in two, the rank's own experts are its alone
    assert r["held"] <= dense / 2 + r["expert"] + 64 * len(r["groups"])  # ceil padding
    assert r["held"] < r["whole"]
    assert all(v == (1 if ".experts.w_" in k else 2) for k, v in r["groups"].items())
