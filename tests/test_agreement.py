"""How the ranks agree (``canon_titan/tools/collectives.py``), on real gloo ranks: one store
barrier, which a waiting rank asks once however long it waits; kernel tuning done by rank 0, whose
choice every rank then runs; and one helper of each kind in the package."""

import ast
import os
import time

import pytest
import torch
import torch.multiprocessing as mp
import triton
import triton.language as tl

from conftest import REPO, free_port


class CountingStore:
    """A store that counts the requests made to it (the calls that reach the TCPStore's server)."""

    def __init__(self, store):
        self.store, self.requests = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.requests += 1
            return method(*args, **kwargs)

        return counted


def _init(rank, world, port):
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    return dist


def _wait_for_the_last(rank, port, queue):
    dist = _init(rank, 3, port)
    from canon_titan.kernels import tuning

    counting = CountingStore(dist.distributed_c10d._get_default_store())
    dist.distributed_c10d._get_default_store = lambda: counting
    try:
        if rank == 2:
            time.sleep(4)  # a rank tuning longer than the others
        tuning.wait_for_every_rank("a test shape")
        queue.put((rank, time.time(), counting.requests))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_rank_waiting_at_the_barrier_asks_the_store_once():
    """Three ranks, the last 4 s late: every rank leaves the barrier after the last arrived, and a
    waiting rank made two requests in all (its arrival and one wait). At 381a133 it asked once a
    second while it waited (``store.add`` per poll: 1,000 requests a second at 1,000 ranks)."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_wait_for_the_last, args=(r, port, queue)) for r in range(3)]
    for p in procs:
        p.start()
    left = {
        rank: (when, requests) for rank, when, requests in (queue.get(timeout=300) for _ in procs)
    }
    for p in procs:
        p.join(timeout=60)
    assert min(left[r][0] for r in (0, 1)) >= left[2][0] - 1.0, left
    assert [left[r][1] for r in (0, 1)] == [2, 2], left


@triton.autotune(
    configs=[
        triton.Config({"BLOCK": 8}),
        triton.Config({"BLOCK": 16}),
        triton.Config({"BLOCK": 32}),
    ],
    key=["n"],
)
@triton.jit
def _doubled(x, y, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offsets, 2 * tl.load(x + offsets, mask=offsets < n), mask=offsets < n)


def _tune_on_two_ranks(rank, port, queue):
    dist = _init(rank, 2, port)
    from triton.runtime.autotuner import Autotuner

    from canon_titan.kernels import tuning

    timed = []

    def bench(self, *args, config, **meta):
        # Each rank's timing prefers another configuration: rank 0 the first, rank 1 the last.
        timed.append(config.kwargs["BLOCK"])
        order = [8, 16, 32] if rank == 0 else [32, 16, 8]
        return [float(order.index(config.kwargs["BLOCK"]))] * 3

    Autotuner._bench = bench
    tuner = tuning.autotuner_of(_doubled)
    x = torch.arange(100, dtype=torch.float32)
    y = torch.empty_like(x)

    def run():
        _doubled[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](x, y, 100)

    try:
        tuning.tuned_on_rank_zero(run, "a test kernel", tuners=[tuner])
        queue.put(
            (
                rank,
                {key: str(config) for key, config in tuner.cache.items()},
                timed,
                torch.equal(y, 2 * x),
            )
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_ranks_run_the_configuration_rank_0_tuned():
    """Two ranks whose own timings would pick different configurations of an autotuned kernel
    (Triton's interpreter, the timings stood in for): rank 0 times them, rank 1 times none, and both
    end with rank 0's choice for the kernel's tuning key; the kernel computes the same. At 381a133
    each rank tuned alone and kept its own pick."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_tune_on_two_ranks, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {rank: rest for rank, *rest in (queue.get(timeout=300) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    (chosen0, timed0, right0), (chosen1, timed1, right1) = results[0], results[1]
    assert sorted(timed0) == [8, 16, 32] and timed1 == []
    assert chosen0 == chosen1 and len(chosen0) == 1
    assert "BLOCK: 8" in next(iter(chosen0.values()))
    assert right0 and right1


def _calls_of(name: str, args: int | None = None) -> list[str]:
    """The files of canon_titan/ that call ``name`` (a function or a method of that name), with
    ``args`` positional arguments when given."""
    found = []
    for path in sorted((REPO / "canon_titan").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called == name and args in (None, len(node.args)):
                    found.append(str(path.relative_to(REPO)))
                    break
    return found


def test_the_store_is_waited_on_in_one_module():
    """``store.wait(keys, timeout)`` (two arguments: a process's or an event's wait takes at most
    one) in the one module of the store barrier and the rank-0 decision."""
    assert _calls_of("wait", args=2) == ["canon_titan/tools/collectives.py"]


@pytest.mark.parametrize(
    "name", ["broadcast_object_list", "gather_object", "all_gather_object", "scatter_object_list"]
)
def test_no_component_moves_python_objects_with_a_collective(name):
    """Rank 0's decisions and the ranks' small results go through the store (one helper each); a
    pickled collective pads every rank's object to the largest, and needs a group of every rank."""
    assert _calls_of(name) == [], _calls_of(name)
