"""Context parallelism for llama and llama_canon: the sequence split over real processes (gloo)
against the unsharded model in one process, at the model level (logits and every gradient) and
in real trainings (``tests/test_parallelism.py``: losses and grad norms against a 1-process run)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from canon_titan.config import ConfigError, load
from conftest import CONFIGS, free_port

pytestmark = pytest.mark.slow


def _model(name: str, overrides: dict):
    import model_registry

    torch.manual_seed(0)
    model = model_registry.model_spec(name, "debug", {"max_seq_len": 64, **overrides}).model.build()
    model.init_states()
    return model


def _batch(document_masking: bool):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 2048, (2, 48), generator=g)
    positions = None
    if document_masking:  # documents of lengths 13 + 20 + 15 and 30 + 18
        positions = torch.cat(
            [
                torch.cat([torch.arange(n) for n in lengths])[None]
                for lengths in ((13, 20, 15), (30, 18))
            ]
        )
    probe = torch.randn(2, 48, 2048, generator=g)
    return tokens, positions, probe


def _worker(rank, world, port, name, overrides, balancer, document_masking, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put(_shard_and_run(rank, world, name, overrides, balancer, document_masking))
    except Exception as e:  # reported by the test instead of a silent wait
        queue.put((rank, repr(e)))
        raise
    finally:
        dist.destroy_process_group()


def _shard_and_run(rank, world, name, overrides, balancer, document_masking):
    from torch.distributed.device_mesh import init_device_mesh

    from canon_titan.models.common.context_parallel import context_parallel_inputs

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = _model(name, overrides)
    tokens, positions, probe = _batch(document_masking)
    inputs = {"input": tokens, **({"positions": positions} if positions is not None else {})}
    local, labels, extra = context_parallel_inputs(inputs, tokens.clone(), mesh, balancer)
    shards = extra["attention_masks"]
    assert torch.equal(labels, tokens[:, shards.index])
    logits = model(local, positions=extra["positions"], attention_masks=shards)
    (logits * probe[:, shards.index]).sum().backward()
    grads = {}
    for key, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)
        grads[key] = grad
    # numpy arrays travel by value (tensors would go through shared memory this process frees on
    # exit)
    return (
        rank,
        shards.index.numpy(),
        shards.runs,
        logits.detach().numpy(),
        {k: g.numpy() for k, g in grads.items()},
    )


CASES = [
    ("llama_canon", {}, "headtail", False),
    ("llama_canon", {}, "headtail", True),
    ("llama_canon", {"canon_kernel": 2, "canon_bias": True, "canon_activation": True}, None, False),
    # the Triton kernels reading each run's halo rows (in the interpreter on a CPU)
    ("llama_canon", {"canon_backend": "triton"}, "headtail", False),
    ("llama", {}, "headtail", True),
]


@pytest.mark.parametrize("name,overrides,balancer,document_masking", CASES)
def test_sharded_sequence_equals_the_whole_one(name, overrides, balancer, document_masking):
    """Logits of every token and every parameter gradient (summed over the CP ranks, as FSDP's
    reduce-scatter sums them) equal the unsharded model's: RoPE positions, causal and document
    masks by global position, and each Canon layer's halo from the rank before."""
    model = _model(name, overrides)
    tokens, positions, probe = _batch(document_masking)
    logits = model(tokens, positions)
    (logits * probe).sum().backward()
    expected = {key: p.grad for key, p in model.named_parameters()}

    world = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world, port, name, overrides, balancer, document_masking, queue),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in range(world)]
    failed = [r for r in results if len(r) == 2]
    assert not failed, failed
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    covered = torch.cat([torch.from_numpy(index) for _, index, _, _, _ in results])
    assert sorted(covered.tolist()) == list(range(48))
    assert sum(len(runs) for _, _, runs, _, _ in results) == (3 if balancer == "headtail" else 2)
    for _rank, index, _runs, local_logits, grads in results:
        index = torch.from_numpy(index)
        torch.testing.assert_close(
            torch.from_numpy(local_logits), logits.detach()[:, index], rtol=1e-5, atol=1e-5
        )
        for key, grad in grads.items():
            # fp32 sums in another order (per rank, then over ranks): within 1e-5 of each tensor's
            # scale
            torch.testing.assert_close(
                torch.from_numpy(grad),
                expected[key],
                rtol=1e-4,
                atol=1e-5 * expected[key].abs().max().item(),
                msg=lambda m: f"{key}: {m}",
            )


def test_rank_positions_are_pytorchs_head_tail_split():
    """Every rank's share of a sequence, computed locally, is the split of PyTorch's head-tail
    load balancer (which TorchTitan's cp_shard applies), or contiguous chunks without one."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _HeadTailLoadBalancer,
    )

    from canon_titan.models.common.context_parallel import rank_positions

    for seq_len, size in [(48, 2), (64, 4), (4096, 8)]:
        order = _HeadTailLoadBalancer(seq_len, size, "cpu")._generate_indices()[0].tolist()
        length = seq_len // size
        assert rank_positions(seq_len, size, "headtail") == [
            order[r * length : (r + 1) * length] for r in range(size)
        ]
        assert sum(rank_positions(seq_len, size, None), []) == list(range(seq_len))


@pytest.mark.parametrize(
    "name,overrides,key",
    [
        ("gla5", [], "has no context-parallel path"),
        (
            "llama_canon",
            ["--parallelism.pipeline_parallel_degree", "2"],
            "not with pipeline parallelism",
        ),
        (
            "llama_canon",
            ["--parallelism.context_parallel_load_balancer", "ptrr"],
            "must be 'headtail', got 'ptrr'",
        ),
        ("llama_canon", ["--training.seq_len", "8"], "at least canon_kernel - 1 = 3 tokens"),
    ],
)
def test_what_context_parallelism_refuses(name, overrides, key, monkeypatch):
    from conftest import REPO

    monkeypatch.setenv("WORLD_SIZE", "4")
    config = CONFIGS.get(name, REPO / "train_configs" / f"{name}_debug.toml")
    with pytest.raises(ConfigError) as e:
        load(config, ["--parallelism.context_parallel_degree", "2", *overrides], environment=False)
    assert key in e.value.message
