"""The one module that talks to DeepSpeed: process groups, the DeepSpeed config built from ours,
`deepspeed.initialize`, backward/step, and each rank's local fragments of fp32 weights and Adam
moments (what sharded checkpoints save and restore).

Expert parallelism rides on DeepSpeed's own machinery: expert parameters are tagged
(`allreduce=False`, `group_name`) and the optimizer gets DeepSpeed's MoE parameter groups.
Under ZeRO-1/2 each MoE layer carries a marker that is an instance of `deepspeed.moe.layer.MoE`,
which is what makes the engine use the expert / expert-data-parallel groups for them (ZeRO then
partitions expert optimizer state over the expert-data-parallel ranks). Under ZeRO-3 the engine
refuses that class (deepspeed/runtime/engine.py:2197-2218, `_validate_zero3_moe_compatibility`),
so there is no marker: expert parameters carry the per-parameter placement DeepSpeed's AutoEP
sets (`ds_zero_placement_family="autoep_expert"`, `ds_zero_partition_group_name`) plus the
resolved partition group (what `_resolve_zero3_param_placement` would set, engine.py:2242-2279;
without a MoE layer the engine skips it, engine.py:2713). ZeRO-3 then partitions, gathers and
reduce-scatters experts over the expert-data-parallel group only
(runtime/zero/partition_parameters.py:1302), averages their gradients over the whole
data-parallel world and sums their norm over the expert-parallel group
(runtime/zero/stage3.py:675-692, 1995). Pin DeepSpeed: these are internals (0.19.8).
"""

from __future__ import annotations

import logging
import math
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmtrain.config import Config
from llmtrain.parallel import comm
from llmtrain.parallel.expert import ExpertParallelDispatcher
from llmtrain.parallel.layout import Layout

logger = logging.getLogger(__name__)

EXPERT_PARAM_NAMES = ("w_gate_up", "w_down")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str = "auto") -> tuple[int, int, int]:
    """Join (or, alone, create) the default process group; returns (rank, world, local_rank)."""
    import warnings

    import deepspeed

    # DeepSpeed 0.19.8 calls torch's all_gather_into_tensor, which torch 2.13 deprecates with a
    # FutureWarning on every rank of every run: not the user's to act on
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
        category=FutureWarning,
    )  # fmt: skip

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        from llmtrain.config import ConfigError

        raise ConfigError("parallel.backend=nccl needs CUDA GPUs, and torch sees none here; use "
                          "parallel.backend=auto (gloo on CPU) or gloo")  # fmt: skip
    if "WORLD_SIZE" not in os.environ:  # a plain `llmtrain train`: a group of one
        own = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            own["MASTER_PORT"] = str(_free_port())
        _OWN_ENV.update({k: os.environ.get(k) for k in own})  # shutdown_distributed restores
        os.environ.update(own)
    if not dist.is_initialized():
        try:
            deepspeed.init_distributed(dist_backend=backend)
        except BaseException:
            _restore_env()
            raise
        release_shm_names()
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))


SHM_DIR = "/dev/shm"


