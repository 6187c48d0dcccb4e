"""The device mesh and the built-in parallelisation of one model chunk (torchtitan's recipe).

One DeviceMesh holds every axis, outermost first: ("pp", "dp_replicate", "dp_shard", "cp",
"tp"), all of them even when of size 1, so code can always index an axis by name. Flattened
views, as in torchtitan:
    "dp"          = dp_replicate x dp_shard       who reads distinct samples
    "dp_shard_cp" = dp_shard x cp                 what FSDP shards over (CP ranks share weights)
    "dp_cp"       = dp_replicate x dp_shard x cp  over which the logged loss is averaged

Expert parallelism (MoE, parallelism.ep > 1) borrows its ranks, as torchtitan does: a second
mesh over the same world splits dp_shard x cp into ("efsdp", "ep") = (dp_shard*cp/ep, ep),
consecutive dp_shard_cp ranks forming an EP group. The routed experts are sharded over "ep"
(whole experts per rank) and FSDP-sharded over "efsdp"; everything else is as without EP.

Order of application to a chunk (still on the meta device, so nothing is allocated yet):
    CP -> TP (or the user's "replace_tp" hook) -> activation checkpointing -> compile
    -> FSDP / HSDP / DDP -> the user's "after" hook
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from convergence.rank.hooks import HookContext, HookFn, apply_hook
from convergence.rank.meshes import Meshes
from convergence.spec.layout import AXES
from convergence.trainer.config import TrainConfig
from convergence.trainer.context_parallel import cp_position_offset, make_cp_sdpa
from convergence.trainer.model import Transformer, TransformerBlock

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def build_meshes(cfg: TrainConfig, device_type: str) -> Meshes:
    par = cfg.parallelism
    shape = (par.pp, par.dp_replicate, par.dp_shard, par.cp, par.tp)
    world = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
    data = world["dp_replicate", "dp_shard"]._flatten("dp")
    shard_cp = world["dp_shard", "cp"]._flatten("dp_shard_cp")
    dp_cp = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    num_shard = par.dp_shard * par.cp
    if par.dp_replicate > 1 and num_shard == 1 and par.tp == 1:
        dp_kind, dp = "ddp", world["dp_replicate"]
    elif par.dp_replicate > 1:
        # HSDP (also used for replicate-only with TP: replicate() does not take DTensors).
        dp_kind, dp = "hsdp", world["dp_replicate", "dp_shard_cp"]
    elif num_shard > 1:
        dp_kind, dp = "fsdp", shard_cp
    else:
        dp_kind, dp = "none", None
    ep = efsdp = None
    if par.ep > 1:
        # Same world, same rank order: dp_shard_cp index s*cp + c = efsdp index * ep + ep index.
        sparse = init_device_mesh(
            device_type,
            (par.pp, par.dp_replicate, num_shard // par.ep, par.ep, par.tp),
            mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep", "tp"),
        )
        ep, efsdp = sparse["ep"], sparse["efsdp"]
    return Meshes(
        world=world,
        tp=world["tp"] if par.tp > 1 else None,
        cp=world["cp"] if par.cp > 1 else None,
        pp=world["pp"] if par.pp > 1 else None,
        dp=dp,
        dp_kind=dp_kind,
        dp_cp=dp_cp,
        data=data,
        ep=ep,
        efsdp=efsdp,
    )


def tp_plan(
    model: Transformer, sequence_parallel: bool
) -> tuple[dict[str, object], dict[str, object]]:
    """(plan of the root modules present in this chunk, plan of a *standard* block).

    Hooks that replace the built-in TP (hook_mode = "replace_tp") start from these; the
    built-in TP plans each block by its kind (block_tp_plan).
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    root: dict[str, object] = {}
    if model.tok_embeddings is not None:
        # Embedding sharded over the vocab; its output is summed (and, with SP, scattered
        # over the sequence) so every TP rank continues with the full hidden size.
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sequence_parallel:
        root["norm"] = SequenceParallel()
    elif model.norm is not None and model.args.block_kinds[-1] == "parallel":
        # The last block left the residual stream sharded on the hidden dim: gather it.
        root["norm"] = PrepareModuleInput(
            input_layouts=(Shard(2),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    if model.output is not None:
        # Logits gathered to every TP rank so the loss is computed locally, unsharded.
        root["output"] = ColwiseParallel(
            input_layouts=seq, output_layouts=Replicate(), use_local_output=True
        )
    return root, _standard_block_plan(sequence_parallel)


def _replicated_input(sequence_parallel: bool, *, with_angles: bool) -> PrepareModuleInput:
    """One replicated DTensor as the input of a TP region (Megatron's "f"): all its
    column-parallel consumers add their partial input gradients into it, and it is all-reduced
    (SP: reduce-scattered) ONCE in backward, instead of once per consumer Linear."""
    seq = Shard(1) if sequence_parallel else Replicate()
    if with_angles:  # the angles argument stays a plain tensor
        return PrepareModuleInput(
            input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)
        )
    return PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))


