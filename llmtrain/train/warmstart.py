"""`train.init_from`: start a run from a Hugging Face DeepseekV3/V2 directory.

Why its own module: a published model and the run's config may differ in what the run adds.
Multi-token prediction is the common case: most releases ship no MTP layers (transformers drops
them), yet a run may train with `model.mtp_depth > 0`. The MTP layers the directory has are
loaded; the others keep the run's own initialisation (same seed, same values at any layout),
and the run says so.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from llmtrain.config import ModelConfig

logger = logging.getLogger(__name__)


def hf_weights_for(model, ours: ModelConfig, path: Path, hf_cfg: ModelConfig, rank: int = 0):
    """The directory's tensors under our names for `model`, with the MTP layers it lacks taken
    from `model` itself (freshly initialised); logs which those are on rank 0."""
    from llmtrain.hf import read_safetensors_dir, state_dict_from_hf

    hf_sd = read_safetensors_dir(path)
    # count the MTP layers by their weights: transformers writes num_nextn_predict_layers=1 in
    # config.json while its models hold (and save) no MTP layer
    have = 0
    while have < ours.mtp_depth and any(
        n.startswith(f"model.layers.{ours.num_layers + have}.") for n in hf_sd
    ):
        have += 1
    depth = have
    sd = state_dict_from_hf(hf_sd, dataclasses.replace(hf_cfg, mtp_depth=depth))
    fresh = [k for k in range(depth, ours.mtp_depth)]
    if fresh:
        from llmtrain.parallel.engine import is_expert_param

        for name, p in model.named_parameters():
            if not name.startswith(tuple(f"mtp.{k}." for k in fresh)):
                continue
            w = p.detach()
            if is_expert_param(name):  # the loader slices full tensors to this rank's experts
                off = model.get_submodule(name.rsplit(".", 1)[0]).offset
                full = w.new_zeros((ours.n_routed_experts, *w.shape[1:]))
                full[off : off + w.shape[0]] = w
                w = full
            sd[name] = w
        if rank == 0:
            logger.warning(
                "train.init_from=%s holds %d MTP layer(s) and model.mtp_depth=%d: MTP layer(s) %s "
                "start from a fresh initialisation",
                path,
                have,
                ours.mtp_depth,
                ", ".join(map(str, fresh)),
            )
    return sd
