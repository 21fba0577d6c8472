"""Every parallelism, with Canon-ABCD, QK-norm and partial RoPE (llama_canon debug), against a
single-process run of the same model, weights (seed checkpoint) and global batch.

Tolerances: losses 1e-5 relative, grad norms 1e-4 relative. The runs differ only in the order
of fp32 reductions (sharded matmuls, reduce-scatter, pipeline micro-batch accumulation); the
measured differences are <= 2.2e-7 for losses and <= 6.4e-6 for grad norms (a norm sums the
squares of every gradient entry, so it collects more rounding). Any real error (a wrong shard, a
missing all-reduce, a mis-scaled micro-batch) shows at >= 1e-3.
"""

import subprocess
from pathlib import Path

import pytest
import torch

import slurm_standin
from canon_titan.components.metrics import read_scalars
from conftest import (
    COMMON,
    CONFIGS,
    REPO,
    free_port,
    made_once,
    run_training,
    seed_checkpoint,
    start_from,
    torchrun_cmd,
    train_env,
)

pytestmark = pytest.mark.slow

STEPS = ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "100"]
SHORT = ["--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "100"]
"""Runs whose steps take 12 s each (the Triton kernels in the interpreter) take two: the first step
checks the forward and backward on the starting weights, the second the update they led to."""
GLOBAL_BATCH = 4


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    return seed_checkpoint("llama_canon", tmp_path_factory)


def _reference(seed, tmp_path_factory, name, steps):
    """(losses, grad norms) of one process, trained once per session whichever worker asks first."""
    dump = made_once(
        tmp_path_factory,
        f"parallelism_{name}",
        lambda dump: run_training(
            1,
            COMMON
            + steps
            + [
                "--job.dump_folder",
                str(start_from(seed, dump)),
                "--training.local_batch_size",
                str(GLOBAL_BATCH),
            ],
            config=CONFIGS["llama_canon"],
        ),
    )
    return read_scalars(dump), read_scalars(dump, "grad_norm")


@pytest.fixture(scope="module")
def reference(seed, tmp_path_factory):
    return _reference(seed, tmp_path_factory, "reference", STEPS)


@pytest.fixture(scope="module")
def short_reference(seed, tmp_path_factory):
    """The reference's run cut to ``SHORT`` (its learning-rate schedule is the run's length)."""
    return _reference(seed, tmp_path_factory, "short_reference", SHORT)


MASKED = ["--dataloader.document_masking", "true"]


@pytest.fixture(scope="module")
def masked_reference(seed, tmp_path_factory):
    """One process with per-document attention (positions restart at every BOS)."""
    return _reference(seed, tmp_path_factory, "masked_reference", STEPS + MASKED)


def train(seed, tmp_path, nproc, args, dp=1, steps=STEPS):
    dump = start_from(seed, tmp_path / "run")
    out = run_training(
        nproc,
        COMMON
        + steps
        + [
            "--job.dump_folder",
            str(dump),
            "--training.local_batch_size",
            str(GLOBAL_BATCH // dp),
            *args,
        ],
        config=CONFIGS["llama_canon"],
    )
    return dump, out


def assert_matches(reference, dump, loss_rtol=1e-5, grad_rtol=1e-4, steps=6):
    loss, grad = reference
    got_loss, got_grad = read_scalars(dump), read_scalars(dump, "grad_norm")
    assert list(got_loss) == list(loss) == list(range(1, steps + 1))
    for step in loss:
        assert got_loss[step] == pytest.approx(loss[step], rel=loss_rtol), ("loss", step)
        assert got_grad[step] == pytest.approx(grad[step], rel=grad_rtol), ("grad_norm", step)


@pytest.mark.parametrize("sp", ["true", "false"])
def test_tensor_parallel(seed, reference, tmp_path, sp):
    dump, out = train(
        seed,
        tmp_path,
        2,
        ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", sp],
    )
    assert f"Applied tensor parallelism (degree 2, sequence parallel {sp == 'true'})" in out
    assert_matches(reference, dump)


@pytest.mark.parametrize(
    "schedule, extra, stages",
    [
        ("1F1B", [], {0: ["0"], 1: ["1"]}),
        # 4 stages of one layer each (embeddings/output counted with their layer): 2 per rank.
        (
            "Interleaved1F1B",
            [
                "--parallelism.pipeline_parallel_layers_per_stage",
                "1",
                "--parallelism.pipeline_parallel_first_stage_less_layers",
                "0",
                "--parallelism.pipeline_parallel_last_stage_less_layers",
                "0",
            ],
            {0: ["0", "2"], 1: ["1", "3"]},
        ),
    ],
)
def test_pipeline_parallel(seed, reference, tmp_path, schedule, extra, stages):
    dump, out = train(
        seed,
        tmp_path,
        2,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            schedule,
            *extra,
        ],
    )
    for rank, stage_ids in stages.items():
        for stage in stage_ids:
            assert f"PP rank {rank} is building stage_idx {stage} " in out
    assert_matches(reference, dump)


def test_fsdp_times_tp_on_four_processes(seed, reference, tmp_path):
    dump, out = train(
        seed,
        tmp_path,
        4,
        [
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
        dp=2,
    )
    assert "dp_shard=2" in out and "tp=2" in out
    assert_matches(reference, dump)


def test_hsdp_replicate_by_shard(seed, reference, tmp_path):
    dump, out = train(
        seed,
        tmp_path,
        2,
        [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ],
        dp=2,
    )
    assert "dp_replicate=2, dp_shard=1" in out
    assert_matches(reference, dump)


# Full AC under FSDP=2 runs against the same reference in
# test_triton_canon_kernels_train_as_the_torch_ones[fsdp_ac_compile] (suite time).
@pytest.mark.parametrize("mode, name", [("selective", "SelectiveAC")])
def test_activation_checkpointing(seed, reference, tmp_path, mode, name):
    dump, out = train(seed, tmp_path, 2, ["--activation_checkpoint.mode", mode], dp=2)
    assert f"Applied {name} activation checkpointing" in out
    assert_matches(reference, dump)


def test_compile_with_fsdp(seed, reference, tmp_path):
    dump, out = train(seed, tmp_path, 2, ["--compile.enable"], dp=2)
    assert "Compiling each TransformerBlock with torch.compile" in out
    # Inductor also fuses and reorders the elementwise fp32 work of each block.
    assert_matches(reference, dump, loss_rtol=1e-4, grad_rtol=1e-3)


# Sequence parallel only (suite time): without it the embedding's collective is an all-reduce
# instead of a reduce-scatter, through the same EmbeddingParallel; measured equally close.
@pytest.mark.parametrize("sp", ["true"])
def test_compile_with_tensor_parallel(seed, reference, tmp_path, sp):
    """Compiled blocks under TP=2: the embedding's gradient reaches it through the first compiled
    block (torch 2.13 drops the gradient of an AsyncCollectiveTensor block input; see
    ``EmbeddingParallel``). Without that the embedding gets no gradient: grad norm -12% at step
    1."""
    dump, out = train(
        seed,
        tmp_path,
        2,
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.enable_sequence_parallel",
            sp,
            "--compile.enable",
        ],
    )
    assert "Compiling each TransformerBlock with torch.compile" in out
    assert f"Applied tensor parallelism (degree 2, sequence parallel {sp == 'true'})" in out
    assert_matches(reference, dump, loss_rtol=1e-4, grad_rtol=1e-3)


def float8_args(recipe: str) -> list[str]:
    return ["--float8.enable", "--float8.emulate", "--float8.recipe_name", recipe]


def final_weights(dump: Path) -> dict:
    from canon_titan.convert.dcp_io import find_step_dir, load_tensor, model_tensor_metadata

    step = find_step_dir(dump / "checkpoint")
    return {
        name: load_tensor(step, name, meta) for name, meta in model_tensor_metadata(step).items()
    }


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_float8_alone_and_with_tensor_parallel(seed, reference, tmp_path, recipe):
    """Emulated float8 on one process stays close to fp32; with TP=2 and sequence parallel it stays
    as close to that float8 run as float8 rounding allows, and away from fp32 (float8 is on). Over
    gloo the TP group moves high-precision activations (gloo has no float8 dtype; on NCCL
    tensorwise scaling takes torchao's float8 styles, checked in test_model.py), the matmuls cast.
    Row-wise scales of a row-sharded linear (wo, w2) cover only the rank's half of the inner
    dimension, so they differ from one process's by design: the runs agree to ~1e-3, not exactly."""
    one, out = train(seed, tmp_path / "one", 1, float8_args(recipe))
    assert "Swapped to Float8Linear layers" in out and f"float8: recipe {recipe}, emulated" in out
    loss, got = reference[0], read_scalars(one)
    # e4m3 keeps 3 mantissa bits (~6% error per element); averaged over dot products and tokens
    # the loss moved <= 0.5% in 6 steps here. 2% bounds it; equality would mean float8 was off.
    assert all(got[s] == pytest.approx(loss[s], rel=2e-2) for s in loss)
    assert any(got[s] != loss[s] for s in loss)
    tp, out = train(
        seed,
        tmp_path / "tp",
        2,
        float8_args(recipe) + ["--parallelism.tensor_parallel_degree", "2"],
    )
    assert "Swapped to Float8Linear layers" in out and "Applied tensor parallelism" in out
    # Each float8 run's grad norm moves from fp32's by rounding, either way: at step 4 of this run
    # on an AMD EPYC, one process -0.7% and TP +2.3% (other steps under 0.5%). The two differ by up
    # to the sum; a TP defect (a missing or doubled reduction) moves it by tens of percent.
    assert_matches((got, read_scalars(one, "grad_norm")), tp, loss_rtol=3e-3, grad_rtol=5e-2)
    tp_loss = read_scalars(tp)
    assert (
        max(abs(tp_loss[s] - loss[s]) / loss[s] for s in loss) > 1e-4
    )  # not the fp32 run's losses


def test_fsdp_times_tp_gathers_float8_weights_in_float8_as_each_rank_would_cast_them(
    seed, tmp_path
):
    """``[float8] enable_fsdp_float8_all_gather`` with the scales precomputed (which TP requires) on
    FSDP 2 x TP 2: each rank casts its shard of a weight with the amax of the whole weight (all of
    its FSDP and TP shards), from the first step on (the scales are computed after the seed
    checkpoint loads, not only after each optimizer step), so the gathered float8 weight is the one
    each rank casts from the gathered high-precision weight without the option, and the run trains
    as that float8 run does (losses and grad norms to 1e-5 / 1e-4, as every layout here; measured:
    equal). With torchao's own pre-all-gather amax, or scales first computed after step 1, each TP
    shard took its own scale on step 1 (loss 7.12713 against 7.12977, grad norm -0.4%). Its
    reference is the same layout without the option, not one process: tensorwise scaling takes each
    activation's amax over the rank's own batch, so data parallelism changes the float8 rounding.
    Both runs start from the seed checkpoint (loaded into the wrapped weights) and end with a
    checkpoint of plain tensors, whose weights agree. That the gathers move one byte a weight
    element is
    ``test_plan.py``'s."""
    f8 = float8_args("tensorwise")
    layout = [
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
    ]
    plain, _ = train(seed, tmp_path / "plain", 4, f8 + layout, dp=2)
    dump, out = train(
        seed,
        tmp_path / "gathered",
        4,
        f8
        + layout
        + [
            "--float8.enable_fsdp_float8_all_gather",
            "true",
            "--float8.precompute_float8_dynamic_scale_for_fsdp",
            "true",
        ],
        dp=2,
    )
    linears = 7 * 4  # wq, wk, wv, wo, w1, w2, w3 of each of the debug model's 4 blocks
    assert f"float8: FSDP all-gathers the weights of {linears} float8 linears in float8" in out
    assert "dp_shard=2" in out and "tp=2" in out
    assert_matches((read_scalars(plain), read_scalars(plain, "grad_norm")), dump)
    ours, theirs = final_weights(dump), final_weights(plain)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-7, msg=name)


