"""What tensor and context parallelism cost, counted on real gloo processes with instruments the
planner does not use: a dispatch mode of this file that logs every collective the step issues
(kind and bytes), and PyTorch's ``FlopCounterMode`` with the score entries each attention call
keeps. The counts are held to a hand count of TorchTitan's scheme; that the results stay exact is
``tests/test_parallelism.py``'s and ``tests/test_context_parallel.py``'s (losses and gradients
against one process).

Tensor parallelism, per step of ``L`` blocks, activations of ``A = batch x seq x dim`` elements:
- with sequence parallelism, each half of a block all-gathers its input and reduce-scatters its
  output in the forward, and the reverse in the backward: 4 L all-gathers and 4 L reduce-scatters
  of A, plus one each for the embedding and the output head, and no all-reduce of A at all (each
  region's input gradient is reduced once, by the reduce-scatter of its gather);
- without it, one all-reduce of A per half in the forward (the row-parallel outputs) and one per
  half in the backward (the region's input), plus the embedding's and the output head's input.
The small ones (QK-norm statistics, Canon-B/D weight rows) are counted apart.
"""

import functools
import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import free_port

pytestmark = pytest.mark.slow

BATCH, SEQ = 2, 32

_KINDS = {
    "all_gather": "all_gather",
    "allgather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce",
    "allreduce": "all_reduce",
}


class CollectiveLog(TorchDispatchMode):
    """Every collective dispatched: (kind, elements moved per rank: an all-gather's output, a
    reduce-scatter's input, an all-reduce's tensor)."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1].strip("_")
        kind = next((k for prefix, k in _KINDS.items() if name.startswith(prefix)), None)
        if kind is not None:
            moved = out if kind == "all_gather" else args[0]
            moved = moved[0] if isinstance(moved, (list, tuple)) else moved
            if isinstance(moved, (list, tuple)):
                moved = moved[0]
            self.log.append((kind, moved.numel()))
        return out


def _model(name, overrides):
    import model_registry

    torch.manual_seed(0)
    if name.startswith("llama"):
        overrides = {"max_seq_len": 64, **overrides}
    model = model_registry.model_spec(name, "debug", overrides).model.build()
    model.init_states()
    return model


def _block_plan(name):
    if name in ("llama", "llama_canon"):
        from canon_titan.models.llama.parallelize import parallelize_block

        return parallelize_block
    from canon_titan.models.common import linear_parallelize
    from canon_titan.models.gdn2.parallelize import LAYOUT as GDN2
    from canon_titan.models.gla5.parallelize import LAYOUT as GLA5

    return functools.partial(
        linear_parallelize.parallelize_block, layout={"gla5": GLA5, "gdn2": GDN2}[name]
    )


def _tp_step(rank, world, name, overrides, sp):
    from torch.distributed.device_mesh import init_device_mesh

    from canon_titan.models.common.parallelize import apply_tp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = _model(name, overrides)
    apply_tp(model, mesh, enable_sp=sp, parallelize_block=_block_plan(name))
    tokens = torch.randint(0, 2048, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with CollectiveLog() as comms:
        logits = model(tokens)
        logits.to_local().float().pow(2).mean().backward()
    return rank, comms.log


def _worker(rank, world, port, target, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put(target(rank, world, *args))
    except Exception as e:  # reported by the test instead of a silent wait
        queue.put((rank, repr(e)))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world, target, *args):
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, target, args, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in range(world)]
    assert not [r for r in results if isinstance(r[1], str)], (
        results
    )  # (rank, the error) from a failed worker
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return sorted(results, key=lambda r: r[0])


@pytest.mark.parametrize(
    "name, overrides, world, sp",
    [
        ("llama_canon", {}, 2, True),
        ("llama_canon", {}, 2, False),
        ("llama", {"n_kv_heads": 4}, 4, True),
        ("gla5", {}, 2, True),
        ("gdn2", {}, 4, False),
    ],
    ids=["llama_canon-tp2-sp", "llama_canon-tp2", "llama-tp4-sp", "gla5-tp2-sp", "gdn2-tp4"],
)
def test_tensor_parallel_moves_each_activation_once(name, overrides, world, sp):
    model = _model(name, overrides)
    layers, dim = model.config.args.n_layers, model.config.args.dim
    activation = BATCH * SEQ * dim
    # Besides activations, only a parameter's gradient (Canon-B/D rows) or per-token statistics (the
    # flat QK-norm's sums of squares, q's and k's in one all-reduce, which carries Canon-B's weight
    # gradient in the backward: tests/test_tp_small_collectives.py) cross the TP group.
    statistics = {BATCH * SEQ, 2 * BATCH * SEQ}
    small_sizes = (
        {p.numel() for p in model.parameters()}
        | statistics
        | {p.numel() + n for p in model.parameters() for n in statistics}
    )
    for rank, log in run_ranks(world, _tp_step, name, overrides, sp):
        big = Counter(kind for kind, n in log if n == activation)
        if sp:
            assert big == {"all_gather": 4 * layers + 2, "reduce_scatter": 4 * layers + 2}, (
                rank,
                big,
            )
        else:
            assert big == {"all_reduce": 4 * layers + 2}, (rank, big)
        others = [(kind, n) for kind, n in log if n != activation]
        assert all(kind == "all_reduce" and n in small_sizes for kind, n in others), (rank, others)


class AttentionCalls(torch.overrides.TorchFunctionMode):
    """Every ``scaled_dot_product_attention`` call: (queries, keys, the score entries it keeps,
    whether it was handed a mask tensor)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            from torch.nn.attention.bias import CausalBias

            q, k = args[0], args[1]
            n, m = q.shape[-2], k.shape[-2]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if isinstance(mask, CausalBias):  # what it keeps, materialized here by hand
                kept = int(torch.ones(n, m, dtype=torch.bool).tril(m - n).sum())
            elif kwargs.get("is_causal"):
                kept = n * (n + 1) // 2
            else:
                kept = n * m
            self.calls.append(
                (n, m, kept, isinstance(mask, torch.Tensor) and not isinstance(mask, CausalBias))
            )
        return func(*args, **kwargs)