def _standard_block_plan(sequence_parallel: bool) -> dict[str, object]:
    seq = Shard(1) if sequence_parallel else Replicate()
    block: dict[str, object] = {
        # Attention and MLP each: one replicated input, column-parallel in, row-parallel out
        # with its all-reduce (SP: reduce-scatter) -> 2 collectives forward, 2 backward.
        "attention": _replicated_input(sequence_parallel, with_angles=True),
        "feed_forward": _replicated_input(sequence_parallel, with_angles=False),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        # Norms run on sequence shards; attention and MLP gather the full sequence at input.
        block.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
    return block


def _single_sync_block_plan(sequence_parallel: bool) -> dict[str, object]:
    seq = Shard(1) if sequence_parallel else Replicate()
    block: dict[str, object] = {
        # sync_in: the normed input, one replicated DTensor shared by attention and MLP (their
        # five column-parallel Linears): one all-reduce of its gradient in backward.
        "sync_in": _replicated_input(sequence_parallel, with_angles=False),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        # Row-parallel outputs left as Partial DTensors (no reduction); the block adds them...
        "attention.wo": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
        "feed_forward.w2": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
        # ...and sync_out reduces the sum once (SP: reduce-scatter). Its backward is local.
        "sync_out": PrepareModuleInput(
            input_layouts=(Partial(),), desired_input_layouts=(seq,), use_local_output=True
        ),
    }
    if sequence_parallel:
        block["attention_norm"] = SequenceParallel()
    return block


def shard_dim0(module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """Every parameter of ``module`` (and its submodules) sharded on dim 0 over the mesh."""

    def partition(name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(submodule.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, mesh, [Shard(0)])
            submodule.register_parameter(pname, nn.Parameter(sharded))

    return distribute_module(module, device_mesh, partition)


class BlockDiagonalParallel(ParallelStyle):
    """Every parameter of a "parallel" block sharded on dim 0, i.e. into whole slices (groups):
    each TP rank holds parallel_groups/tp slices and computes them with no communication."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return shard_dim0(module, device_mesh)


def block_tp_plan(
    block: TransformerBlock, kinds: tuple[str, ...], sequence_parallel: bool
) -> tuple[ParallelStyle | None, dict[str, object]]:
    """(style of the block itself: its input's layout change, or None; plan of its submodules).

    Between blocks the residual stream is a local tensor: replicated (SP: sequence-sharded),
    or, after a "parallel" block, sharded on the hidden dim (Shard(2)). A block converts its
    input when the previous block (by global layer id, so PP stage boundaries are covered)
    leaves another layout: entering a parallel block slices (no forward communication,
    all-gather of the gradient in backward); leaving one all-gathers forward (local backward).
    """
    full = Shard(1) if sequence_parallel else Replicate()
    after_parallel = block.layer_id > 0 and kinds[block.layer_id - 1] == "parallel"
    entry: ParallelStyle | None = None
    if block.kind == "parallel":
        if not after_parallel:
            entry = PrepareModuleInput(
                input_layouts=(full, None),
                desired_input_layouts=(Shard(2), None),
                use_local_output=True,
            )
        return entry, {}
    if after_parallel:
        entry = PrepareModuleInput(
            input_layouts=(Shard(2), None),
            desired_input_layouts=(full, None),
            use_local_output=True,
        )
    if block.kind == "single_sync":
        return entry, _single_sync_block_plan(sequence_parallel)
    if block.moe is not None:
        return entry, _moe_block_plan(sequence_parallel)
    return entry, _standard_block_plan(sequence_parallel)


def _moe_block_plan(sequence_parallel: bool) -> dict[str, object]:
    """An MoE block under TP: attention as in a standard block; the MoE is not TP-sharded.
    Its input (the normed residual stream, replicated over the TP ranks: no SP, which
    moe_rules refuses) is a plain tensor, so every TP rank routes and computes the same
    tokens -- the same numbers as without TP; the experts are split by EP, not TP."""
    plan = _standard_block_plan(sequence_parallel)
    return {key: style for key, style in plan.items() if not key.startswith("feed_forward")}


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    root, _ = tp_plan(model, sequence_parallel)
    model.hidden_seq_shards = tp_mesh.size() if sequence_parallel else 1
    if root:
        parallelize_module(model, tp_mesh, root)
    for block in model.layers.values():
        assert isinstance(block, TransformerBlock)
        entry, plan = block_tp_plan(block, model.args.block_kinds, sequence_parallel)
        if block.kind == "parallel":
            parallelize_module(block, tp_mesh, BlockDiagonalParallel())
        if plan:
            parallelize_module(block, tp_mesh, plan)
        if entry is not None:
            parallelize_module(block, tp_mesh, entry)


class ExpertParallel(ParallelStyle):
    """The routed experts' weights (n_experts, ...) sharded on dim 0 over the EP mesh: each EP
    rank holds n_experts/ep whole experts (GroupedExperts computes with its local shard)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return shard_dim0(module, device_mesh)


def apply_ep(model: Transformer, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts over the EP mesh and give it the EP group, over which
    its dispatcher sends each expert's tokens to the expert's rank (moe.dispatch)."""
    for block in model.layers.values():
        assert isinstance(block, TransformerBlock)
        if block.moe is not None:
            parallelize_module(block.moe.experts, ep_mesh, ExpertParallel())
            block.moe.ep_group = ep_mesh.get_group()
            # The gradient of an expert is the sum over the ep ranks of its group (their
            # tokens' gradients came back through the all-to-all's backward); FSDP then
            # averages over the efsdp ranks. The loss weight (loss.py) expects the average
            # over all D = efsdp * ep data-parallel ranks, so 1/ep more is due here (exact:
            # ep is a power of two in practice). Without it the experts' gradients are ep
            # times too large while the loss curve looks fine (pytorch/pytorch#160285).
            block.moe.experts.grad_scale = 1.0 / ep_mesh.size()


def apply_activation_checkpointing(model: Transformer, mode: str, freq: int) -> None:
    """ "full": every block; "selective": every `freq`-th block (by global layer id)."""
    for block in model.layers.values():
        assert isinstance(block, TransformerBlock)
        block.activation_checkpoint = mode == "full" or (
            mode == "selective" and block.layer_id % freq == 0
        )


def apply_data_parallel(model: Transformer, meshes: Meshes, cfg: TrainConfig) -> None:
    if meshes.dp_kind == "none":
        return
    assert meshes.dp is not None
    if meshes.dp_kind == "ddp":
        from torch.distributed._composable.replicate import replicate

        replicate(model, device_mesh=meshes.dp)
        return
    train = cfg.training
    mp = MixedPrecisionPolicy(
        param_dtype=DTYPES[train.param_dtype], reduce_dtype=DTYPES[train.reduce_dtype]
    )
    # Pinned host memory needs an accelerator; on a CPU-only machine offload is unpinned.
    pin = meshes.world.device_type == "cuda"
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=pin) if train.cpu_offload else OffloadPolicy()
    )
    reshard = cfg.parallelism.reshard_after_forward
    # One FSDP group per block (all-gathered just in time, freed after use), then the root
    # group for the embeddings, final norm and output.
    for block in model.layers.values():
        assert isinstance(block, TransformerBlock)
        ignored: set[nn.Parameter] | None = None
        if block.moe is not None and meshes.efsdp is not None:
            if meshes.efsdp.size() > 1:
                shard_experts(block.moe.experts, meshes, mp, offload, reshard)
            else:
                # ep = dp_shard*cp: each expert lives on one rank only, its gradient is
                # complete after the all-to-all's backward -- nothing for FSDP to reduce. (An
                # FSDP group over one rank here gave experts' gradients halved after a seed
                # checkpoint load, torch 2.13 + gloo.) GroupedExperts casts the weights to
                # the compute dtype itself.
                ignored = set(block.moe.experts.parameters())
        fully_shard(
            block,
            mesh=meshes.dp,
            mp_policy=mp,
            offload_policy=offload,
            reshard_after_forward=reshard,
            ignored_params=ignored,
        )
    fully_shard(
        model, mesh=meshes.dp, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard
    )


def shard_experts(
    experts: nn.Module,
    meshes: Meshes,
    mp: MixedPrecisionPolicy,
    offload: OffloadPolicy,
    reshard: bool,
) -> None:
    """FSDP of the EP-sharded experts over the efsdp mesh, in a group of their own (the
    block's FSDP then leaves them out). It averages over the efsdp ranks; the other 1/ep of
    the average over all data-parallel ranks is applied in the experts' backward (apply_ep).

    Not FSDP's set_gradient_divide_factor(dp*cp): its reduce-scatter is then a PREMUL_SUM,
    which gloo does not run.
    """
    efsdp = meshes.efsdp
    assert efsdp is not None

    def placement(param: nn.Parameter) -> Shard:
        # Fewer local experts than efsdp ranks: shard the next dim instead of padding.
        local_experts = param.to_local().shape[0] if isinstance(param, DTensor) else 0
        return Shard(0) if local_experts >= efsdp.size() else Shard(1)

    fully_shard(
        experts,
        mesh=efsdp,
        mp_policy=mp,
        offload_policy=offload,
        reshard_after_forward=reshard,
        shard_placement_fn=placement,
    )


def apply_cp(model: Transformer, cp_mesh: DeviceMesh, seq_len: int) -> None:
    """Attention over the whole sequence from this rank's chunk of it (context_parallel.py);
    the rotary offset is set on the model, since PP stages get no forward kwargs from the
    schedule. The inputs are sharded per microstep (engines.shard_for_cp)."""
    cp_sdpa = make_cp_sdpa(cp_mesh)
    for block in model.layers.values():
        block.attention.sdpa = cp_sdpa
    model.position_offset = cp_position_offset(seq_len, cp_mesh)


def parallelize_chunk(
    model: Transformer,
    meshes: Meshes | None,
    cfg: TrainConfig,
    hook: HookFn | None,
    *,
    stage_index: int = 0,
    num_stages: int = 1,
) -> nn.Module:
    """Apply CP, TP, AC, compile, FSDP/DDP and the user hook to one (meta-device) chunk."""
    par = cfg.parallelism
    if meshes is not None and meshes.cp is not None:
        # First, as before any hook: a replace_tp hook gets the model with CP attention.
        apply_cp(model, meshes.cp, cfg.data.seq_len)
    ctx = None
    if hook is not None:
        pp_rank = meshes.pp.get_local_rank() if meshes and meshes.pp else 0
        ctx = HookContext(
            mesh=meshes.world if meshes else None,
            tp_mesh=meshes.tp if meshes else None,
            dp_mesh=meshes.dp if meshes else None,
            config=cfg,
            mode=par.hook_mode,
            pp_rank=pp_rank,
            pp_size=par.pp,
            stage_index=stage_index,
            num_stages=num_stages,
        )
    if hook is not None and ctx is not None and par.hook_mode == "replace_tp":
        replaced = apply_hook(hook, model, ctx)
        assert isinstance(replaced, Transformer), "a replace_tp hook must keep the Transformer"
        model = replaced
    elif meshes is not None and meshes.tp is not None:
        apply_tp(model, meshes.tp, par.sequence_parallel)
    if meshes is not None and meshes.ep is not None:
        apply_ep(model, meshes.ep)
    ac = cfg.activation_checkpoint
    if ac.mode != "none":
        apply_activation_checkpointing(model, ac.mode, ac.selective_layer_freq)
    if cfg.training.compile:
        for block in model.layers.values():
            block.compile()
    if meshes is not None:
        apply_data_parallel(model, meshes, cfg)
    if hook is not None and ctx is not None and par.hook_mode == "after":
        return apply_hook(hook, model, ctx)
    return model
