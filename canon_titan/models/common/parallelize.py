"""What every family's ``parallelize`` does around its own tensor-parallel block plan: the
vocab-parallel embedding and output, the TP regions of each block, then activation checkpointing,
per-block compile and FSDP2/HSDP (in that order, as TorchTitan's llama3 does). PP is TorchTitan's
``pipeline_llm``, which calls the family's function on every stage.

A block's TP region: each half of a block (mixer or attention; feed-forward) starts where its input
is made whole on every TP rank (all-gathered along the sequence under sequence parallelism, else
taken as the replicated residual stream) and ends at its row-parallel output projection. Inside,
activations are plain tensors and their gradients are *partial sums*: each rank holds what its own
shards contribute (the column-parallel linears' input gradients are left unreduced). The region's
entry reduces them once: one reduce-scatter under sequence parallelism, one all-reduce without it,
however many linears read the input (TorchTitan's scheme; reducing at every linear costs one
all-reduce each). Parameters that every rank applies whole to its share of the work (the Canon-A/C
weights and their fused norm inside a region, a norm on a sequence shard, the rows of a Canon-B/D
weight, the linear models' low-rank bottlenecks) get partial gradients too: they are used as plain
local tensors and marked (``tensor_parallel.partial_gradients``), and the trainer sums all of them
over the TP group in one all-reduce after the step's last backward (``sum_partial_gradients``), not
one collective per parameter in every block's backward.

Sequence parallelism: a norm before a region runs on each rank's sequence shard, as a plain
module (its weight's gradient a partial sum). With Canon layers: Canon-A and Canon-C mix along the
sequence, so the activations are all-gathered *before* them and they always see the whole sequence.
They run the RMSNorm before them themselves (fused), so there the region starts before the norm,
which every TP rank then computes on the whole sequence. Every parameter a block plan leaves alone
is replicated over the TP mesh, so all parameters share one mesh layout under FSDP x TP (which
gradient-norm clipping needs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torchao.float8.config import ScalingGranularity, ScalingType
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.tools.logging import logger

from canon_titan.kernels.backends import KernelEnvironment
from canon_titan.models.common.tensor_parallel import ChannelShard, partial_gradients


class EmbeddingParallel(ParallelStyle):
    """The vocab-parallel embedding: the table sharded by rows (vocabulary), the token ids
    replicated, the output reduced (all-reduce, or reduce-scatter under sequence parallelism to
    ``layout``) before the first block, as a plain tensor.

    Not torch's ``RowwiseParallel``, which redistributes asynchronously and hands the first block
    an ``AsyncCollectiveTensor``: a block compiled with torch.compile (torch 2.13) resolves such an
    input with ``trigger_wait()`` outside autograd and traces it as not requiring grad, so the
    compiled block returns no gradient for it and the embedding's gradient is silently dropped.
    Waiting here gives up no overlap (the first block uses the activations at once; a compiled block
    waits on entry anyway). Built on DTensor's public ``distribute_module``."""

    def __init__(self, layout: Placement):
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def shard_rows(_, mod, mesh):
            for name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(
                    name,
                    nn.Parameter(
                        distribute_tensor(param, mesh, [Shard(0)]),
                        requires_grad=param.requires_grad,
                    ),
                )

        return distribute_module(
            module,
            device_mesh,
            shard_rows,
            input_fn=lambda _, args, mesh: (
                DTensor.from_local(args[0], mesh, (Replicate(),), run_check=False),
                *args[1:],
            ),
            output_fn=lambda _, out, mesh: out.redistribute(placements=(self.layout,)).to_local(),
        )


def region_input(x: torch.Tensor, tp_mesh, layout: Placement) -> torch.Tensor:
    """A TP region's input made whole (all-gathered from ``Shard(1)``, or taken as replicated), as
    a plain tensor whose gradient arrives as partial sums: the backward reduce-scatters (or
    all-reduces) their total once."""
    dt = x if isinstance(x, DTensor) else DTensor.from_local(x, tp_mesh, (layout,), run_check=False)
    if dt.placements != (Replicate(),):
        dt = dt.redistribute(placements=(Replicate(),))
    return dt.to_local(grad_placements=(Partial(),))


def _inside_region(x: torch.Tensor, tp_mesh) -> DTensor:
    """A region's plain activation as the replicated DTensor a TP linear takes, its input gradient
    left a partial sum (no collective)."""
    return DTensor.from_local(
        x, tp_mesh, (Replicate(),), run_check=False, grad_placements=(Partial(),)
    )


class RegionInput(ParallelStyle):
    """Where a block's TP region starts: the module's first positional input goes through
    ``region_input`` (``layout`` is how it arrives: ``Shard(1)`` under sequence parallelism)."""

    def __init__(self, layout: Placement):
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def hook(_, args):
            return (region_input(args[0], device_mesh, self.layout), *args[1:])

        module.register_forward_pre_hook(hook)
        return module