def shm_buffer_name(rank: int) -> str:
    """The POSIX shared-memory name DeepSpeed's CPU all-reduce op gives `rank`'s workspace
    (ops/csrc/cpu/comm/shm.cpp, shm_initialize: SHM_BUFFER_NAME_<uid>_<addr>_<port>_<rank>)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_shm_names() -> None:
    """Unlink this rank's DeepSpeed shared-memory workspace name once every rank has mapped it.

    Why: on CPU, when all ranks share a machine (LOCAL_SIZE == WORLD_SIZE, as under the
    `deepspeed` launcher on one node), DeepSpeed's shm op creates a 64 MiB workspace per rank in
    /dev/shm and never unlinks it (shm.cpp has a `shared_close` that nothing calls). tmpfs is
    RAM, so each run leaked 64 MiB per rank until the machine ran out of memory. The op maps
    every peer's workspace inside `initialize` (it loops until the name appears), so after a
    barrier the names are no longer needed: unlinking keeps the mappings alive and the kernel
    frees the memory when the last rank exits, however it exits.
    """
    world = os.environ.get("WORLD_SIZE")
    if world is None or os.environ.get("LOCAL_SIZE") != world or not dist.is_initialized():
        return  # the op creates no workspace unless every rank is local
    if dist.get_backend() == "nccl":
        return  # the CPU shm op is built only for the CPU accelerator
    comm.barrier()  # every rank has mapped every peer's workspace by now
    try:
        os.unlink(os.path.join(SHM_DIR, shm_buffer_name(dist.get_rank())))
    except FileNotFoundError:
        pass


# the launcher variables init_distributed set for a group of one, with what they were before
_OWN_ENV: dict[str, str | None] = {}


def _restore_env() -> None:
    for k, v in _OWN_ENV.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _OWN_ENV.clear()


def shutdown_distributed() -> None:
    """Leave the process group and forget DeepSpeed's cached groups, so a later run in the same
    process (the Python API, a notebook) starts clean: DeepSpeed keeps clones of the world,
    data-parallel and expert groups in module globals, and a new engine would use the dead ones.
    The variables of a group of one go too: a child process (a later `llmtrain train`) would
    take them for a launcher's and reuse a port this process's store may still hold."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _restore_env()
    try:
        from deepspeed.utils import groups
    except ImportError:  # pragma: no cover - deepspeed is a training dependency
        return
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS",
                 "_EXPERT_DATA_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
                 "_ALL_TO_ALL_GROUP"):  # fmt: skip
        if isinstance(getattr(groups, name, None), dict):
            getattr(groups, name).clear()
    for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP"):
        if hasattr(groups, name):
            setattr(groups, name, None)


def device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def expert_group_name(ep_size: int) -> str:
    return f"ep_size_{ep_size}"


