"""``canon-titan plan`` against what it got wrong when held to published GPU measurements (issue 42):
pipeline with tensor parallelism, the GPU table, compile with activation checkpointing.

References: the unsplit model's parameters (built whole on the meta device), the process groups
a layout puts each rank in (hand arithmetic of TorchTitan's mesh order), the GPU vendors'
datasheets, and the eager plan of the same run.
"""

import pytest
import torch

from canon_titan.plan.gpus import GPUS
from conftest import REPO

LLAMA_8B = REPO / "train_configs" / "Llama-8B-Nemo-1T-lr0.003.toml"
LLAMA_405B_SHAPE = ["--model.dim", "16384", "--model.n_heads", "128", "--model.n_kv_heads", "8",
                    "--model.ffn_hidden_dim", "53248", "--model.rope_theta", "500000"]
"""Llama-3.1-405B's shape (its config.json) in the ``llama`` family."""


def _whole_model_parameters(config, overrides) -> int:
    from canon_titan.config import load

    run = load(str(config), overrides, environment=False)
    with torch.device("meta"):
        model = run.model_spec().model.build()
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("layout", [
    # the repro: 8B cut to 8 layers, TP 2 x PP 2 on 8 GPUs
    (8, ["--model.n_layers", "8", "--parallelism.tensor_parallel_degree", "2",
         "--parallelism.pipeline_parallel_degree", "2"]),
    # Llama-3.1-405B's width on TorchTitan's 3D layout (FSDP 8 x TP 8 x PP 8 on 512 GPUs), one
    # layer per stage
    (512, [*LLAMA_405B_SHAPE, "--model.n_layers", "8", "--parallelism.tensor_parallel_degree", "8",
           "--parallelism.pipeline_parallel_degree", "8", "--training.local_batch_size", "8",
           "--training.global_batch_size", "64", "--training.seq_len", "1024"]),
], ids=["8B TP 2 x PP 2", "405B shape TP 8 x PP 8"])
def test_pipeline_with_tensor_parallel_plans_every_stage(layout):
    """Every stage of a TP x PP run is planned (the second one failed: DTensor's cached output
    shardings carried the first stage's meshes into the next fake world). The stages hold the
    whole model once between them, and each stage runs its TP collectives over ``tp`` ranks and
    sends to or receives from its neighbours."""
    from canon_titan.plan.planner import plan

    gpus, extra = layout
    overrides = [*extra, "--parallelism.pipeline_parallel_schedule", "1F1B", "--compile.enable", "false"]
    result = plan(str(LLAMA_8B), overrides, gpus=gpus, gpu=GPUS["h100"], advise=False)
    pp = result.parallel["pp"]
    tp = result.parallel["tp"]
    assert len(result.kinds) == pp and [k.rank for k in result.kinds] == [s * gpus // pp for s in range(pp)]
    assert result.param_count == _whole_model_parameters(LLAMA_8B, overrides)
    assert result.fits and result.tokens_per_s_per_gpu > 0
    for kind in result.kinds:
        tp_collectives = [c for c in kind.time.collectives if c.group == "tp"]
        assert tp_collectives and all(c.ranks == tp for c in tp_collectives)
        assert any(c.kind in ("send", "recv") for c in kind.time.collectives)


# ----------------------------------------------------------------- compile with activation checkpointing


def _trace(ops, events):
    from canon_titan.plan.fake_world import RankStep
    from canon_titan.plan.recorder import StepTrace

    trace = StepTrace(ops=list(ops), memory_events=list(events), marks={"group 0": 0, "optimizer": len(ops)})
    return RankStep(rank=0, trace=trace, categories={}, state_bytes={}, group_names={}, accumulation=1,
                    groups_run=1, tokens_per_group=1)


def _op(kind, reads=(), read_bytes=(), writes=(), write_bytes=(), phase="forward", name="op"):
    from canon_titan.plan.recorder import Op

    return Op(kind, phase, name, 10**9 if kind == "matmul" else 0, sum(read_bytes) + sum(write_bytes),
              torch.bfloat16, tuple(reads), tuple(read_bytes), tuple(writes), tuple(write_bytes))


def _peak(events) -> int:
    live, best = 0, 0
    for _, _, delta in events:
        live += delta
        best = max(best, live)
    return best


def test_compile_keeps_inputs_alive_only_where_that_saves_memory():
    """A forward elementwise run reads a big matmul output h (16 MiB) and writes a small c (1 MiB)
    that only the backward reads. Eager stores c and frees h after the run; recomputing c in the
    backward would keep h alive instead, 16 times the bytes: the partitioner stores c, and h is
    freed where eager frees it. A buffer the run allocates (``empty``) and the backward fills has
    nothing to be recomputed from: it is stored too."""
    from canon_titan.plan.estimate import compiled_memory_events

    mb = 2**20
    ops = [_op("matmul", (0, 9), (mb, mb), (1,), (16 * mb,)),                    # h = x @ w
           _op("other", (1,), (16 * mb,), (2,), (mb,)),                            # c = f(h)
           _op("other", (), (), (3,), (0,), name="empty"),                         # a buffer for later
           _op("matmul", (0, 9), (mb, mb), (4,), (mb,)),                           # the next block
           _op("other", (2, 4), (mb, mb), (5,), (mb,), phase="backward"),        # reads c
           _op("other", (3,), (0,), (6,), (mb,), phase="backward")]              # fills the buffer
    events = [(0, 0, mb), (0, 9, mb), (1, 1, 16 * mb), (2, 2, mb), (2, 1, -16 * mb), (3, 3, 4 * mb),
              (4, 4, mb), (5, 5, mb), (5, 2, -mb), (6, 6, mb), (6, 3, -4 * mb)]
    compiled = compiled_memory_events(_trace(ops, events))
    freed_h = [op for op, sid, delta in compiled if sid == 1 and delta < 0]
    assert freed_h == [2]  # where eager frees it
    assert {sid for _, sid, _ in compiled} >= {2, 3}  # c and the buffer are stored
    assert _peak(compiled) <= _peak(events)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_compiled_checkpointed_plan_needs_no_more_memory_than_the_eager_one(mode):
    """Compile only removes what eager stores (fused intermediates) or trades a saved tensor for
    fewer bytes: with activation checkpointing, FSDP and TP, the compiled plan's peak is at most
    the eager plan's (it was several times higher: the forward's checkpointed-away activations and
    FSDP's buffers were held until the backward)."""
    from canon_titan.plan.planner import plan
    from conftest import CONFIGS

    overrides = ["--training.seq_len", "128", "--activation_checkpoint.mode", mode,
                 "--parallelism.tensor_parallel_degree", "2", "--model.n_layers", "6"]
    peaks = {}
    for compiled in ("false", "true"):
        result = plan(str(CONFIGS["llama"]), [*overrides, "--compile.enable", compiled], gpus=8,
                      gpu=GPUS["h100"], advise=False)
        peaks[compiled] = result.worst.memory.total
    assert peaks["true"] <= peaks["false"], peaks