class ReplicatedLinear(ParallelStyle):
    """A linear every TP rank applies whole inside a region (the linear models' low-rank
    bottlenecks): replicated weight, plain input and output. DTensor sees only replicated tensors,
    so it computes locally and moves nothing: the input's gradient stays a partial sum like the
    region's, and so does the weight's (marked with ``partial_gradients``)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module = distribute_module(
            module,
            device_mesh,
            input_fn=lambda _, args, mesh: (
                DTensor.from_local(args[0], mesh, (Replicate(),), run_check=False),
                *args[1:],
            ),
            output_fn=lambda _, out, mesh: out.to_local(),
        )
        partial_gradients(module, "weight", "bias")
        return module


def region_plan(block, halves: tuple[tuple[str, str, str], ...], enable_sp: bool) -> dict:
    """Where each half of a block starts its TP region, each half given as (Canon layer, norm,
    sublayer). Under sequence parallelism the norm runs on the sequence shard and the activations
    are gathered before the sublayer; where the Canon layer exists it takes the norm inside, so the
    block's stream is gathered before it instead, and its weights join the region. Either way the
    norm's weight (and the Canon layer's) gets partial gradients. Without sequence parallelism the
    region starts at the sublayer."""
    plan = {}
    for canon, norm, sublayer in halves:
        if not enable_sp:
            plan[sublayer] = RegionInput(Replicate())
            continue
        if getattr(block, canon) is not None:
            plan[canon] = RegionInput(Shard(1))
            partial_gradients(getattr(block, canon), "weight", "bias")
        else:
            plan[sublayer] = RegionInput(Shard(1))
        partial_gradients(getattr(block, norm), "weight")
    return plan


def _replicate_remaining(model: nn.Module, tp_mesh) -> None:
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                module.register_parameter(
                    name,
                    nn.Parameter(
                        distribute_tensor(param, tp_mesh, [Replicate()]),
                        requires_grad=param.requires_grad,
                    ),
                )


def channel_shard(conv: nn.Module, tp_mesh) -> None:
    """A depthwise Canon layer whose inputs are column-sharded applies this rank's rows of its
    weight (``ChannelShard``), whose gradient is then a partial sum."""
    conv.channel_shard = ChannelShard(tp_mesh.get_local_rank(), tp_mesh.size(), tp_mesh.get_group())
    partial_gradients(conv, "weight", "bias")


def feed_forward_plan(block, tp_mesh, residual) -> dict:
    """The SwiGLU: gate and up column-sharded, w2 row-sharded; Canon-D applies its channels'
    rows."""
    if block.feed_forward.canonD is not None:
        channel_shard(block.feed_forward.canonD, tp_mesh)
    return {
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual),
    }


def _tensorwise_float8(module: nn.Module) -> bool:
    """A torchao Float8Linear with dynamic tensorwise scaling of its input and output gradient."""
    config = getattr(module, "config", None)
    if not isinstance(module, Float8Linear) or config is None:
        return False
    casts = (config.cast_config_input, config.cast_config_grad_output)
    return all(
        c.scaling_type is ScalingType.DYNAMIC
        and c.scaling_granularity is ScalingGranularity.TENSORWISE
        for c in casts
    )


def float8_styles(module: nn.Module, plan: dict) -> dict:
    """``plan`` with torchao's float8 column/row-wise styles on the linears of ``module`` that
    float8 converted with tensorwise scaling, as TorchTitan's llama3 takes them: their output
    gradients are cast in the backward. Inside canon-titan's TP regions the collectives stay where
    the region puts them, before the linears cast and after their output, so what crosses the TP
    group is high precision either way (TorchTitan's llama3, whose linears gather their own input,
    sends a tensorwise input in float8). Row-wise recipes keep the plain styles (torchao's float8
    styles assume one scale per tensor), and so does everything that is not a linear: Canon layers,
    norms and embeddings stay in high precision. Either way each linear's matmul runs in float8."""
    styles = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
    out = {}
    for name, style in plan.items():
        target = styles.get(type(style))
        if target is not None and _tensorwise_float8(module.get_submodule(name)):
            style = target(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
        out[name] = style
    return out


def float8_collectives(tp_mesh) -> bool:
    """Whether the TP group can move float8 tensors: NCCL can; gloo (CPU) has no float8 dtype, so
    there the plain styles carry the high-precision activations and the matmuls still cast. A run
    that ``canon-titan plan`` traces for a GPU (``planned_machine``, on a fake process group) takes
    the GPU's styles, as that run would."""
    if tp_mesh.device_type == "cuda":
        return True
    planned = KernelEnvironment.current()
    return planned.planned and planned.cuda_capability is not None


def wrap_weights_for_float8_all_gather(model: nn.Module) -> int:
    """Wrap the weight of every float8 linear whose config asks for FSDP's float8 all-gather in
    torchao's float8-casting weight tensor, as torchao's ``Float8Linear.from_float`` does (the
    converter builds the linears from their config, which does not): before tensor parallelism and
    FSDP. Returns how many were wrapped."""
    wrapped = 0
    for module in model.modules():
        if not (isinstance(module, Float8Linear) and module.config.enable_fsdp_float8_all_gather):
            continue
        module.weight = nn.Parameter(
            WeightWithDynamicFloat8CastTensor(
                module.weight,
                module.linear_mm_config,
                module.config.cast_config_weight.target_dtype,
            ),
            requires_grad=module.weight.requires_grad,
        )
        module.register_state_dict_post_hook(_unwrapped_float8_weight)
        wrapped += 1
    return wrapped


def _unwrapped_float8_weight(module, state_dict, prefix, local_metadata) -> None:
    """The state dict holds the wrapped weight's own tensor (same storage, same sharding; FSDP2
    always shards it here, so it is a DTensor): a checkpoint stores a plain tensor (DCP cannot write
    the wrapper's storage), and loading one writes into the weight."""
    key = prefix + "weight"
    weight = state_dict.get(key)
    if isinstance(weight, DTensor) and isinstance(
        weight._local_tensor, WeightWithDynamicFloat8CastTensor
    ):
        state_dict[key] = DTensor.from_local(
            weight._local_tensor._tensor,
            weight.device_mesh,
            weight.placements,
            run_check=False,
            shape=weight.shape,
            stride=weight.stride(),
        )


def parallelize_plan(module: nn.Module, tp_mesh, plan: dict) -> None:
    """``parallelize_module``, with the float8 styles where the module's linears take them."""
    parallelize_module(
        module, tp_mesh, float8_styles(module, plan) if float8_collectives(tp_mesh) else plan
    )


def parallelize_block_plan(block: nn.Module, tp_mesh, plan: dict) -> None:
    """``parallelize_plan`` for a block whose plan includes its ``region_plan``: every
    column-parallel linear (all of them read region activations) takes its input as
    ``_inside_region`` does, before its own style (plain or float8) sees it."""
    parallelize_plan(block, tp_mesh, plan)
    for name, style in plan.items():
        if isinstance(style, ColwiseParallel):
            block.get_submodule(name).register_forward_pre_hook(
                lambda _, args: (
                    (_inside_region(args[0], tp_mesh), *args[1:])
                    if not isinstance(args[0], DTensor)
                    else args
                ),
                prepend=True,
            )


def apply_tp(model: nn.Module, tp_mesh, *, enable_sp: bool, parallelize_block: Callable) -> None:
    """Vocab-parallel embedding and output, ``parallelize_block(block, tp_mesh, enable_sp)`` on
    every block, and every other parameter replicated."""
    residual = Shard(1) if enable_sp else Replicate()
    root_plan = {
        "tok_embeddings": EmbeddingParallel(residual),
        "lm_head": ColwiseParallel(
            input_layouts=residual, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if enable_sp and getattr(model, "norm", None) is not None:
        partial_gradients(
            model.norm, "weight"
        )  # on each rank's sequence shard, before the output gathers it
    parallelize_plan(
        model, tp_mesh, {k: v for k, v in root_plan.items() if getattr(model, k, None) is not None}
    )
    for block in model.layers.values():
        parallelize_block(block, tp_mesh, enable_sp)
    _replicate_remaining(model, tp_mesh)
    float8 = (
        sum(_tensorwise_float8(m) for m in model.modules()) if float8_collectives(tp_mesh) else 0
    )
    logger.info(
        f"Applied tensor parallelism (degree {tp_mesh.size()}, sequence parallel {enable_sp})"
        + (
            f", float8 tensor-parallel styles on {float8} tensorwise float8 linears"
            if float8
            else ""
        )
    )


def apply_ac_compile_fsdp(
    model, *, parallel_dims, training, parallelism, compile_config, ac_config, dump_folder
):
    """What every model family applies after its own tensor parallelism: activation checkpointing,
    per-block compile and FSDP2/HSDP."""
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        # Every kernel backend is a torch custom op: TorchTitan's fullgraph per-block compile holds.
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    apply_fsdp_to_decoder(
        model,
        parallel_dims.get_mesh(names),
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=parallel_dims.pp_enabled,
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )


def parallelize_decoder(
    model,
    *,
    parallelize_block: Callable | None,
    parallel_dims,
    training,
    parallelism,
    compile_config,
    ac_config,
    dump_folder,
):
    """TorchTitan's ``parallelize_fn`` for a family whose blocks ``parallelize_block(block, tp_mesh,
    enable_sp)`` shards (None: a family without tensor parallelism, whose own function refuses it
    first). Every family goes through here, so each honours ``[float8]
    enable_fsdp_float8_all_gather``."""
    gathered = wrap_weights_for_float8_all_gather(model)
    if gathered:
        logger.info(f"float8: FSDP all-gathers the weights of {gathered} float8 linears in float8")
    if parallel_dims.tp_enabled:
        apply_tp(
            model,
            parallel_dims.get_mesh("tp"),
            enable_sp=parallelism.enable_sequence_parallel,
            parallelize_block=parallelize_block,
        )
    apply_ac_compile_fsdp(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config=ac_config,
        dump_folder=dump_folder,
    )
    return model