def make_dispatcher(layout: Layout):
    """Create DeepSpeed's expert / expert-data-parallel groups; return the EP dispatcher."""
    if layout.ep_size == 1:
        return None
    from deepspeed.utils import groups

    name = expert_group_name(layout.ep_size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(layout.ep_size)
    group = groups._get_expert_parallel_group(name)
    return ExpertParallelDispatcher(group, layout.ep_size, dist.get_rank(group))


def _marker_class():
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    class DeepSpeedMoEMarker(DeepSpeedMoE):
        """Makes the engine treat the enclosing layer as MoE; holds no weights, runs nothing."""

        def __init__(self, num_experts: int, ep_size: int):
            nn.Module.__init__(self)  # DeepSpeed's MoE builds its own gate/experts: skip that
            self.num_experts = num_experts
            self.ep_size = ep_size
            self.num_local_experts = num_experts // ep_size
            self.expert_group_name = expert_group_name(ep_size)
            self.enable_expert_tensor_parallelism = False

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            pass  # groups were made by make_dispatcher before the model existed

        def forward(self, *args, **kwargs):  # pragma: no cover - never called
            raise RuntimeError("the MoE marker is not a layer")

    return DeepSpeedMoEMarker


def is_expert_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_PARAM_NAMES


def expert_param_attrs(layout: Layout, zero_stage: int) -> dict[str, Any]:
    """What DeepSpeed reads off an expert parameter (see the module docstring)."""
    name = expert_group_name(layout.ep_size)
    attrs: dict[str, Any] = {"allreduce": False, "group_name": name}
    if zero_stage == 3:
        from deepspeed.utils import groups

        attrs.update(
            ds_zero_placement_family="autoep_expert",
            ds_zero_partition_group_name=name,
            ds_zero_partition_process_group=groups._get_expert_data_parallel_group(name),
        )
    return attrs


def tag_expert_parallel(model: nn.Module, layout: Layout, zero_stage: int) -> None:
    """Mark expert parameters for DeepSpeed (see the module docstring): a MoE marker per layer
    under ZeRO-1/2, AutoEP's per-parameter ZeRO-3 placement under ZeRO-3."""
    if layout.ep_size == 1:
        return
    if zero_stage != 3:
        marker = _marker_class()
        for m in model.moe_layers():
            m.ds_moe_marker = marker(m.cfg.n_routed_experts, layout.ep_size)
    attrs = expert_param_attrs(layout, zero_stage)
    for pname, p in model.named_parameters():
        if is_expert_param(pname):
            for k, v in attrs.items():
                setattr(p, k, v)


def sharded_build(cfg: Config, layout: Layout, dispatcher) -> dict[str, Any]:
    """Keyword arguments for `build_model` so that each rank allocates only what it keeps.

    Under ZeRO-3 the modules are created inside `deepspeed.zero.Init` (each weight is cut to
    this rank's partition as its module is built; experts over the expert-data-parallel group,
    which is why the dispatcher hands the experts their placement at creation) and initialised
    one weight at a time under `GatheredParameters` (rank 0 of the weight's group writes).
    Other stages need nothing: a rank builds only its experts anyway, and ZeRO-1/2 keep whole
    weights on every rank."""
    if effective_zero_stage(cfg, layout) != 3:
        return {}
    import deepspeed

    if dispatcher is not None:
        dispatcher.expert_param_attrs = expert_param_attrs(layout, 3)
    ds_config = deepspeed_config(cfg, layout)
    return {
        "init_context": lambda: deepspeed.zero.Init(config_dict_or_path=ds_config),
        "gather": lambda p: deepspeed.zero.GatheredParameters([p], modifier_rank=0),
    }


def zero3_partition(p: torch.Tensor) -> tuple[int, int, torch.Tensor] | None:
    """(start, numel, local 1-D tensor) of what this rank keeps of a ZeRO-3 weight flattened:
    partition i of a weight's group holds elements [i·part, (i+1)·part), padding excluded
    (partition_parameters.py `_partition_param`, 0.19.8); None for a weight that is whole."""
    if not hasattr(p, "ds_tensor"):
        return None
    import deepspeed.comm as ds_comm

    part = p.ds_tensor.numel()
    start = ds_comm.get_rank(group=p.ds_process_group) * part
    return start, max(0, min(part, p.ds_numel - start)), p.ds_tensor.view(-1)


def register_external_weights(model: nn.Module) -> None:
    """ZeRO-3 gathers a weight only inside its own module's call: declare the weights a module
    reads from elsewhere (e.g. the latent-cache decode path reads kv_b_proj.weight)."""
    import deepspeed

    for mod, weight in model.weights_read_outside_their_module():
        deepspeed.zero.register_external_parameter(mod, weight)


def release_gathered(model: nn.Module) -> None:
    """Drop the whole copies ZeRO-3 keeps gathered between forwards (weights below the
    persistence threshold stay gathered after their first use), so that the next forward
    gathers them again from the partitions just written; else a refill (`llmtrain eval --watch
    --sharded` scoring its second checkpoint) would compute with the previous weights there."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    held = [p for p in model.parameters()
            if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE]  # fmt: skip
    if held:
        held[0].partition(held)  # frees the whole copies; the partitions are the values


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrices only; expert params split into DeepSpeed's MoE groups."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:  # ds_shape: a weight built under zero.Init is already partitioned
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    groups = [g for g in groups if g["params"]]
    if any(not getattr(p, "allreduce", True) for g in groups for p in g["params"]):
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    return groups


def effective_zero_stage(cfg: Config, layout: Layout) -> int:
    """ZeRO over one rank partitions nothing but still copies every gradient into flat buffers
    (a third of a CPU step at the 28M config); one fp32 process runs DeepSpeed's stage 0, with
    the non-finite-gradient skip done here (Engine.step) instead of in ZeRO's optimizer."""
    if layout.world_size == 1 and cfg.train.dtype == "fp32" and not cfg.train.offload_optimizer:
        return 0
    return layout.zero_stage


# Buffers DeepSpeed must leave in fp32 even when told to cast buffers (data_types.buffer_dtype).
FP32_BUFFERS = ["e_score_correction_bias", "last_counts", "load_since_update"]


def deepspeed_config(cfg: Config, layout: Layout) -> dict[str, Any]:
    """Our config to DeepSpeed's, with `train.deepspeed` merged over it for advanced users.

    Under bf16 the gradients are accumulated over micro-batches and reduced across ranks in
    fp32 (`data_types.grad_accum_dtype`, `communication_data_type`): DeepSpeed's default for
    both is the model dtype, i.e. bf16 sums whose 8-bit mantissa drops small micro-batch
    contributions. Master weights and Adam moments are fp32 in every ZeRO stage regardless.
    """
    t = cfg.train
    zero: dict[str, Any] = {"stage": effective_zero_stage(cfg, layout)}
    if t.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if layout.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    ds = {
        "train_batch_size": layout.global_batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.grad_accum,
        "gradient_clipping": float(t.grad_clip),  # explicit: DeepSpeed 0.19 defaults to 1.0
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": t.dtype == "bf16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronises the device at every forward and every
        # engine.step(): twice a micro-batch the GPU drains and idles while the host prepares
        # the next one. The trainer times steps itself
        "timers": {"throughput": {"enabled": False}},
    }
    if t.dtype == "bf16":
        ds["data_types"] = {"grad_accum_dtype": "fp32", "keep_in_fp32_modules": FP32_BUFFERS}
        ds["communication_data_type"] = "fp32"
        # ZeRO-1 + fp32 accumulation runs DeepSpeed's BF16_Optimizer. In 0.19.8 its default
        # path (accumulating in backward_epilogue) overcounted gradients over micro-batches
        # (norm 2.56 vs 0.94 at 4 micro-batches; tests/test_bf16.py); accumulating from the
        # gradient hooks is exact, and frees each bf16 gradient as soon as it is added.
        ds["bf16"]["immediate_grad_update"] = True
    return _merge(ds, t.deepspeed)


def routers(model: nn.Module) -> list[nn.Module]:
    return [m.gate for m in model.moe_layers()] if hasattr(model, "moe_layers") else []


def keep_routing_fp32(model: nn.Module, fp32_router_weights: list[torch.Tensor | None]) -> None:
    """After `deepspeed.initialize`: routing state back to fp32 (see Router, MoE docstrings).

    Buffers (bias, load counters) are restored in place. The router weights, cast to bf16 by
    the engine like every parameter, get their fp32 master values: the exact pre-cast values
    (also written into the optimizer's master copy) where we kept them, else the master copy.
    """
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    for m in model.moe_layers() if hasattr(model, "moe_layers") else []:
        m.keep_routing_state_fp32()
    for gate, w in zip(routers(model), fp32_router_weights):
        if gate.weight.dtype == torch.float32:
            gate.set_fp32_weight(None)
            continue
        if w is not None:
            safe_set_full_fp32_param(gate.weight, w.to(gate.weight.device))
        else:
            w = safe_get_full_fp32_param(gate.weight)
        gate.set_fp32_weight(w if w is not None else gate.weight.detach().float())


def refresh_fp32_routers(model: nn.Module) -> None:
    """Copy the optimizer's fp32 master router weights to the routers (a collective: all ranks)."""
    from deepspeed.utils import safe_get_full_fp32_param

    for gate in routers(model):
        if gate.fp32_weight is not None:
            w = safe_get_full_fp32_param(gate.weight)
            if w is not None:
                gate.set_fp32_weight(w)


def accumulate_in_place(optimizer) -> bool:
    """Make DeepSpeed's BF16_Optimizer add each micro-batch's bf16 gradient into its fp32
    accumulator in one pass; returns whether it did.

    Its hook (bf16_optimizer.py `_update_hp_grad`, 0.19.8) runs `hp.add_(lp.grad.to(fp32))`:
    a temporary fp32 copy of every gradient, written and read again, 18 bytes moved per
    parameter per micro-batch where an add that reads the bf16 gradient directly moves 10
    (on a GPU the mixed-dtype add casts as it loads; 8 GB less traffic per micro-batch at 1B
    parameters). The sum is the same to the bit: bf16 -> fp32 is exact either way.
    Anything other than the plain single-copy case (AutoEP's tensor-parallel folding) keeps
    DeepSpeed's own method."""
    try:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    except ImportError:  # pragma: no cover - deepspeed is a training dependency
        return False
    if not isinstance(optimizer, BF16_Optimizer) or not all(
        hasattr(optimizer, a) for a in ("fp32_groups_gradients", "fp32_groups_has_gradients")
    ):
        return False
    if getattr(optimizer, "autoep_folding_tp_group", None) is not None:
        return False
    original = optimizer._update_hp_grad

    @torch.no_grad()
    def update_hp_grad(lp, group_idx, param_idx, clear_lp_grads):
        if lp.grad is None:
            return
        hp_grad = optimizer.fp32_groups_gradients[group_idx][param_idx]
        if hp_grad is None:
            return original(lp, group_idx, param_idx, clear_lp_grads)  # its assertion
        hp_grad.add_(lp.grad.view(hp_grad.shape))
        lp._hp_grad = hp_grad
        optimizer.fp32_groups_has_gradients[group_idx][param_idx] = True
        if clear_lp_grads:
            lp.grad.zero_()

    # the instance's: the hooks call self._update_hp_grad
    optimizer._update_hp_grad = update_hp_grad
    return True


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class Engine:
    """DeepSpeed engine around our model: forward, backward, step, LR, full-state views."""

    def __init__(self, model: nn.Module, cfg: Config, layout: Layout):
        import deepspeed

        self.cfg, self.layout, self.model = cfg, layout, model
        tag_expert_parallel(model, layout, effective_zero_stage(cfg, layout))
        t = cfg.train
        groups = param_groups(model, t.weight_decay)
        if t.offload_optimizer:  # optimizer state in host memory, stepped by DeepSpeed's CPU Adam
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            opt = DeepSpeedCPUAdam(
                groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, adamw_mode=True
            )
        else:  # fused: one kernel over the flat partitions (CPU and CUDA)
            opt = torch.optim.AdamW(
                groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True
            )
        if effective_zero_stage(cfg, layout) == 3:
            register_external_weights(model)
        self.ds_config = deepspeed_config(cfg, layout)
        fp32_routers = [  # exact values, before the engine casts them; partitioned (ZeRO-3):
            # the exact fp32 values init or train.init_from kept aside, where they did
            getattr(g, "exact_fp32_weight", None)
            if hasattr(g.weight, "ds_id")
            else g.weight.detach().float().clone()
            for g in routers(model)
        ]
        for g in routers(model):
            g.exact_fp32_weight = None
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, config=self.ds_config
        )
        keep_routing_fp32(model, fp32_routers)
        self.zero_stage = effective_zero_stage(cfg, layout)
        bf16_optimizer = accumulate_in_place(self.optimizer)
        if layout.world_size == 1 and (
            self.engine.zero_optimization_stage() == 0 or bf16_optimizer
        ):
            # Their reduction over one rank is the identity, yet it copies every fp32 gradient
            # into 2 GB buckets, scales it by 1/1 and copies it back at each step. (ZeRO-1/2/3
            # optimizers do more in that call, partitioning their gradients: they keep it.)
            self.engine.enable_backward_allreduce = False
        self._norm: float | None = None
        if self.zero_stage != layout.zero_stage:
            logger.info(
                "one fp32 process: DeepSpeed runs without ZeRO partitioning (nothing to partition)"
            )

    # ------------------------------------------------------------ steps

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        boundary = self.engine.is_gradient_accumulation_boundary()
        self._step()
        if boundary and self.engine.bfloat16_enabled():
            refresh_fp32_routers(self.model)  # routers read the updated fp32 master weights

    def _step(self) -> None:
        if self.zero_stage == 0 and self.engine.is_gradient_accumulation_boundary():
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
            self._norm = norm
            if not math.isfinite(norm):  # skip the update: AdamW leaves grad-less params alone
                for p in self.model.parameters():
                    p.grad = None
                clip = self.engine._config.gradient_clipping
                self.engine._config.gradient_clipping = 0.0  # its clipping needs some gradient
                try:
                    self.engine.step()
                finally:
                    self.engine._config.gradient_clipping = clip
                return
        self.engine.step()

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def grad_norm(self) -> float:
        if self.zero_stage == 0:
            return self._norm if self._norm is not None else float("nan")
        n = self.engine.get_global_grad_norm()
        return float(n) if n is not None else float("nan")

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    # ------------------------------------------------------------ optimizer state

    def _base_optimizer(self):
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def relink_optimizer_state(self) -> None:
        """DeepSpeed 0.19 links Adam state to parameter fragments after the first group's first
        step only, so later groups (no-decay, MoE) stay unlinked; link all of them again."""
        opt = self.optimizer
        if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

    def optimizer_step_count(self) -> int:
        for st in self._base_optimizer().state.values():
            if "step" in st:
                return int(st["step"])
        return 0

    # ------------------------------------------------------------ local fragments (sharded checkpoints)
    # What this rank holds of each parameter, as writable 1-D views, without gathering anything:
    # ZeRO-0 the whole parameter and the torch optimizer's state, ZeRO-1/2 `param._hp_mapping`
    # (one fragment of the flattened parameter, views into the flat fp32 partition and its Adam
    # state), ZeRO-3 the rank's slice [r*P, min((r+1)*P, numel)) of the flat fp32 partition.

    def prepare_optimizer_state(self, step: int | None = None) -> None:
        """Create Adam's state where it does not exist yet (it is lazy) and link the fragments to
        it; `step` (when given) is written into every state in the form the optimizer keeps it."""
        base = self._base_optimizer()
        cpu_adam = type(base).__name__ == "DeepSpeedCPUAdam"
        for p, g in self._optimizer_params():
            st = base.state[p]
            if "exp_avg" not in st:
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st.setdefault("step", 0)
            if step is not None:
                st["step"] = self._step_value(step, p, g, cpu_adam)
            elif not cpu_adam and not torch.is_tensor(st["step"]):
                st["step"] = self._step_value(int(st["step"]), p, g, cpu_adam)
        self.relink_optimizer_state()

    def _optimizer_params(self):
        """(tensor the optimizer steps, its param group): ZeRO-3 puts its flat fp32 partitions
        into the groups only during a step (stage3.py `_optimizer_step`), so list them here."""
        base, opt = self._base_optimizer(), self.optimizer
        if hasattr(opt, "fp32_partitioned_groups_flat"):
            for i, p in enumerate(opt.fp32_partitioned_groups_flat):
                yield p, base.param_groups[opt.sub_group_to_group_id[i]]
        else:
            for g in base.param_groups:
                for p in g["params"]:
                    yield p, g

    @staticmethod
    def _step_value(step: int, p: torch.Tensor, group: dict, cpu_adam: bool):
        """DeepSpeed's CPU Adam keeps a Python int; torch's fused (Adam)W a float32 tensor on the
        parameter's device; the other torch implementations a float tensor on the CPU."""
        if cpu_adam:
            return int(step)
        if group.get("fused") or group.get("capturable"):
            return torch.tensor(float(step), dtype=torch.float32, device=p.device)
        return torch.tensor(float(step), dtype=torch.get_default_dtype())

    def local_fragment(
        self, p: torch.Tensor, moments: bool = True
    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """(start within the flattened local parameter, {"fp32", "exp_avg", "exp_avg_sq"} views
        of equal length) for what this rank holds of `p`, or None. Call
        `prepare_optimizer_state` first so the moments exist; `moments=False`: the fp32 view
        alone (weights-only reads, no Adam state needed)."""
        keys = ("exp_avg", "exp_avg_sq") if moments else ()
        if self.zero_stage == 3 or hasattr(p, "ds_id"):
            opt = p._z3_optimizer
            numel = p.ds_numel
            part = p.ds_tensor.numel()
            start = opt._get_param_partition_rank(p) * part
            n = max(0, min(part, numel - start))
            if n == 0:
                return None
            views = {}
            for key in (None, *keys):
                v, _ = opt._get_fp32_opt_state_partition(p, False, optim_state_key=key)
                views[key or "fp32"] = v.narrow(0, 0, n)
            return start, views
        mapping = getattr(p, "_hp_mapping", "absent")
        if mapping == "absent":  # no ZeRO partitioning: the parameter is its own master
            st = self._base_optimizer().state[p] if keys else {}
            return 0, {"fp32": p.data.view(-1), **{k: st[k].view(-1) for k in keys}}
        if mapping is None:
            return None
        addr = mapping.lp_fragment_address
        if addr.numel == 0:
            return None
        views = {"fp32": mapping.get_hp_fragment()}
        for key in keys:
            views[key] = mapping.get_hp_fragment(key)
        return addr.start, views

    def refresh_low_precision(self) -> None:
        """After fp32 master fragments were written: copy them into the parameters the model
        computes with (ZeRO-1/2: each rank its partition, then DeepSpeed's all-gather)."""
        opt = self.optimizer
        if self.zero_stage == 0:
            return
        if hasattr(opt, "update_lp_params"):
            opt.update_lp_params()
        elif hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3: partitions are local
            for lp, hp in zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat):
                if hp.numel():
                    lp.data.copy_(hp.data)
            release_gathered(self.model)
        else:
            raise NotImplementedError(f"cannot refresh weights of {type(opt).__name__}")
        if self.engine.bfloat16_enabled():
            refresh_fp32_routers(self.model)  # routers compute with the restored fp32 masters