def test_context_parallel_training_matches_one_process(seed, reference, tmp_path):
    """CP=2 on 2 processes (FSDP over the CP group, as TorchTitan shards it): the debug
    llama_canon's losses and grad norms equal the 1-process run's."""
    dump, out = train(seed, tmp_path, 2, ["--parallelism.context_parallel_degree", "2"])
    assert "cp=2" in out
    assert_matches(reference, dump)


def test_context_parallel_with_document_masking_matches_one_process(
    seed, masked_reference, tmp_path
):
    cp, _ = train(seed, tmp_path, 2, MASKED + ["--parallelism.context_parallel_degree", "2"])
    assert_matches(masked_reference, cp)


def test_context_parallel_times_fsdp_on_four_processes(seed, reference, tmp_path):
    dump, out = train(seed, tmp_path, 4, ["--parallelism.context_parallel_degree", "2"], dp=2)
    assert "dp_shard=2, cp=2" in out
    assert_matches(reference, dump)


@pytest.mark.parametrize("sp", ["true", "false"])
def test_context_parallel_times_tensor_parallel_on_four_processes(
    seed, short_reference, tmp_path, sp
):
    """CP 2 x TP 2 with and without sequence parallelism, Canon-ABCD and QK-norm: each TP rank's
    heads gather their K and V, and its Canon-B/D channels their halos, over the CP ranks that hold
    the same shard; the TP regions gather the rank's CP share of the sequence. Two steps (the first
    checks the forward and backward on the starting weights, the second the update) against one
    process."""
    dump, out = train(
        seed,
        tmp_path,
        4,
        [
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.enable_sequence_parallel",
            sp,
        ],
        steps=SHORT,
    )
    assert "cp=2" in out and "tp=2" in out
    assert f"Applied tensor parallelism (degree 2, sequence parallel {sp.title()})" in out
    assert_matches(short_reference, dump, steps=2)


