"""The host's side of a linear model's layer (``scripts/benchmarks/linear_host.py``), held so that a
regression shows without a GPU: per custom op, the Python calls, Triton launches and torch kernels
of one block's forward and backward (Mamba2Canon-1B was host-bound on the H200s: 357 ms of host work
for 165 ms of kernels at 4096). And the trainer figures' table (``bench_linear.py --tables
trainer``): the recipes' 16,384 x 1 first."""

import os
import sys
from types import SimpleNamespace

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="counted in Triton's interpreter mode"
)

LAUNCHES = {
    "fla_chunk_gla": 5,
    "fla_chunk_gla_backward": 7,
    "mamba_chunk_scan": 5,
    "mamba_chunk_scan_backward": 14,
}
"""Triton kernels per call, read from the packages' sources: fla's ``chunk_gla_fwd`` (local cumsum,
chunk states, two intra-chunk score kernels, output) and ``chunk_gla_bwd`` (cumsum and states again,
state gradients, dv, dA, intra, inter); mamba-ssm's combined forward (cumsum, chunk states, state
passing, C B^T, scan) and backward (the forward's first four again, then ten)."""
PYTHON_CALLS = {
    "fla_chunk_gla": 240,
    "fla_chunk_gla_backward": 360,
    "mamba_chunk_scan": 125,
    "mamba_chunk_scan_backward": 430,
}
"""Python calls per call, at most: about 10% over 2026-11-29's counts (220, 328, 113, 392; fla's
were 301 and 424 while its ``input_guard`` wrapped fla's functions afresh on every call)."""


@pytest.fixture(scope="module")
def host_paths():
    import linear_host

    return {family: linear_host.layer_host_path(family) for family in ("gla5", "mamba2")}


def test_the_recurrences_host_path_per_call(host_paths):
    """One call each of the recurrence's forward and backward per layer, with the Triton launches
    the packages' sources make and no more Python calls than held; GLA's forward runs two torch
    kernels, a zeroing of fla's and canon-titan's zeroing of A where fla leaves it unwritten (its
    mask made once per shape: it was four kernels)."""
    ops = {**host_paths["gla5"]["ops"], **host_paths["mamba2"]["ops"]}
    for op, launches in LAUNCHES.items():
        assert ops[op]["calls"] == 1, op
        assert ops[op]["triton_launches"] == launches, (op, ops[op])
        assert ops[op]["python_calls"] <= PYTHON_CALLS[op], (op, ops[op])
    assert ops["fla_chunk_gla"]["torch_kernels"] == 2


def test_a_layers_host_path(host_paths):
    """Per layer (Canon A, C, D and the short convolutions b with the recurrence): every custom op
    launches its Triton kernels, and the layer's totals (what the report's step figures multiply by
    the layer count)."""
    for family, per_layer_ops in (("gla5", 14), ("mamba2", 10)):
        path = host_paths[family]
        assert path["total"]["custom_op_calls"] <= per_layer_ops, path["ops"]
        assert all(v["triton_launches"] >= 1 for v in path["ops"].values()), path["ops"]
        assert path["total"]["triton_launches"] == sum(
            v["calls"] * v["triton_launches"] for v in path["ops"].values()
        )
    import linear_host

    table = linear_host.table(list(host_paths.values()))
    assert (
        "| gla5:AbbCD | fla_chunk_gla | 1 | " in table and "| mamba2:AbbCD | **layer** | " in table
    )


def test_the_trainer_table_puts_the_recipes_shape_first():
    """bench_linear's trainer table from hand-made runs: 16,384 x 1 first, with the x1.5 target
    marked for the linear models against Llama at the same shape; 4096 x 2 after it, unmarked; a
    failed run is a row saying so."""
    import bench_linear

    def run(spec, seq, batch, tps):
        return {
            "spec": spec,
            "seq_len": seq,
            "batch": batch,
            "tokens_per_s": tps,
            "mfu_pct": 40.0,
            "peak_reserved_gib": 40.0,
            "first_step_s": 55.0,
            "kernels": "",
        }

    results = [
        run("llama", 16384, 1, 35000.0),
        run("gla5:AbbCD", 16384, 1, 56000.0),
        run("llama", 4096, 2, 46000.0),
        run("gla5:AbbCD", 4096, 2, 40000.0),
    ]
    args = SimpleNamespace(
        trainer_flavor="1B", trainer_compile=True, trainer_warmup=10, trainer_steps=30
    )
    rows = bench_linear.trainer_table(
        results, ["llama", "gla5:AbbCD", "mamba2:AbbCD"], [16384, 4096], args
    ).splitlines()[4:]
    assert rows[0].startswith("| 1 x 16384 | llama | - | 35,000 | x1.00 |")
    assert rows[1].startswith("| 1 x 16384 | gla5 | AbbCD | 56,000 | x1.60 ok |")
    assert rows[2] == "| - x 16384 | mamba2 | AbbCD | failed | | | | |"
    assert rows[4].startswith("| 2 x 4096 | gla5 | AbbCD | 40,000 | x0.87 |")