def _cp_step(rank, world, seq_len):
    from torch.distributed.device_mesh import init_device_mesh

    from canon_titan.models.common.context_parallel import context_parallel_inputs

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = _model("llama_canon", {"max_seq_len": seq_len})
    tokens = torch.randint(0, 2048, (1, seq_len), generator=torch.Generator().manual_seed(1))
    local, _, extra = context_parallel_inputs({"input": tokens}, tokens.clone(), mesh, "headtail")
    with AttentionCalls() as calls:
        model(
            local, positions=extra["positions"], attention_masks=extra["attention_masks"]
        ).float().mean().backward()
    return rank, calls.calls, extra["attention_masks"].runs


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_computes_the_causal_share(world):
    """Each CP rank's attention keeps only the causal scores of its queries (a run of n queries
    from global position g: n g + n (n + 1) / 2), no mask tensor is built, and with the head-tail
    split the ranks do the same work: at 8k tokens half of what a rank did against the whole
    gathered sequence (its L queries x every key)."""
    seq_len = 8192
    layers = _model("llama_canon", {}).config.args.n_layers
    results = run_ranks(world, _cp_step, seq_len)
    shares = []
    for _rank, calls, runs in results:
        assert len(calls) == layers * len(runs)
        assert not any(explicit for *_, explicit in calls), (
            "an explicit mask was built for a causal run"
        )
        expected = sum(n * g + n * (n + 1) // 2 for _, g, n in runs)
        assert sum(kept for _, _, kept, _ in calls) == layers * expected
        local = seq_len // world
        shares.append(
            expected / (local * seq_len)
        )  # against the score matrix of the gathered design
    total = sum(n * g + n * (n + 1) // 2 for _, _, runs in results for _, g, n in runs)
    assert (
        total == seq_len * (seq_len + 1) // 2
    )  # the ranks' runs together: the whole causal matrix once
    for (
        share
    ) in shares:  # every rank the same: the causal matrix's S (S + 1) / 2 over cp ranks' L x S each
        assert share == pytest.approx(0.5 + 1 / (2 * seq_len))


def test_the_plan_counts_a_lower_right_causal_attention_by_its_share():
    """The planner's recorder sees PyTorch's CPU fallback of ``causal_lower_right`` (a mask
    materialized from ``tril``) as the GPU kernels run it: the causal share of the scores (held
    to the kept entries of that mask, counted here), and no mask in memory."""
    from torch.nn.attention.bias import causal_lower_right

    from canon_titan.plan.recorder import StepRecorder, causal_share

    queries, keys = 64, 200
    q = torch.randn(1, 2, queries, 16, requires_grad=True)
    k, v = (
        torch.randn(1, 2, keys, 16, requires_grad=True),
        torch.randn(1, 2, keys, 16, requires_grad=True),
    )
    bias = causal_lower_right(queries, keys)
    with StepRecorder() as recorder:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias).sum().backward()
    kept = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries).float().mean().item()
    attention = [op for op in recorder.trace.ops if op.kind == "attention"]
    assert len(attention) == 2  # forward and backward
    assert all(op.attended == pytest.approx(kept) for op in attention)
    assert causal_share(queries, queries) == pytest.approx((queries + 1) / (2 * queries))
    mask_bytes = {queries * keys, queries * keys * 4}  # the bool mask and its float bias
    assert not [e for e in recorder.trace.memory_events if abs(e[2]) in mask_bytes]


