"""The Canon weight and bias gradients (the Triton kernels') are bitwise reproducible: across
processes and runs, whatever the forward kernels' autotuning picked, and on every tensor-parallel
rank after training steps under sequence parallelism, where Canon-A/C weights are replicated and
each rank computes their full gradient (the replicas must not drift apart).

On a GPU the processes autotune from their own timings (each with its own Triton cache); on the CPU
the kernels run in Triton's interpreter. Either way the backward blocks are what orders the weight
gradient's sums, and the first test also shows that other blocks change its bits: a choice by timing
would not be reproducible.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from canon_titan.kernels import canon
from canon_titan.kernels.backends import triton_runs_here
from conftest import REPO, free_port
from kernel_paths import DEVICE, kernel_path, randn

pytestmark = pytest.mark.skipif(not triton_runs_here(), reason="needs a GPU or TRITON_INTERPRET=1")


def weight_grads() -> dict[str, torch.Tensor]:
    """dw and db of canon_conv (SiLU, bias: the recomputing backward) and canon_swiglu (bias), over
    three weight-gradient chunks of 128 rows."""
    gen = torch.Generator().manual_seed(0)
    x, gate, up, dy = (randn(gen, 2, 300, 96) for _ in range(4))
    w, b, w2, b2 = randn(gen, 96, 4), randn(gen, 96), randn(gen, 192, 4), randn(gen, 192)
    grads = {}
    with kernel_path("canon_conv_backward", "canon_swiglu_backward"):
        for name, fn, params in (
            (
                "conv",
                lambda w, b: canon.canon_conv(x, w, b, activation=True, backend="triton"),
                (w, b),
            ),
            ("swiglu", lambda w, b: canon.canon_swiglu(gate, up, w, b, backend="triton"), (w2, b2)),
        ):
            leaves = [p.clone().requires_grad_() for p in params]
            dw, db = torch.autograd.grad(fn(*leaves), leaves, dy)
            grads[f"{name} dw"], grads[f"{name} db"] = dw.cpu(), db.cpu()
    return grads


def _other_blocks(monkeypatch):
    """Backward blocks that walk each chunk as another number of runs than the product's."""
    product = canon._backward_blocks

    def other(channels, rows, blocks):
        chosen = product(channels, rows, blocks)
        return {**chosen, "STREAMS": 2 if chosen["STREAMS"] == 1 else chosen["STREAMS"] // 2}

    monkeypatch.setattr(canon, "_backward_blocks", other)


def test_weight_gradients_are_bitwise_equal_across_processes_and_runs(tmp_path, monkeypatch):
    # Own Triton caches: nothing one process compiled (or, with CANON_TITAN_FULL_AUTOTUNE=1 on a
    # GPU, tuned) reaches the other.
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(tmp_path / f"grads{i}.pt")],
            cwd=REPO / "tests",
            env=dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / f"triton{i}")),
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]
    runs = [run for i in range(2) for run in torch.load(tmp_path / f"grads{i}.pt")]
    assert len(runs) == 4
    for run in runs[1:]:
        for name, grad in runs[0].items():
            assert torch.equal(run[name], grad), name
    _other_blocks(monkeypatch)
    other = weight_grads()
    # Same values to rounding; other bits.
    for name in ("conv dw", "swiglu dw"):
        torch.testing.assert_close(other[name], runs[0][name], rtol=1e-5, atol=1e-4)
        assert not torch.equal(other[name], runs[0][name]), name


# --- tensor parallelism with sequence parallelism ----------------------------------------------


def _tp_worker(rank: int, world: int, port: int, backend: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        queue.put((rank, _train_under_tp(rank, world)))
    except Exception as e:  # reported by the test instead of a silent wait
        queue.put((rank, repr(e)))
        raise
    finally:
        dist.destroy_process_group()


def _train_under_tp(rank: int, world: int) -> dict:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import model_registry
    from canon_titan.models.common.parallelize import apply_tp
    from canon_titan.models.common.tensor_parallel import sum_partial_gradients
    from canon_titan.models.llama.parallelize import parallelize_block

    device = torch.device("cuda", rank) if DEVICE.type == "cuda" else DEVICE
    torch.manual_seed(0)
    with device:
        model = model_registry.model_spec(
            "llama_canon", "debug", {"canon_backend": "triton", "n_layers": 1}
        ).model.build()
    model.init_states()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    apply_tp(model, mesh, enable_sp=True, parallelize_block=parallelize_block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(1)).to(device)
    with kernel_path("canon_conv", "canon_conv_backward", "canon_swiglu", "canon_swiglu_backward"):
        for _ in range(2):
            logits = model(tokens[:, :-1])
            logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            sum_partial_gradients(
                [model], mesh.get_group()
            )  # as the trainer does after the last backward
            optimizer.step()
            optimizer.zero_grad()
    return {
        name: p.to_local().detach().cpu().numpy()
        for name, p in model.named_parameters()
        if "canonA" in name or "canonC" in name
    }


@pytest.mark.slow
def test_replicated_canon_weights_stay_equal_on_every_tensor_parallel_rank():
    """Two AdamW steps of llama_canon (triton kernels) under TP=2 with sequence parallelism: the
    replicated Canon-A/C weights are bitwise equal on both ranks."""
    if DEVICE.type == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("tensor parallelism over GPUs needs two")
    world = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_tp_worker,
            args=(r, world, port, "nccl" if DEVICE.type == "cuda" else "gloo", queue),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    failed = {rank: r for rank, r in results.items() if isinstance(r, str)}
    assert not failed, failed
    assert sorted(results[0]) == sorted(results[1]) and len(results[0]) == 2
    for name, weight in results[0].items():
        assert (weight == results[1][name]).all(), name


if __name__ == "__main__":
    # One process of the first test: two runs, saved for the test to compare.
    torch.save([weight_grads(), weight_grads()], sys.argv[1])
