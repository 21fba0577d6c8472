"""What the host does in a training step and as training starts, on real gloo ranks:

- no step that is not logged makes the host wait for the device, in every family, with FSDP and with
  tensor, pipeline and context parallelism where the family has them. Counted by
  ``scripts/benchmarks/host_syncs.py`` (a dispatch mode that follows where each tensor would live on
  a GPU and counts the reads, value-sized ops and blocking copies that would wait for it) on the
  steps between the first and the last, which are logged. At d1a0ebf every step waited once: the
  divergence guard read the step's reduced loss with ``tolist()`` before the optimizer step; until
  2026-11-29 TorchTitan's train step still copied each batch and the token count to the device with
  ``.to(device)`` (and a pipeline stage without the loss made its placeholder with
  ``torch.tensor(..., device=)``), each a wait on a GPU. With ``[validation]`` on, a validation
  after step 2 waits once, where it reads its loss, and step 3 not at all (through torch's pipeline
  ``eval``, which sets the schedule up again, it waited 4 times and step 3 8 times);
- context parallelism builds its ``ContextShards`` (every position's place, in Python) on the first
  step only, with and without document masking (whose documents change with every batch). At d1a0ebf
  every step built them;
- under tensor parallelism, with FSDP applied as training applies it, a block's backward makes no
  all-reduce but those of the QK-norm's statistics: the replicated weights' partial gradients are
  summed once per step, in one all-reduce. At d1a0ebf LlamaCanon's block made 5 more (Canon-B/D's
  weight gradients, and FSDP's reduction of each ``Partial`` gradient of Canon-A/C and the norms),
  GLA5's 11;
- a resume reads the checkpoint folder on rank 0 only (the other ranks take its verdict). At d1a0ebf
  every rank read every step folder's metadata and ran the resume checks again.
The ranks build one trainer after another in the same processes."""

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import REPO, free_port

sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
from host_syncs import HostSyncs  # noqa: E402

pytestmark = pytest.mark.slow

PARALLEL = {
    # Two gradient-accumulation groups (global batch 8 = 2 x 2 ranks x 2).
    "fsdp": ["--training.global_batch_size", "8"],
    "tp": [
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.enable_sequence_parallel",
        "true",
    ],
    "pp": [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
    ],
    "cp": ["--parallelism.context_parallel_degree", "2"],
    "cp documents": [
        "--parallelism.context_parallel_degree",
        "2",
        "--dataloader.document_masking",
        "true",
    ],
    "pp documents": [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
        "--dataloader.document_masking",
        "true",
    ],
}
VALIDATION = ["--validation.enable", "--validation.every", "2", "--validation.steps", "2"]
PARALLEL.update({f"{name} validation": [*PARALLEL[name], *VALIDATION] for name in ("fsdp", "pp")})
CASES = [
    ("llama", "fsdp"),
    ("llama", "tp"),
    ("llama", "pp"),
    ("llama", "cp"),
    ("llama_canon", "fsdp"),
    ("llama_canon", "tp"),
    ("llama_canon", "pp"),
    ("llama_canon", "cp documents"),
    ("gla5", "fsdp"),
    ("gla5", "tp"),
    ("gla5", "pp"),
    ("gla5", "pp documents"),
    ("gdn2", "fsdp"),
    ("gdn2", "tp"),
    ("gdn2", "pp"),
    ("mamba2", "fsdp"),
    ("mamba2", "pp"),
    ("llama", "fsdp validation"),
    ("llama_canon", "pp validation"),
]
STEPS = 4
COUNTED = (2, 3)  # step 1 and the last step are logged
LAYERS = 4  # every family's debug flavor
STATISTICS = {"llama": 2, "llama_canon": 1, "gla5": 0, "gdn2": 0}
"""All-reduces a block's backward makes under tensor parallelism: the gradients of the flat
QK-norm's statistics (Llama's q and k norms each; LlamaCanon's Canon-B takes both in one). Nothing
else: the replicated weights' partial gradients are summed once per step, after the backward."""