def test_the_cp_causal_bias_holds_no_storage_and_attends_as_torchs():
    """``causal_lower_right`` allocates unused host memory of at least an fp32 [queries, keys] (at
    262,144 tokens on CP 8: 32 GiB, which failed a plan here and asks any host for that much); the
    CP shards' bias holds none and gives SDPA's output and gradients exactly."""
    from torch.nn.attention.bias import causal_lower_right

    from canon_titan.models.common.context_parallel import lower_right_causal_bias

    queries, keys = 48, 160
    assert causal_lower_right(queries, keys).untyped_storage().nbytes() >= 4 * queries * keys
    bias = lower_right_causal_bias(queries, keys)
    assert bias.untyped_storage().nbytes() == 0
    results = []
    for mask in (causal_lower_right(queries, keys), bias):
        torch.manual_seed(0)
        q = torch.randn(1, 2, queries, 16, requires_grad=True)
        k, v = (
            torch.randn(1, 2, keys, 16, requires_grad=True),
            torch.randn(1, 2, keys, 16, requires_grad=True),
        )
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.square().sum().backward()
        results.append((out, q.grad, k.grad, v.grad))
    for expected, got in zip(*results):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_plan_of_tp_moves_activations_by_gather_and_reduce_scatter():
    """The issue's plan (``llama_debug`` at TP 2 with sequence parallelism): the TP all-reduces
    (QK-norm statistics, replicated weights' gradients) are under a quarter of the all-gathers'
    bytes; at 4a7b0a2 the five all-reduces of every block's activations made them larger."""
    from conftest import CONFIGS
    from test_plan import plan_step

    step = plan_step(
        CONFIGS["llama"],
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--compile.enable",
            "false",
        ],
        2,
    )
    tp = Counter()
    for c in step.trace.collectives:
        if step.group_names.get(tuple(sorted(c.group))) == "tp":
            tp[c.kind] += c.bytes
    assert tp["reduce_scatter"] == tp["all_gather"] > 0
    assert tp["all_reduce"] < tp["all_gather"] / 4, tp