def test_two_launchers_on_loopback_train_together(seed, reference, tmp_path):
    """Two torchrun agents, --nnodes 2 with a c10d rendezvous, as two machines would."""
    dump = start_from(seed, tmp_path / "run")
    port = free_port()
    args = COMMON + STEPS + ["--job.dump_folder", str(dump), "--training.local_batch_size", "2"]
    procs = []
    for node in range(2):
        cmd = torchrun_cmd(1, CONFIGS["llama_canon"], args)
        cmd[cmd.index("--standalone")] = "--nnodes=2"
        cmd[3:3] = [
            f"--node_rank={node}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}",
            f"--rdzv_id=loopback-{port}",
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env=train_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    assert "dp_shard=2" in outputs[0]
    assert_matches(reference, dump)


def test_slurm_template_launches_a_two_node_job(seed, reference, tmp_path):
    """scripts/train.slurm under bash, with stand-ins for scontrol (node list) and srun (one
    task per node, here two local processes; tests/slurm_standin.py), so its real torchrun command
    line is exercised."""
    bin_dir = slurm_standin.install(tmp_path / "bin")
    dump = start_from(seed, tmp_path / "run")
    port = free_port()
    env = dict(
        train_env(),
        PATH=f"{bin_dir}:{train_env()['PATH']}",
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_NNODES="2",
        SLURM_JOB_ID=str(port),
        SLURM_SUBMIT_DIR=str(REPO),
        GPUS_PER_NODE="1",
        RDZV_PORT=str(port),
    )
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "scripts" / "train.slurm"),
            str(CONFIGS["llama_canon"]),
            *COMMON,
            *STEPS,
            "--job.dump_folder",
            str(dump),
            "--training.local_batch_size",
            "2",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert_matches(reference, dump)