class WeightsEngine:
    """The run's model at its layout holding its weights and nothing for training: what
    `llmtrain eval --sharded` scores with.

    Why: the training `Engine` carries fp32 master weights, fp32 gradient accumulators and
    DeepSpeed's reduce buckets (ZeRO-1/2 also allocate Adam's moments at build): about 10
    bytes a parameter beside the 2 of bf16 weights, and under ZeRO-3 fixed buckets of ~2 GB
    whatever the model. Evaluation needs the weights alone. ZeRO-3 runs DeepSpeed's engine
    without an optimizer (its partitioning and gather hooks: DeepSpeedZeRoOffload); the other
    stages keep whole weights on every rank anyway (experts split over the EP ranks by the
    model), so the model runs as built. Checkpoint pieces are read straight into the
    training-dtype weights: the fp32 -> bf16 rounding DeepSpeed applies to its master weights,
    so scores equal the training engine's. Routers keep full fp32 weights (routing is fp32), as
    in training."""

    def __init__(self, model: nn.Module, cfg: Config, layout: Layout):
        self.cfg, self.layout, self.model = cfg, layout, model
        self.zero_stage = effective_zero_stage(cfg, layout)
        self.engine = model
        if self.zero_stage == 3:
            import deepspeed

            register_external_weights(model)
            self.engine, _, _, _ = deepspeed.initialize(
                model=model, config=deepspeed_config(cfg, layout)
            )
        for m in model.moe_layers() if hasattr(model, "moe_layers") else []:
            m.keep_routing_state_fp32()
        self._fp32_router = {}  # id(router weight) -> its full fp32 values (when not fp32 itself)
        for gate in routers(model):
            gate.exact_fp32_weight = None  # the checkpoint's values replace the init's
            w = gate.weight
            if w.dtype != torch.float32:
                shape = tuple(getattr(w, "ds_shape", w.shape))
                gate.set_fp32_weight(torch.zeros(shape, dtype=torch.float32, device=w.device))
                self._fp32_router[id(w)] = gate

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    def prepare_optimizer_state(self, step: int | None = None) -> None:
        raise NotImplementedError("a WeightsEngine has no optimizer: restore(weights_only=True)")

    def local_fragment(
        self, p: torch.Tensor, moments: bool = False
    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """As `Engine.local_fragment` with `moments=False`, the views being the weights the model
        computes with (the training dtype): a router's full fp32 copy, a ZeRO-3 weight's local
        partition, else the whole (local) parameter."""
        if moments:
            raise NotImplementedError("a WeightsEngine holds no Adam moments")
        gate = self._fp32_router.get(id(p))
        if gate is not None:
            return 0, {"fp32": gate.fp32_weight.view(-1)}
        part = zero3_partition(p)
        if part is None:
            return 0, {"fp32": p.data.view(-1)}
        start, n, local = part
        return (start, {"fp32": local[:n]}) if n > 0 else None

    @torch.no_grad()
    def refresh_low_precision(self) -> None:
        """After the pieces were written: routers' partitions from their fp32 copies (the value
        routing reads is the copy; the parameter stays consistent with it), and ZeRO-3's
        gathered copies dropped so the next forward gathers the new values."""
        for gate in self._fp32_router.values():
            w, full = gate.weight, gate.fp32_weight.view(-1)
            part = zero3_partition(w)
            if part is None:
                w.data.copy_(full.view(w.shape))
            elif part[1] > 0:
                start, n, local = part
                local[:n].copy_(full[start : start + n])
        if self.zero_stage == 3:
            release_gathered(self.model)
