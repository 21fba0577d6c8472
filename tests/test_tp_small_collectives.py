"""The small collectives tensor parallelism adds to a Canon block, besides its activations: the flat
QK-norm's statistics and the gradients of the Canon-B/D weights each rank applies to its own
channels. Counted on real gloo ranks by the collective log of ``tests/test_parallel_cost.py`` (a
dispatch mode that owes nothing to the model code), separately in the forward and the backward, and
held to a hand count from the model's shapes: per block and micro-batch, one all-reduce in the
forward (both statistics) and two in the backward (Canon-B's weight gradient with the statistics'
gradients, Canon-D's weight gradient). At e91de72 there were six: each statistic and each weight's
gradient on its own."""

import pytest
import torch

from test_parallel_cost import BATCH, SEQ, CollectiveLog, _block_plan, _model, run_ranks

pytestmark = pytest.mark.slow


def _phases(rank, world, name, sp):
    from torch.distributed.device_mesh import init_device_mesh

    from canon_titan.models.common.parallelize import apply_tp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = _model(name, {})
    apply_tp(model, mesh, enable_sp=sp, parallelize_block=_block_plan(name))
    tokens = torch.randint(0, 2048, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with CollectiveLog() as forward:
        loss = model(tokens).to_local().float().pow(2).mean()
    with CollectiveLog() as backward:
        loss.backward()
    return rank, forward.log, backward.log


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_a_canon_block_adds_one_small_collective_forward_and_two_backward(sp):
    model = _model("llama_canon", {})
    args = model.config.args
    layers, activation = args.n_layers, BATCH * SEQ * args.dim
    block = model.layers["0"]
    canon_b, canon_d = block.attention.canonB, block.feed_forward.canonD
    assert block.attention.q_norm is not None and canon_b is not None and canon_d is not None

    def numel(conv):
        return conv.weight.numel() + (conv.bias.numel() if conv.bias is not None else 0)

    statistics = 2 * BATCH * SEQ  # q's and k's sum of squares, one per token each
    for rank, forward, backward in run_ranks(2, _phases, "llama_canon", sp):
        small_forward = sorted(n for kind, n in forward if n != activation)
        small_backward = sorted(n for kind, n in backward if n != activation)
        assert all(kind == "all_reduce" for kind, n in forward + backward if n != activation), (forward, backward)
        assert small_forward == [statistics] * layers, (rank, small_forward)
        assert small_backward == sorted([numel(canon_b) + statistics] * layers + [numel(canon_d)] * layers), \
            (rank, small_backward)
