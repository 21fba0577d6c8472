"""Every data loader builds each batch in one pinned host buffer (on a CPU run, a buffer standing in
for pinned memory), the batch's tensors views of it, and the step copies that buffer once and views
it alike on the device; ``[dataloader] pin_memory = false`` leaves batches in pageable memory, which
``scripts/benchmarks/host_syncs.py`` counts as a wait. At 381a133 the packed loader's inputs and
labels were two pageable, non-contiguous views of a numpy stack (each copy first made a pageable
temporary), and there was no ``pin_memory`` key."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from canon_titan.config import load
from canon_titan.config.build import build_trainer_config
from canon_titan.data.tokenizers import build_tokenizer
from canon_titan.tools.host_memory import is_pinned, to_device
from conftest import CONFIGS, REPO

DEPO = REPO / "train_configs" / "playground" / "depo.toml"
STREAMED = ["--dataloader.dataset", "stream", "--dataloader.sources", '["{src}/*.jsonl"]']


class Copies(TorchDispatchMode):
    """The copies dispatched (``_to_copy``, ``copy_``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
        return func(*args, **(kwargs or {}))


def first_batch(config, overrides, tmp_path):
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "a.jsonl").write_text(
        "".join(f'{{"text": "Story {i}: a cat sat on a mat."}}\n' for i in range(200))
    )
    overrides = [o.format(src=src) for o in overrides]
    run = load(
        config,
        [
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "2",
            *overrides,
        ],
        environment=False,
    )
    tokenizer = build_tokenizer(run["tokenizer"]["kind"], build_trainer_config(run).hf_assets_path)
    loader = build_trainer_config(run).dataloader.build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=64, local_batch_size=2
    )
    return next(iter(loader))


@pytest.mark.parametrize(
    "config, overrides",
    [
        (CONFIGS["llama"], []),
        (
            CONFIGS["llama"],
            ["--dataloader.document_masking", "true", "--dataloader.num_workers", "1"],
        ),
        (DEPO, []),
        (CONFIGS["llama"], STREAMED),
        (
            CONFIGS["llama"],
            [*STREAMED, "--dataloader.num_workers", "1", "--dataloader.document_masking", "true"],
        ),
    ],
    ids=["builtin", "builtin-documents-worker", "synthetic", "stream", "stream-documents-worker"],
)
def test_a_batch_is_one_pinned_buffer_copied_once(tmp_path, config, overrides):
    inputs, labels = first_batch(config, overrides, tmp_path)
    tensors = [*inputs.values(), labels]
    # The documents' boundaries (fla's layout) vary in size by batch: a second, small buffer.
    buffers = 2 if "cu_seqlens" in inputs else 1
    assert len({id(t._base) for t in tensors}) == buffers and all(
        t._base is not None for t in tensors
    )
    assert all(is_pinned(t) for t in tensors)
    device = torch.device("cpu", 0)
    with Copies() as copies:
        moved = to_device(tensors, device)
    assert copies.count == buffers
    assert all(torch.equal(m, t) and m.shape == t.shape for m, t in zip(moved, tensors))
    # views of the device copies, one a buffer
    assert len({m.untyped_storage().data_ptr() for m in moved}) == buffers
    assert moved[0].untyped_storage().data_ptr() != tensors[0].untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "config, overrides",
    [(CONFIGS["llama"], []), (DEPO, []), (CONFIGS["llama"], STREAMED)],
    ids=["builtin", "synthetic", "stream"],
)
def test_pin_memory_false_leaves_batches_pageable(tmp_path, config, overrides):
    inputs, labels = first_batch(config, [*overrides, "--dataloader.pin_memory", "false"], tmp_path)
    assert not any(is_pinned(t) for t in [*inputs.values(), labels])


def test_loader_workers_prefetch_the_same_batches_in_order_and_resume_where_the_step_is():
    """Two loader workers of the packed loader give the batches of the training process's own
    reading, in order; the position saved is that of the batches the step took, not of those the
    workers made ahead, so a resume continues with the next one."""
    workers = ["--dataloader.num_workers", "2"]

    def batches(overrides, count, state=None):
        run = load(CONFIGS["llama"], ["--training.seq_len", "64", *overrides], environment=False)
        config = build_trainer_config(run)
        tokenizer = build_tokenizer(run["tokenizer"]["kind"], config.hf_assets_path)
        loader = config.dataloader.build(
            dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=64, local_batch_size=2
        )
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        return [next(it)[1].clone() for _ in range(count)], loader.state_dict()

    alone, _ = batches([], 6)
    prefetched, state = batches(workers, 3)
    assert all(torch.equal(a, b) for a, b in zip(alone[:3], prefetched))
    assert state["next_sample"] == 3 * 2
    resumed, _ = batches(workers, 3, state)
    assert all(torch.equal(a, b) for a, b in zip(alone[3:], resumed))