class AllReduces(TorchDispatchMode):
    """Every all-reduce dispatched: (whether autograd's backward issued it, elements)."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple[bool, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(
            type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        ):
            return NotImplemented  # a DTensor: its collectives on local tensors come back here
        if func._schema.name.split("::")[-1].strip("_").startswith(("all_reduce", "allreduce")):
            moved = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            self.log.append((torch._C._current_graph_task_id() != -1, moved.numel()))
        return func(*args, **(kwargs or {}))


def host_batches(counter: HostSyncs, batches):
    """``batches`` as a loader yields them: read outside the counter, on the host."""
    iterator = iter(batches)
    while True:
        with counter.paused():
            batch = next(iterator, None)
        if batch is None:
            return
        counter.mark_host(batch)
        yield batch


def counted(
    trainer, steps: tuple[int, ...], builds: list[int]
) -> dict[int, tuple[list[str], list]]:
    """Run ``trainer``'s steps ``steps`` under ``HostSyncs`` and ``AllReduces``, the batches from
    its data loader on the host (as TorchTitan's loader yields them); returns each counted step's
    waits and all-reduces, and a validation's waits under ``("validation", step)``, its held-out
    batches on the host too. ``builds`` gets the step of every ``ContextShards`` built, whichever
    step it is."""
    from canon_titan.models.common.context_parallel import ContextShards

    logs = {}
    train_step = trainer.train_step
    counter = (
        HostSyncs()
    )  # one for all the steps: a step may read what an earlier one put on the host
    build = ContextShards.build.__func__

    def build_counted(cls, *args, **kwargs):
        builds.append(trainer.step)
        return build(cls, *args, **kwargs)

    ContextShards.build = classmethod(build_counted)

    def train_step_counted(data_iterator):
        if trainer.step not in steps:
            return train_step(data_iterator)
        with AllReduces() as collectives:
            waits = counter.step(train_step, data_iterator)
        logs[trainer.step] = waits, collectives.log

    trainer.train_step = train_step_counted
    if trainer.config.validator.enable:
        validator = trainer.validator
        validate, held_out = validator.validate, validator.batches

        def validate_counted(model_parts, step):
            if step not in steps:
                return validate(model_parts, step)
            validator.batches = host_batches(counter, held_out)
            seen = len(counter.waits)
            try:
                with counter:
                    validate(model_parts, step)
            finally:
                validator.batches = held_out
            logs[("validation", step)] = counter.waits[seen:], []

        validator.validate = validate_counted
    return logs


def _rank(rank, world, port, dump, cases, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    import torch.distributed as dist

    from canon_titan.config import load
    from canon_titan.config.build import build_trainer_config
    from canon_titan.models.common.context_parallel import ContextShards, shard_layout
    from canon_titan.tools import runtime
    from canon_titan.trainer import CanonTrainer

    CanonTrainer.takes_stop_signals = False  # one process builds many trainers
    runtime.apply()
    results, build = {}, ContextShards.build
    try:
        for family, parallel in cases:
            run = load(
                REPO / "train_configs" / f"{family}_debug.toml",
                [
                    "--training.seq_len",
                    "64",
                    "--training.local_batch_size",
                    "2",
                    "--training.steps",
                    str(STEPS),
                    "--metrics.log_freq",
                    "10",
                    "--checkpoint.enable",
                    "false",
                    "--metrics.enable_tensorboard",
                    "false",
                    "--job.dump_folder",
                    f"{dump}/{family}-{parallel.replace(' ', '-')}",
                    *PARALLEL[parallel],
                ],
                environment=False,
            )
            trainer = build_trainer_config(run).build()
            # the trainers share their CP group (torch reuses it): each builds its own
            shard_layout.cache_clear()
            builds = []
            logs = counted(trainer, COUNTED, builds)
            try:
                trainer.train()
            finally:
                trainer.close()
                ContextShards.build = build
            results[f"{family} {parallel}"] = logs, builds
        queue.put((rank, results, resume_reads(dump)))
    except Exception as e:  # reported by the test instead of a silent wait
        queue.put((rank, repr(e), None))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def resume_reads(dump) -> list[str]:
    """Train one step with a checkpoint, then resume from it: what this rank read of the checkpoint
    folder as the second run started (the trainer's reads of it, by name)."""
    from canon_titan import trainer as trainer_module
    from canon_titan.config import load
    from canon_titan.config.build import build_trainer_config

    def run(steps):
        config = build_trainer_config(
            load(
                REPO / "train_configs" / "llama_debug.toml",
                [
                    "--training.seq_len",
                    "64",
                    "--training.local_batch_size",
                    "2",
                    "--training.steps",
                    str(steps),
                    "--checkpoint.interval",
                    "1",
                    "--metrics.enable_tensorboard",
                    "false",
                    "--job.dump_folder",
                    f"{dump}/resume",
                ],
                environment=False,
            )
        )
        trainer = config.build()
        try:
            trainer.train()
        finally:
            trainer.close()

    run(1)
    reads, names = [], ("resume_point", "check_resume", "loads_model_only", "saved_loader_keys")
    originals = {name: getattr(trainer_module, name) for name in names}

    def counted(name):
        def read(*args, **kwargs):
            reads.append(name)
            return originals[name](*args, **kwargs)

        return read

    for name in names:
        setattr(trainer_module, name, counted(name))
    try:
        run(2)
    finally:
        for name, original in originals.items():
            setattr(trainer_module, name, original)
    return reads


def test_steps_do_not_wait_for_the_device_or_rebuild_cp_shards_and_one_rank_reads_a_resume(
    tmp_path,
):
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, 2, port, str(tmp_path), CASES, queue)) for r in range(2)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1200) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert not [r for r in results if isinstance(r[1], str)], results
    reads = dict((rank, read) for rank, _, read in results)
    rank0 = ["resume_point", "check_resume", "loads_model_only", "saved_loader_keys"]
    assert reads == {0: rank0, 1: []}, reads
    for rank, cases, _ in results:
        assert list(cases) == [f"{f} {p}" for f, p in CASES]
        for case, (steps, builds) in cases.items():
            if case.endswith(" validation"):  # validated after step 2 (and 4): one read, its loss
                validation = steps.pop(("validation", 2))[0]
                assert (
                    len(validation) == 1
                    and validation[0].startswith("Tensor.tolist at ")
                    and "canon_titan/components/validation.py" in validation[0]
                ), (rank, case, validation)
            assert sorted(steps) == list(COUNTED), (rank, case, steps)
            waits = {step: step_waits for step, (step_waits, _) in steps.items()}
            assert all(not w for w in waits.values()), (rank, case, waits)
            assert builds == ([1] if " cp" in case else []), (rank, case, builds)
            family, parallel = case.split(" ", 1)
            if parallel == "tp":
                for step, (_, all_reduces) in steps.items():
                    backward = [n for in_backward, n in all_reduces if in_backward]
                    assert len(backward) == LAYERS * STATISTICS[family], (
                        rank,
                        case,
                        step,
                        all_reduces,
                    )
                    if family == "llama_canon":
                        sizes = [n for _, n in all_reduces]
                        assert sizes.count(replicated_llama_canon()) == 1, (rank, step, all_reduces)


