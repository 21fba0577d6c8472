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