def test_document_masking_under_tensor_parallel(seed, masked_reference, tmp_path):
    """Per-document attention (positions from the loader) is exact under TP with SP too."""
    dump, _ = train(seed, tmp_path, 2, MASKED + ["--parallelism.tensor_parallel_degree", "2"])
    assert_matches(masked_reference, dump)


@pytest.mark.parametrize(
    "nproc, dp, args, applied",
    [
        # No one-process case (each FSDP rank below runs the whole model on its batch, as one
        # process would) and no PP case (a stage runs the op as the whole model does; PP is checked
        # with torch).
        (
            2,
            1,
            [
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.enable_sequence_parallel",
                "true",
            ],
            "Applied tensor parallelism (degree 2, sequence parallel True)",
        ),
        (
            2,
            2,
            ["--activation_checkpoint.mode", "full", "--compile.enable"],
            "Applied FullAC activation checkpointing",
        ),
    ],
    ids=["tp_sp", "fsdp_ac_compile"],
)
def test_triton_canon_kernels_train_as_the_torch_ones(
    seed, short_reference, tmp_path, nproc, dp, args, applied
):
    """canon_backend = "triton" (the custom ops, in Triton's interpreter here) against the torch
    backend's single-process reference: Canon-B/D on TP channel shards, Canon-A/C after the SP
    all-gather, recomputed under activation checkpointing, inside compiled blocks. Two steps
    (``SHORT``): six took 156 and 123 s of the suite."""
    dump, out = train(
        seed, tmp_path, nproc, ["--model.canon_backend", "triton", *args], dp=dp, steps=SHORT
    )
    assert "backend triton (requested triton)" in out
    assert applied is None or applied in out
    compiled = "--compile.enable" in args
    assert_matches(
        short_reference,
        dump,
        loss_rtol=1e-4 if compiled else 1e-5,
        grad_rtol=1e-3 if compiled else 1e-4,
        steps=2,
    )