def replicated_llama_canon() -> int:
    """Elements of LlamaCanon's replicated weights that each TP rank applies to its share under
    sequence
    parallelism: Canon-A/B/C/D (B and D their channels' rows) and the norms (two per block, on the
    sequence shard or fused into Canon-A/C, and the final one)."""
    import model_registry

    with torch.device("meta"):
        model = model_registry.model_spec("llama_canon", "debug").model.build()

    def numel(*modules):
        return sum(p.numel() for m in modules for p in m.parameters(recurse=False))

    blocks = list(model.layers.values())
    return numel(model.norm) + sum(
        numel(
            b.canonA,
            b.attention.canonB,
            b.canonC,
            b.feed_forward.canonD,
            b.attention_norm,
            b.ffn_norm,
        )
        for b in blocks
    )


def test_the_counter_sees_what_would_wait_on_a_gpu():
    """Each kind of wait, and what does not wait: reads of host tensors, non-blocking copies from
    pinned memory (a loader's batch buffer), work on device tensors."""
    import torch

    from canon_titan.tools.host_memory import host_buffer, to_device

    device = torch.device("cpu", 0)  # a CPU trainer's device, as TorchTitan names it
    params = torch.ones(4, device=device)  # made before counting: on the device
    pageable = torch.arange(4)
    with HostSyncs() as counter:
        labels = host_buffer(10, torch.int64).view(2, 5)[:, 1:]  # a view of a (pinned) batch buffer
        labels.copy_(torch.arange(8).view(2, 4))
        counter.mark_host([labels, pageable])
        tokens = (labels != 1).sum()  # host work on the data loader's tensors
        int(tokens)
        (moved,) = to_device([labels], device)  # the whole buffer, viewed on the device
        loss = (params * moved).sum()
        flag = loss.isfinite().float()
        host = torch.empty(1, device="cpu")
        host.copy_(flag.view(1), non_blocking=True)
        host.tolist()
        made = torch.zeros((), device=device).new_full((), 2.0) + loss
        assert counter.waits == []
        float(loss)
        flag.tolist()
        made.cpu()
        torch.nonzero(params)
        labels.to(device)
        host.copy_(flag.view(1))
        torch.tensor(1.0).to(device).item()
        torch.tensor(1.0, device=device)
        pageable.to(device, non_blocking=True)
        labels.contiguous().to(device, non_blocking=True)  # a copy of the strided view: pageable
        labels.to(device, non_blocking=True)  # strided: ATen makes a pageable contiguous copy first
    kinds = [w.split(" at ")[0] for w in counter.waits]
    made_on_device = "torch.tensor on the device (a blocking copy to the device)"
    pageable = "a copy to the device from pageable memory"
    assert kinds == [
        "aten._local_scalar_dense.default",
        "Tensor.tolist",
        "Tensor.cpu",
        "aten.nonzero.default",
        "a blocking copy to the device",
        "a copy from the device",
        "a blocking copy to the device",
        "aten._local_scalar_dense.default",
        made_on_device,
        pageable,
        pageable,
        pageable,
    ], counter.waits
    assert all("test_host_work.py" in w for w in counter.waits), counter.waits
