"""The CPU/torch-2.13 shims: applied only where the feature is missing."""

import inspect

import pytest
import torch
import torch.distributed as dist

from canon_titan.tools import runtime


def test_shims_match_this_machine():
    applied = runtime.apply()
    import torchtitan.components.metrics as metrics
    import torchtitan.tools.utils as tt_utils

    no_accelerator = torch._utils._get_available_device_type() is None
    assert ("cpu-device" in applied) == no_accelerator
    if no_accelerator:
        # Names bound at import time in other torchtitan modules were rebound too.
        assert tt_utils.device_type == metrics.device_type == "cpu"
        assert metrics.device_module.get_device_name() == "cpu"
    assert hasattr(dist, "set_timeout")
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        assert "arg_mbs" in inspect.signature(cls.step).parameters or getattr(
            cls.step, "_canon_titan_shim", False
        )
    assert runtime.apply() == applied  # idempotent


def _end_barrier_worker(rank: int, world: int, init: str, queue) -> None:
    import time

    runtime.apply()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        if rank == 1:
            time.sleep(1.5)  # the slow rank ends its loop late
        started = time.perf_counter()
        runtime.end_barrier()
        queue.put((rank, time.perf_counter() - started))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_leave_training_together_without_torchtitans_sleep(tmp_path):
    """TorchTitan ends its training loop with rank 0 sleeping 2 seconds for the other ranks. Under
    the ``end-barrier`` shim that sleep returns at once (the module's ``time`` is otherwise
    untouched), and each rank instead waits at ``end_barrier`` for the slowest: two gloo processes,
    rank 1 arriving 1.5 s late, rank 0 waits for it."""
    import time

    import torch.multiprocessing as mp
    import torchtitan.trainer as tt_trainer

    assert "end-barrier" in runtime.apply()
    started = time.perf_counter()
    tt_trainer.time.sleep(2)
    assert time.perf_counter() - started < 0.5
    assert tt_trainer.time.perf_counter is time.perf_counter

    context = mp.get_context("spawn")
    queue = context.Queue()
    init = f"file://{tmp_path / 'store'}"
    mp.start_processes(
        _end_barrier_worker, args=(2, init, queue), nprocs=2, join=True, start_method="spawn"
    )
    waited = dict(queue.get(timeout=5) for _ in range(2))
    assert waited[0] >= 1.0 and waited[1] < 1.0


def _foreach_on_dtensors(count: int, strided: bool, rows: int):
    """A foreach op over ``count`` pairs of DTensors on a one-rank mesh; the placements of its
    outputs. A shape not used before (``rows``) makes DTensor propagate its sharding afresh."""
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (1,))
    placement = _StridedShard(0, split_factor=2) if strided else Shard(0)
    tensors = [
        DTensor.from_local(torch.full((rows, 3), float(i)), mesh, [placement]) for i in range(count)
    ]
    out = torch._foreach_add(tensors, tensors)
    assert all(torch.equal(o.to_local(), 2 * t.to_local()) for o, t in zip(out, tensors))
    return [
        (o.placements, o._spec.use_strided_shard_as_shard_order, o._spec.shard_order) for o in out
    ]


def test_the_strided_shard_scan_runs_once_per_op_not_once_per_tensor(monkeypatch, tmp_path):
    """DTensor's propagation of a foreach op calls torch's ``_propagate_use_strided_shard_flag``
    once per tensor, and each call scans every argument: quadratic. With the shim an op whose
    arguments hold no ``_StridedShard`` never reaches torch's function (which would return at
    once); one that does reaches it for every tensor as before, with one argument to scan instead
    of all 48; and the outputs' placements and strided-shard flags are the same as without it."""
    from torch.distributed.tensor import _sharding_prop as sharding_prop

    from canon_titan.plan.strided_scan import strided_shard_scan_once_per_op

    strided_shard_scan_once_per_op()

    shim = sharding_prop._propagate_use_strided_shard_flag
    assert getattr(shim, "_canon_titan_shim", False)
    torch_function = shim.original
    calls = []

    def counted(op_strategy, op_schema):
        calls.append(len(op_schema.args_spec))
        return torch_function(op_strategy, op_schema)

    started = not dist.is_initialized()
    if started:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
        )
    try:
        placements, counts = {}, {}
        for shimmed in (True, False):
            if shimmed:
                monkeypatch.setattr(shim, "original", counted)
            else:
                monkeypatch.setattr(sharding_prop, "_propagate_use_strided_shard_flag", counted)
            for strided in (False, True):
                calls.clear()
                placements[shimmed, strided] = _foreach_on_dtensors(
                    24, strided, rows=4 + 2 * len(counts)
                )
                counts[shimmed, strided] = list(calls)
    finally:
        if started:
            dist.destroy_process_group()
    assert counts == {
        (False, False): [48] * 24,
        (False, True): [48] * 24,
        (True, False): [],
        (True, True): [1] * 24,
    }
    for strided in (False, True):
        assert placements[True, strided] == placements[False, strided]


def test_imports_run_without_the_garbage_collector_which_is_then_as_before():
    import gc

    from canon_titan.tools.startup import importing

    for before in (True, False):
        (gc.enable if before else gc.disable)()
        with importing():
            assert not gc.isenabled()
        assert gc.isenabled() is before
        with pytest.raises(ImportError), importing():
            import canon_titan.no_such_module  # noqa: F401
        assert gc.isenabled() is before
    gc.enable()


def test_importing_canon_titan_changes_nothing_process_wide_and_its_programs_do(tmp_path):
    """A process that imports the package (the trainer, the planner, the CLI's module) as a library
    keeps its collector and its loggers as they were; a canon-titan program (``canon-titan``, here
    its ``main``) freezes the collector's objects at exit (the last exit handler to run, registered
    first, sees them frozen) and drops the known library notes."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    probe = (
        "import atexit, gc, logging\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))\n"
        "import canon_titan.cli, canon_titan.trainer, canon_titan.plan.planner\n"
        "{program}"
        "print('filters:', len(logging.getLogger('torchao').filters))\n"
    )
    counts = {}
    for name, program in (("library", ""), ("program", "canon_titan.cli.main(['--help'])\n")):
        out = subprocess.run(
            [sys.executable, "-c", probe.format(program=program)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        ).stdout
        counts[name] = (
            int(out.split("filters:")[1].split()[0]),
            int(out.split("frozen at exit:")[1].split()[0]),
        )
    assert counts["library"] == (0, 0), counts
    assert counts["program"][0] == 1 and counts["program"][1] > 1000, counts
