"""The small collectives tensor parallelism adds to a Canon block, besides its activations: the flat
QK-norm's statistics, and the gradients of the replicated weights each rank applies to its own share
(Canon-B/D rows for its channels; under sequence parallelism Canon-A/C and the norms, on the whole
sequence inside the region or on the rank's shard of it). Counted on real gloo ranks by the
collective log of ``tests/test_parallel_cost.py`` (a dispatch mode that owes nothing to the model
code), separately in the forward, the backward and the step's sum of partial gradients, and held to
a hand count from the model's shapes: per block and micro-batch, one all-reduce in the forward (both
statistics) and one in the backward (their gradients); per step, one all-reduce of every replicated
weight's gradient. At e91de72 there were six per block: each statistic and each weight's gradient on
its own; at d1a0ebf three in the backward (Canon-B's weight gradient with the statistics' gradients,
Canon-D's), and under FSDP one more per Canon-A/C weight and norm (``tests/test_host_work.py``
counts the trainer's step with FSDP)."""

import pytest
import torch

from test_parallel_cost import BATCH, SEQ, CollectiveLog, _block_plan, _model, run_ranks

pytestmark = pytest.mark.slow


def _phases(rank, world, name, sp):
    from torch.distributed.device_mesh import init_device_mesh

    from canon_titan.models.common.parallelize import apply_tp
    from canon_titan.models.common.tensor_parallel import sum_partial_gradients

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = _model(name, {})
    apply_tp(model, mesh, enable_sp=sp, parallelize_block=_block_plan(name))
    tokens = torch.randint(0, 2048, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with CollectiveLog() as forward:
        loss = model(tokens).to_local().float().pow(2).mean()
    with CollectiveLog() as backward:
        loss.backward()
    with CollectiveLog() as step:
        sum_partial_gradients([model], mesh.get_group())
    return rank, forward.log, backward.log, step.log


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_a_canon_block_adds_one_small_collective_each_way_and_the_step_one(sp):
    model = _model("llama_canon", {})
    args = model.config.args
    layers, activation = args.n_layers, BATCH * SEQ * args.dim
    block = model.layers["0"]
    assert block.attention.q_norm is not None and all(
        c is not None
        for c in (block.canonA, block.attention.canonB, block.canonC, block.feed_forward.canonD)
    )

    def numel(*modules):
        return sum(p.numel() for m in modules for p in m.parameters(recurse=False))

    statistics = 2 * BATCH * SEQ  # q's and k's sum of squares, one per token each
    # Canon-B/D apply their own channels' rows; under sequence parallelism Canon-A/C (inside the
    # region, on the whole sequence) and the block's and the final norm (the fused one, or on the
    # rank's shard of the sequence) too.
    per_block = numel(block.attention.canonB, block.feed_forward.canonD)
    if sp:
        per_block += numel(block.canonA, block.canonC, block.attention_norm, block.ffn_norm)
    replicated = layers * per_block + (numel(model.norm) if sp else 0)
    for rank, forward, backward, step in run_ranks(2, _phases, "llama_canon", sp):
        small_forward = sorted(n for kind, n in forward if n != activation)
        small_backward = sorted(n for kind, n in backward if n != activation)
        assert all(kind == "all_reduce" for kind, n in forward + backward if n != activation), (
            forward,
            backward,
        )
        assert small_forward == [statistics] * layers, (rank, small_forward)
        assert small_backward == [statistics] * layers, (rank, small_backward)
        assert step == [("all_reduce", replicated)], (rank, step)
